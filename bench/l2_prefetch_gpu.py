"""Does a bulk L2 prefetch (kernels.l2_prefetch) make a GEMV that follows it read from L2? (GPU, sm_90)

For each decode GEMV of the Qwen2.5-0.5B and Llama-3.2-1B shapes (bf16 and int4 weights, one row), CUDA
graphs of

* ``cold``:     flush L2 (write a 128-MB buffer), spin ``gap`` µs, the GEMV;
* ``prefetch_bulk`` / ``prefetch_lines``: flush, the prefetch (``kernels.l2_prefetch``'s two modes) forked on a
  side stream, spin ``gap`` µs on the main stream, the GEMV;
* ``hot``:      the GEMV with its weight left in L2 by the previous replay (no flush; an upper bound);
* ``base``:     flush and spin alone,

each replayed ``--iters`` times (median GPU time). The GEMV's own time is the graph's minus ``base``'s; the
spin (``torch.cuda._sleep``) stands in for the attention's small kernels, during which a decode layer's
memory is idle. What it says: whether the prefetched bytes land before the GEMV reads them, and how much of
the cold GEMV's time a prefetch ``gap`` µs ahead takes away.

    python bench/l2_prefetch_gpu.py --json bench/results/l2_prefetch_gpu.json
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

import kernels
from bench.engine_gpu import cuda_median_ms
from engine.fused import quantize_int4_rtn
from kernels.l2_prefetch import MODES

GEMMS = {  # (N, K) of the one-row products a decode layer runs, the QKV of the next layer included
    "qwen2.5-0.5b": {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)},
    "llama3.2-1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)},
}


def spin_cycles(us: float) -> int:
    """``torch.cuda._sleep`` cycles for about ``us`` µs at the device's clock (kHz; an H100's 1.755 GHz boost
    where this torch does not report it)."""
    return int(us * getattr(torch.cuda.get_device_properties(0), "clock_rate", 1_755_000) / 1e3)


def capture(fn) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm: compiles and allocations outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def measure(n: int, k: int, fmt: str, gaps: list[float], iters: int, flush: torch.Tensor) -> list[dict]:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    if fmt == "int4":
        q = quantize_int4_rtn(w, 32)
        tensors = [q.qweight, q.scale_offset]

        def gemv():
            kernels.gemv_int4_w32(x, q.qweight, q.scale_offset)
    else:
        tensors = [w]

        def gemv():
            kernels.gemv(x, w)
    ranges = kernels.l2_ranges(tensors, 1 << 40)
    side = torch.cuda.Stream()
    rows = []
    for gap in gaps:
        cyc = spin_cycles(gap)

        def base(cyc=cyc):
            flush.fill_(1)
            if cyc:
                torch.cuda._sleep(cyc)

        def cold(base=base):
            base()
            gemv()

        def prefetch(mode, cyc=cyc):
            flush.fill_(1)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                kernels.l2_prefetch(ranges, mode)
            if cyc:
                torch.cuda._sleep(cyc)
            gemv()
            torch.cuda.current_stream().wait_stream(side)

        fns = [("base", base), ("cold", cold), ("hot", gemv)]
        fns += [(f"prefetch_{m}", functools.partial(prefetch, m)) for m in MODES]
        t = {name: cuda_median_ms(capture(fn).replay, iters) * 1e3 for name, fn in fns}
        rows.append({"n": n, "k": k, "format": fmt, "bytes": ranges.nbytes, "gap_us": gap,
                     **{f"{name}_us": v for name, v in t.items()}, "gemv_cold_us": t["cold"] - t["base"],
                     **{f"gemv_after_{m}_us": t[f"prefetch_{m}"] - t["base"] for m in MODES},
                     "gemv_hot_us": t["hot"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen2.5-0.5b,llama3.2-1b")
    ap.add_argument("--formats", default="bf16,int4")
    ap.add_argument("--gaps", default="0,5,10,20", help="µs of spin between the prefetch and the GEMV")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not kernels.l2_prefetch_supported(torch.device("cuda")):
        raise SystemExit("the bulk L2 prefetch needs a CUDA device of compute capability 9.0+")
    flush = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    gaps = [float(g) for g in args.gaps.split(",")]
    props = torch.cuda.get_device_properties(0)
    res = {"gpu": torch.cuda.get_device_name(), "l2_bytes": getattr(props, "L2_cache_size", None), "rows": []}
    print(f"{res['gpu']}, L2 {res['l2_bytes']} B", flush=True)
    print("| shape | GEMM | format | MB | gap µs | GEMV cold µs | after bulk prefetch µs | after line prefetch µs "
          "| hot µs |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for shape in args.shapes.split(","):
        for name, (n, k) in GEMMS[shape].items():
            for fmt in args.formats.split(","):
                for r in measure(n, k, fmt, gaps, args.iters, flush):
                    r.update(shape=shape, gemm=name)
                    res["rows"].append(r)
                    print(f"| {shape} | {name} | {fmt} | {r['bytes'] / 2**20:.1f} | {r['gap_us']:g} | "
                          f"{r['gemv_cold_us']:.2f} | {r['gemv_after_bulk_us']:.2f} | {r['gemv_after_lines_us']:.2f} "
                          f"| {r['gemv_hot_us']:.2f} |", flush=True)
                    if args.json:
                        with open(args.json, "w") as f:
                            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
