"""FP8 KV cache quality on the real default model (CPU, fp32 weights): fp8_e4m3 pools vs fp32 pools.

Both run the engine's paged attention backend (``engine.kv_cache.PagedAttention`` over a ``PagedKVCache``,
through the kernels' torch references on both sides, so only the pools differ); the fp8 pools get the scales
the engine calibrates at load (``calibrate_kv_scales``). Teacher-forced, every position scored:

* chat prompts (the quantized-weights bench's ten, in the chat template) prefilled in one step (the prefill
  path: its rows already attend over the fp8-stored K/V of the chunk), then the fp32 model's 32-token greedy
  continuation fed one decode step at a time (the decode path);
* perplexity on CPython's LICENSE text (no prompt came from it): 256 tokens prefilled, 256 decoded.

Reported per path: mean KL(fp32 pools || fp8 pools) over the full vocabulary, top-1 agreement, positions;
and the pools' bytes per token.

    flock /tmp/cipherlm-bench.lock nice python bench/kv_fp8_quality.py [--threads 1]
"""

from __future__ import annotations

import argparse
import time

PROMPTS = [
    "What is the capital of Italy?", "Write a limerick about a cat.", "Explain gravity to a child.",
    "Name three uses of copper.", "How do vaccines work?", "Give me a recipe for pancakes.",
    "What is a prime number?", "Describe the water cycle.", "Why do leaves change colour in autumn?",
    "Suggest a name for a bakery.",
]
BLOCK = 16


def paged_logits(model, ids: list[int], prefill: int, pool):
    """Logits [len(ids), V] of one sequence: rows [0, prefill) in one prefill step, then one decode step per
    token, through PagedAttention over ``pool`` (blocks 0, 1, ... in order)."""
    import torch

    from engine.kv_cache import AttentionMetadata, PagedAttention

    n = len(ids)
    table = torch.arange(-(-n // BLOCK), dtype=torch.int32)[None, :]
    d = model.config.head_dim
    with torch.inference_mode():
        meta = AttentionMetadata(torch.arange(prefill), 0, prefill_block_tables=table,
                                 prefill_cu_seqlens_q=torch.tensor([0, prefill], dtype=torch.int32),
                                 prefill_context_lens=torch.tensor([prefill], dtype=torch.int32),
                                 prefill_max_q=prefill)
        h = model(torch.tensor(ids[:prefill]), torch.arange(prefill), PagedAttention(pool, meta, d))
        out = [model.logits(h)]
        for p in range(prefill, n):
            meta = AttentionMetadata(torch.tensor([p]), 1, decode_block_tables=table,
                                     decode_context_lens=torch.tensor([p + 1], dtype=torch.int32))
            h = model(torch.tensor(ids[p:p + 1]), torch.tensor([p]), PagedAttention(pool, meta, d))
            out.append(model.logits(h))
    return torch.cat(out)


def ppl_text() -> str:
    """CPython's LICENSE (its history prose first): English text that no prompt came from (as quant_cpu.py)."""
    import sysconfig
    from pathlib import Path

    return (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()


def compare(ref, got, rows: slice) -> tuple[float, int, int]:
    """(sum of KL(ref || got), top-1 agreements, positions) over ``rows``."""
    lp, lq = ref[rows].log_softmax(-1), got[rows].log_softmax(-1)
    kl = float((lp.exp() * (lp - lq)).sum())
    return kl, int((lp.argmax(-1) == lq.argmax(-1)).sum()), lp.shape[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    from engine.threads import configure

    configure(args.threads)
    import torch

    from engine.default_model import default_model_dir
    from engine.kv_cache import PagedKVCache, calibrate_kv_scales
    from engine.loader import load_model
    from engine.model import greedy_generate
    from engine.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    folder = default_model_dir()
    tok, model = Tokenizer.from_folder(folder), load_model(folder).eval()
    cfg = model.config
    t0 = time.perf_counter()
    scales = calibrate_kv_scales(model)
    calib_s = time.perf_counter() - t0
    blocks = -(-512 // BLOCK)

    def pools():
        return (PagedKVCache(cfg, blocks, BLOCK, torch.float32, "cpu"),
                PagedKVCache(cfg, blocks, BLOCK, torch.float8_e4m3fn, "cpu", scales))

    sums = {"prefill": [0.0, 0, 0], "decode": [0.0, 0, 0]}
    for p in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}])
        seq = ids + greedy_generate(model, ids, args.new_tokens)
        ref, fp8 = (paged_logits(model, seq, len(ids), pool) for pool in pools())
        for path, rows in (("prefill", slice(0, len(ids))), ("decode", slice(len(ids), len(seq)))):
            for i, x in enumerate(compare(ref, fp8, rows)):
                sums[path][i] += x
    text = tok.encode(ppl_text())[:512]
    nll = {}
    for name, pool in zip(("fp32", "fp8_e4m3"), pools(), strict=True):
        lq = paged_logits(model, text, 256, pool).log_softmax(-1)[:-1]
        nll[name] = float(-lq.gather(1, torch.tensor(text[1:])[:, None]).mean())
    fp32_pool, fp8_pool = pools()
    per_token = [x.nbytes / (x.num_blocks * x.block_size) for x in (fp32_pool, fp8_pool)]
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, "
          f"{args.threads} thread(s), SmolLM2-135M-Instruct fp32 weights, calibration {calib_s:.2f} s")
    print(f"KV bytes per token: fp32 pools {per_token[0]:.0f}, fp8 pools {per_token[1]:.0f} "
          f"(+ {2 * cfg.num_hidden_layers * cfg.num_key_value_heads * 4} bytes of scales in all)")
    print("| path | positions | mean KL(fp32 pools ‖ fp8 pools) | top-1 agreement |")
    print("|---|---|---|---|")
    for path, (kl, agree, n) in sums.items():
        print(f"| {path} | {n} | {kl / n:.2e} | {100 * agree / n:.1f} % |")
    print(f"perplexity on {len(text)} tokens of CPython's LICENSE (256 prefilled, 255 decoded): "
          f"fp32 pools {torch.tensor(nll['fp32']).exp():.3f}, fp8 pools {torch.tensor(nll['fp8_e4m3']).exp():.3f}")


if __name__ == "__main__":
    main()
