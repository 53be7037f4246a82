"""GPU benchmark of the plaintext engine (random weights in real model shapes: speed does not depend on them).

For each shape (Qwen2.5-0.5B, Llama-3.2-1B), in one run:
1. sanity: top-5 next-token logprobs of our paged bf16 path vs transformers on the same weights;
2. offline throughput at 1, 64 and 256 concurrent requests (128-token prompts, 256 output tokens, greedy,
   EOS ignored) for our engine and for transformers' continuous batching ``generate_batch`` (when the
   installed transformers has it), same weights, same GPU, one after the other;
3. batch-1 decode step time, (t(257 new) - t(1 new)) / 256, against the bandwidth floor
   ``(weight bytes + KV bytes at the mean context) / measured copy bandwidth``.

Usage: python bench/engine_gpu.py [--shapes qwen2.5-0.5b,llama3.2-1b] [--concurrency 1,64,256]
                                   [--hf-concurrency 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.llm import LLM
from engine.model import LlamaForCausalLM, RotaryEmbedding
from engine.sampling_params import SamplingParams

SHAPES = {
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                         rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True, attention_bias=True,
                         max_position_embeddings=32768),
    "llama3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
                        max_position_embeddings=131072,
                        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
PROMPT_LEN, OUTPUT_LEN = 128, 256


def random_model(cfg: ModelConfig, seed: int = 0) -> LlamaForCausalLM:
    """Our model with N(0, 0.02) weights, built directly on the GPU in bf16."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cuda")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rotary = RotaryEmbedding(cfg).cuda()
    return model.to(torch.bfloat16).eval()


def hf_twin(model: LlamaForCausalLM):
    """The transformers model of the same config and weights (bf16, GPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = model.config.to_hf_dict()
    d.pop("architectures")
    cfg = AutoConfig.for_model(d.pop("model_type"), **{k: v for k, v in d.items() if v is not None})
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    ok = not unexpected and all("rotary" in k or k == "lm_head.weight" for k in missing)
    assert ok, (missing, unexpected)
    return hf.eval()


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, PROMPT_LEN), generator=g).tolist()


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s, counting bytes read and written (median of 10)."""
    x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    ts = sorted(timed(lambda: y.copy_(x)) for _ in range(10))  # noqa: B023
    return 2 * (4 << 30) / ts[len(ts) // 2]


@torch.inference_mode()
def sanity(llm: LLM, hf, vocab: int) -> float:
    """Our top-5 next-token logprobs (paged bf16 path) vs transformers' for the same tokens, rel. error."""
    ids = prompts(1, vocab, 99)[0]
    ref = hf(torch.tensor([ids], device="cuda")).logits[0].float()
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0].outputs[0]
    ref_lp = ref[-1].log_softmax(-1).cpu()
    toks = list(out.logprobs[0])                       # our sampled token + our top-5
    got = torch.tensor([out.logprobs[0][t] for t in toks])
    return float(((got - ref_lp[toks]).abs().max() / ref_lp[toks].abs().max()).item())


def run_ours(llm: LLM, reqs: list[list[int]]) -> tuple[float, int]:
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    outs: list = []
    dt = timed(lambda: outs.extend(llm.generate(reqs, params)))
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def run_hf(hf, reqs: list[list[int]]) -> tuple[float, int]:
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=OUTPUT_LEN, do_sample=False, eos_token_id=None, pad_token_id=0)
    res: dict = {}
    dt = timed(lambda: res.update(hf.generate_batch(inputs=reqs, generation_config=gen, progress_bar=False)))
    return dt, sum(len(r.generated_tokens) for r in res.values())


def decode_step_time(llm: LLM, vocab: int) -> float:
    ids = prompts(1, vocab, 7)[0]
    bm = llm.engine.block_manager
    bm.enable_prefix_caching = False
    run = lambda k: llm.generate([ids], SamplingParams(temperature=0, max_tokens=k, ignore_eos=True))  # noqa: E731
    run(8)
    t = (timed(lambda: run(OUTPUT_LEN + 1)) - timed(lambda: run(1))) / OUTPUT_LEN
    bm.enable_prefix_caching = True
    return t


def bench_shape(name: str, concurrency: list[int], bw: float, with_hf: bool, hf_conc: list[int]) -> dict:
    cfg = ModelConfig(**SHAPES[name])
    model = random_model(cfg)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    res: dict = {"shape": name, "params_M": sum(p.numel() for p in model.parameters()) / 1e6}
    hf = hf_twin(model) if with_hf else None
    t0 = time.perf_counter()
    llm = LLM(model, engine_config=EngineConfig(device="cuda", max_num_seqs=256, max_num_batched_tokens=8192,
                                                gpu_memory_utilization=0.45, max_model_len=4096))
    res["engine_init_s"] = time.perf_counter() - t0
    res["num_kv_blocks"] = llm.engine.num_blocks
    res["cuda_graphs"] = sorted(llm.engine.runner._graphs)[-1:] or None
    if hf is not None:
        res["logprob_rel_err_vs_hf_bf16"] = sanity(llm, hf, cfg.vocab_size)
    llm.generate(prompts(4, cfg.vocab_size, 1), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for c in concurrency:
        dt, tok = run_ours(llm, prompts(c, cfg.vocab_size, c))
        res[f"ours_c{c}_tok_s"] = tok / dt
        print(name, "ours", c, tok / dt, flush=True)
    step = decode_step_time(llm, cfg.vocab_size)
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2  # K and V, bf16
    kv_bytes = kv_per_token * (PROMPT_LEN + OUTPUT_LEN // 2)  # the mean context of the decode
    floor = (weight_bytes + kv_bytes) / bw
    res.update(decode_step_ms=step * 1e3, floor_ms=floor * 1e3, floor_fraction=floor / step)
    print(name, "decode", res["decode_step_ms"], res["floor_ms"], flush=True)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    if hf is not None:
        if not hasattr(hf, "generate_batch"):
            res["hf"] = "transformers has no generate_batch"
        for c in hf_conc:
            try:
                run_hf(hf, prompts(2, cfg.vocab_size, 5)) if c == hf_conc[0] else None  # warm-up
                dt, tok = run_hf(hf, prompts(c, cfg.vocab_size, c))
                res[f"hf_c{c}_tok_s"] = tok / dt
                res[f"ratio_c{c}"] = res[f"ours_c{c}_tok_s"] / res[f"hf_c{c}_tok_s"]
                print(name, "hf", c, tok / dt, flush=True)
            except Exception as exc:  # noqa: BLE001 - record and go on
                res[f"hf_c{c}_error"] = repr(exc)[:300]
        res["hf_attn_implementation"] = getattr(hf.config, "_attn_implementation", None)
        del hf
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen2.5-0.5b,llama3.2-1b")
    ap.add_argument("--concurrency", default="1,64,256")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--hf-concurrency", help="concurrencies run with transformers (default: --concurrency)")
    ap.add_argument("--json")
    args = ap.parse_args()
    import transformers

    bw = copy_bandwidth()
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "transformers": transformers.__version__,
           "copy_bandwidth_GBps": bw / 1e9, "results": []}
    print(json.dumps(out), flush=True)
    for name in args.shapes.split(","):
        conc = [int(c) for c in args.concurrency.split(",")]
        hf_conc = [int(c) for c in args.hf_concurrency.split(",")] if args.hf_concurrency else conc
        out["results"].append(bench_shape(name, conc, bw, not args.no_hf, hf_conc))
        print(json.dumps(out["results"][-1], indent=1), flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
