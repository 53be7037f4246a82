"""One-row fp32 products of SmolLM2's projection shapes on the CPU: oneDNN's packed weight against MKL
over the plain ``[out, in]`` weight and over a transposed ``[in, out]`` copy (``engine.cpu_linear``'s
one-row path). CPU time per call (``time.process_time``), best of 5 batches of 50 after 3 warm-ups, at
``--threads``; GB/s = weight bytes per call over that time (warm caches for the smaller shapes: the
ranking, not the absolute rate, is the figure).

    flock /tmp/cipherlm-bench.lock env PYTHONPATH=. python bench/gemv_cpu.py [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from engine.cpu_linear import PackedLinear

SHAPES = [(960, 576), (3072, 576), (576, 1536), (49152, 576)]  # fused qkv, fused gate/up, down, head


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


def shape_times(out: int, inn: int) -> tuple[list[float], float]:
    """Seconds per call of the three one-row products of an ``out x in`` weight, and its GB."""
    lin = torch.nn.Linear(inn, out, bias=False)
    packed = PackedLinear(lin, one_row_copy=True)
    w, x = lin.weight.detach(), torch.randn(1, inn)
    with torch.inference_mode():
        t = [per_call(lambda: torch.ops.mkldnn._linear_pointwise(x, packed.packed, None, "none", [], "")),
             per_call(lambda: torch.nn.functional.linear(x, w)),
             per_call(lambda: torch.mm(x, packed.weight_t))]
    return t, w.numel() * 4 / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {args.threads} thread(s), "
          f"load average {os.getloadavg()[0]:.2f}")
    print("| out x in | oneDNN packed | F.linear | mm(x, W^T copy) |")
    print("|---|---|---|---|")
    for out, inn in SHAPES:
        t, gb = shape_times(out, inn)
        print(f"| {out} x {inn} | " + " | ".join(f"{v * 1e6:.0f} us ({gb / v:.1f} GB/s)" for v in t) + " |")


if __name__ == "__main__":
    main()
