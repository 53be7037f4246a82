"""One-row fp32 products of SmolLM2's projection shapes on the CPU: oneDNN's packed weight against MKL
over the plain ``[out, in]`` weight, over a transposed ``[in, out]`` copy (``engine.cpu_linear``'s one-row
path without the native kernels) and the native kernel ``kernels.cpu.f32_mm`` over ``[out, in]`` (the
path with them). Each call takes the next of ``--distinct`` weights of the shape (at most ~512 MB in all),
so the weights stream from memory as in a decode step. CPU time per call (``time.process_time``), best of
5 batches of 50 after 3 warm-ups, at ``--threads``; GB/s = weight bytes per call over that time.

    flock /tmp/cipherlm-bench.lock env PYTHONPATH=. python bench/gemv_cpu.py [--threads 1] [--distinct 60]
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

import torch

import kernels.cpu as native
from engine.cpu_linear import PackedLinear

SHAPES = [(960, 576), (3072, 576), (576, 1536), (576, 576), (49152, 576)]  # fused qkv, gate/up, down, o, head


def per_call(f, n: int = 50) -> float:
    for _ in range(3):
        f()
    best = float("inf")
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(n):
            f()
        best = min(best, (time.process_time() - t0) / n)
    return best


def cycling(items: list):
    """A function returning the next item of ``items`` at each call, round and round."""
    it = itertools.cycle(items)
    return lambda: next(it)


def shape_times(out: int, inn: int, distinct: int) -> tuple[list[float], float]:
    """Seconds per call of the four one-row products of an ``out x in`` weight, and its GB."""
    n = max(1, min(distinct, (512 << 20) // (out * inn * 4)))
    packs = [PackedLinear(torch.nn.Linear(inn, out, bias=False), one_row_copy=True) for _ in range(n)]
    x = torch.randn(1, inn)
    nxt = [cycling(packs) for _ in range(4)]
    with torch.inference_mode():
        t = [per_call(lambda: torch.ops.mkldnn._linear_pointwise(x, nxt[0]().packed, None, "none", [], "")),
             per_call(lambda: torch.nn.functional.linear(x, nxt[1]().weight)),
             per_call(lambda: torch.mm(x, nxt[2]().weight_t))]
        t.append(per_call(lambda: native.f32_mm(x, nxt[3]().weight)) if native.available() else float("nan"))
    return t, out * inn * 4 / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--distinct", type=int, default=60, help="weights per shape, cycled (1: warm caches)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {args.threads} thread(s), "
          f"load average {os.getloadavg()[0]:.2f}")
    print("| out x in | oneDNN packed | F.linear | mm(x, W^T copy) | native f32_mm | native / W^T copy |")
    print("|---|---|---|---|---|---|")
    for out, inn in SHAPES:
        t, gb = shape_times(out, inn, args.distinct)
        print(f"| {out} x {inn} | " + " | ".join(f"{v * 1e6:.0f} us ({gb / v:.1f} GB/s)" for v in t)
              + f" | {t[2] / t[3]:.2f}x |")


if __name__ == "__main__":
    main()
