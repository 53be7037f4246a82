"""Quantized weights on the CPU, real default model, every format in one run (issue 19, CPU rows).

Per weight format (``fp32``: the dequantized default; ``q4_1``: the GGUF's Q4_1 blocks and its Q8_0
tied embedding/head run natively; ``int8``: group-wise (32) RTN; ``int8-channel``: per-channel RTN;
``int4``/``int4-g64``: group-wise RTN of the fp32 weights, the head at group-wise int8; GPTQ/AWQ
checkpoints that :mod:`engine.gptq` writes from the fp32 model and the loader reads back natively, named
``LAYOUT-METHOD-gGROUP``: ``gptq-rtn-g64`` (GPTQ's symmetric grid, round-to-nearest), ``gptq-g64``
(GPTQ calibrated on ``--calib-samples`` x ``--calib-len`` tokens of Python's pydoc reference topics —
apart from the chat prompts and the perplexity text — each piece a user message in the chat template;
``gptq-text-g64``: the plain text), ``gptq-act-g64`` (with act-order), ``awq-rtn-g64``
(AWQ GEMM layout, AWQ's asymmetric grid, round-to-nearest); their embedding/head stay fp32):

* quality against the fp32 model — mean KL(fp32 || format) and greedy (top-1) agreement, teacher-forced
  on every position of held-out chat prompts plus the fp32 model's greedy continuations, and perplexity
  on a text no prompt was drawn from (CPython's LICENSE history); the quantized layers run on their
  decode kernels for these rows (``kernel_max_rows`` raised), the numbers a decode step sees;
* resident weight bytes: every tensor the engine's model holds for its weights (parameters, buffers,
  oneDNN packed copies of the fp32 path, quantized data with its scales and the kernels' scale copies);
* single-request decode tokens per CPU-second (``time.process_time``; (n+1)-token minus 1-token
  generation of a 128-token prompt, greedy, EOS ignored) and prefill of 512 tokens per CPU-second,
  through ``LLMEngine`` at ``--threads`` (median of ``--repeats``, formats interleaved);
* with ``--offline C1,C2,..``: offline throughput at each concurrency C — C requests of a 128-token prompt
  and ``--new-tokens`` greedy tokens each, all admitted at once (``max_num_seqs`` = C), output tokens per
  CPU-second and per wall second of the whole job (prefill included), median of ``--repeats``, formats
  interleaved; the quantized layers run their decode kernels up to ``KERNEL_MAX_ROWS`` rows per product and
  dequantize above it, so these rows show where that cut sits against fp32 (``FORMAT@R`` in ``--formats``
  runs a format with its kernels up to R rows instead, e.g. ``q4_1@16``: the cut before 2026-12-06).

    flock /tmp/cipherlm-bench.lock python bench/quant_cpu.py [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

PROMPTS = [
    "What is the capital of Italy?", "Write a limerick about a cat.", "Explain gravity to a child.",
    "Name three uses of copper.", "How do vaccines work?", "Give me a recipe for pancakes.",
    "What is a prime number?", "Describe the water cycle.", "Why do leaves change colour in autumn?",
    "Suggest a name for a bakery.",
]


def layout_spec(name: str):
    """``gptq-rtn-g64`` / ``gptq-g64`` (calibrated) / ``gptq-act-g64`` / ``awq-rtn-g64`` -> its QuantSpec."""
    from engine.gptq import QuantSpec

    parts = name.split("-")
    group = int(parts[-1].removeprefix("g"))
    layout, rest = parts[0], parts[1:-1]
    return QuantSpec(layout=layout, method="rtn" if "rtn" in rest else "gptq", group_size=group,
                     sym=layout == "gptq", act_order="act" in rest)


def write_layout(name: str, fp32_dir: Path, out: Path, tok, calib_samples: int, calib_len: int) -> Path:
    """Quantize the fp32 model into a GPTQ/AWQ folder the way ``cipherlm model quantize`` does; return it."""
    from engine.gptq import quantize_to_folder
    from engine.loader import load_model

    folder = out / name
    t0 = time.process_time()
    chat = "text" not in name.split("-")  # gptq-text-g64: calibrated on the plain text
    quantize_to_folder(load_model(fp32_dir), tok, layout_spec(name), folder, None, calib_samples, calib_len, chat)
    print(f"# {name}: written in {time.process_time() - t0:.0f} CPU-s", flush=True)
    return folder


def load_formats(names: list[str], tok, out: Path, calib_samples: int, calib_len: int):
    from engine.default_model import default_model_dir, pull_native
    from engine.loader import load_model

    fp32_dir = default_model_dir()
    spec = {"fp32": (fp32_dir, "fp32", 32), "q4_1": (pull_native(), "native", 32),
            "int8": (fp32_dir, "int8", 32), "int8-channel": (fp32_dir, "int8-channel", 32),
            "int4": (fp32_dir, "int4", 32), "int4-g64": (fp32_dir, "int4", 64)}
    for n in names:
        n = n.partition("@")[0]
        if n.startswith(("gptq-", "awq-")):  # written by our quantizer, loaded back through the loader
            spec[n] = (write_layout(n, fp32_dir, out, tok, calib_samples, calib_len), "native", 32)
    models = {}
    for n in names:  # NAME@R: that format with its kernels up to R rows per product (the old cut beside the new)
        base, _, rows = n.partition("@")
        models[n] = load_model(spec[base][0], weight_format=spec[base][1], group_size=spec[base][2])
        if rows:
            set_kernel_max_rows(models[n], int(rows))
    return models


def resident_bytes(model) -> int:
    """Bytes of every distinct tensor holding weights (see the module docstring)."""
    from engine.cpu_linear import PackedLinear, fused_modules
    from engine.quant import QuantLinear

    tensors = list(model.parameters()) + list(model.buffers())
    for m in list(model.modules()) + fused_modules(model):  # the fused products are not submodules
        if isinstance(m, PackedLinear):
            tensors += [t for t in (m.weight, m.packed, m.weight_t) if t is not None]
        if isinstance(m, QuantLinear):
            tensors += m.quant_tensors()
    seen = {}
    for t in tensors:
        if t.device.type != "meta":  # oneDNN's packed tensors have no storage: keyed by identity
            if t.is_mkldnn:
                seen[("id", id(t))] = t.numel() * t.element_size()
            else:  # by storage: the fused products' parts are row views of the fused weights
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def set_kernel_max_rows(model, rows: int) -> None:
    from engine.quant import QuantLinear

    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.kernel_max_rows = rows


def force_kernels(model) -> None:
    set_kernel_max_rows(model, 1 << 30)


def logits_of(model, ids: list[int]):
    import torch

    from engine.model import DenseKVCache

    with torch.inference_mode():
        t = torch.tensor(ids)
        return model.logits(model(t, torch.arange(len(ids)), DenseKVCache(model.config, len(ids))))


def quality(models: dict, tok) -> dict[str, dict[str, float]]:
    import torch

    from engine.model import greedy_generate

    ref = models["fp32"]
    seqs = []
    for p in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}])
        seqs.append(ids + greedy_generate(ref, ids, 16))
    text = ppl_text()
    ppl_ids = tok.encode(text)[:512]
    ref_logits = [logits_of(ref, s) for s in seqs]
    out = {}
    for name, model in models.items():
        force_kernels(model)
        kl, agree, n = 0.0, 0, 0
        for s, rl in zip(seqs, ref_logits, strict=True):
            ql = rl if name == "fp32" else logits_of(model, s)
            lp, lq = rl.log_softmax(-1), ql.log_softmax(-1)
            kl += float((lp.exp() * (lp - lq)).sum())
            agree += int((rl.argmax(-1) == ql.argmax(-1)).sum())
            n += len(s)
        lq = logits_of(model, ppl_ids).log_softmax(-1)[:-1]
        nll = -lq.gather(1, torch.tensor(ppl_ids[1:])[:, None]).mean()
        out[name] = {"kl": kl / n, "agree": agree / n, "positions": n, "ppl": float(nll.exp()),
                     "ppl_tokens": len(ppl_ids)}
    return out


def ppl_text() -> str:
    """CPython's LICENSE (its history prose first): English text that no prompt came from."""
    import sysconfig

    path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if not path.exists():
        raise SystemExit(f"{path}: missing (the perplexity text)")
    return path.read_text()


def engine_for(model, tok, threads: int, max_seqs: int = 1):
    from engine.engine_config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(model, tok, EngineConfig(device="cpu", num_threads=threads,
                                              kv_cache_bytes=max(64 << 20, max_seqs * (1 << 20) * 12),
                                              enable_prefix_caching=False, max_num_batched_tokens=512))


def cpu_time(engine, prompt: list[int], max_tokens: int, rid: str) -> float:
    from engine.sampling_params import SamplingParams

    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    t0 = time.process_time()
    while engine.has_unfinished_requests():
        engine.step()
    return time.process_time() - t0


def speed(engines: dict, prompt: list[int], long_prompt: list[int], n: int, repeats: int):
    dec = {k: [] for k in engines}
    pre = {k: [] for k in engines}
    for name, eng in engines.items():  # warm-up: both shapes, once
        cpu_time(eng, prompt, 4, f"w-{name}"), cpu_time(eng, long_prompt, 1, f"wl-{name}")
    for r in range(repeats):
        for name, eng in engines.items():
            one = cpu_time(eng, prompt, 1, f"a{r}-{name}")
            dec[name].append(n / max(cpu_time(eng, prompt, n + 1, f"b{r}-{name}") - one, 1e-9))
            pre[name].append(len(long_prompt) / cpu_time(eng, long_prompt, 1, f"c{r}-{name}"))
    return {k: statistics.median(v) for k, v in dec.items()}, {k: statistics.median(v) for k, v in pre.items()}


def offline(engines: dict, base: list[int], n: int, concurrency: list[int], repeats: int):
    """{(format, C): (output tokens per CPU-second, per wall second)}, median of ``repeats``."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    rows: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in range(repeats + 1):  # round 0 warms every format at every C (not kept)
        for c in concurrency:
            for name, eng in engines.items():
                for i in range(c):  # distinct prompts: no prefix-cache hits (prefix caching is off anyway)
                    eng.add_request(f"o{r}-{c}-{name}-{i}", base[3000 + 7 * i:3128 + 7 * i], params)
                t0, w0 = time.process_time(), time.perf_counter()
                while eng.has_unfinished_requests():
                    eng.step()
                cpu, wall = time.process_time() - t0, time.perf_counter() - w0
                if r:
                    rows.setdefault((name, c), []).append((c * n / cpu, c * n / wall))
    return {k: (statistics.median(a for a, _ in v), statistics.median(b for _, b in v)) for k, v in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--formats", default="fp32,q4_1,int8,int8-channel,int4,int4-g64")
    ap.add_argument("--calib-samples", type=int, default=128, help="GPTQ calibration sequences")
    ap.add_argument("--calib-len", type=int, default=256, help="tokens per calibration sequence")
    ap.add_argument("--offline", default="", help="concurrencies of the offline-throughput rows (e.g. 8,32)")
    ap.add_argument("--no-quality", action="store_true", help="skip the quality columns (speed only)")
    args = ap.parse_args()
    from engine.threads import configure

    configure(args.threads)
    import torch

    from engine.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    names = args.formats.split(",")
    if names[0] != "fp32":
        raise SystemExit("the first format must be fp32 (the reference)")
    from engine.default_model import default_model_dir

    tok = Tokenizer.from_folder(default_model_dir())
    with tempfile.TemporaryDirectory(prefix="quant_cpu-") as out:
        models = load_formats(names, tok, Path(out), args.calib_samples, args.calib_len)
    nan = dict(kl=float("nan"), agree=float("nan"), positions=0, ppl=float("nan"), ppl_tokens=0)
    q = {k: nan for k in names} if args.no_quality else quality(models, tok)
    concurrency = [int(c) for c in args.offline.split(",") if c]
    engines = {k: engine_for(m, tok, args.threads, max(concurrency, default=1)) for k, m in models.items()}
    mem = {k: resident_bytes(e.runner.model) for k, e in engines.items()}
    base = tok.encode(ppl_text())
    prompt, long_prompt = base[1000:1128], base[2000:2512]
    if args.repeats:
        dec, pre = speed(engines, prompt, long_prompt, args.new_tokens, args.repeats)
    else:  # quality and memory only
        dec, pre = dict.fromkeys(names, float("nan")), dict.fromkeys(names, float("nan"))
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, "
          f"{args.threads} thread(s), decode {args.new_tokens} tokens after a {len(prompt)}-token prompt, "
          f"prefill {len(long_prompt)} tokens, median of {args.repeats}")
    print("| format | resident weights MB | decode tok/CPU-s | prefill tok/CPU-s | KL vs fp32 | greedy agree "
          "| positions | perplexity |")
    print("|---|---|---|---|---|---|---|---|")
    for k in names:
        print(f"| {k} | {mem[k] / 1e6:.1f} | {dec[k]:.1f} ({dec[k] / dec['fp32']:.2f}x) | {pre[k]:.0f} "
              f"({pre[k] / pre['fp32']:.2f}x) | {q[k]['kl']:.5f} | {100 * q[k]['agree']:.1f} % "
              f"| {q[k]['positions']} | {q[k]['ppl']:.3f} ({q[k]['ppl_tokens']} tokens) |")
    if concurrency:
        rows = offline(engines, base, args.new_tokens, concurrency, args.repeats)
        print(f"\n# offline: C requests x (128-token prompt + {args.new_tokens} tokens), output tok/CPU-s "
              f"(tok/s wall), ratio to fp32 at the same C")
        print("| format | " + " | ".join(f"C = {c}" for c in concurrency) + " |")
        print("|---|" + "---|" * len(concurrency))
        for k in names:
            cells = [f"{rows[k, c][0]:.1f} ({rows[k, c][1]:.1f}) {rows[k, c][0] / rows['fp32', c][0]:.2f}x"
                     for c in concurrency]
            print(f"| {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
