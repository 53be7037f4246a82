"""Where the quantized CPU layers' row cut belongs: per row count, the three ways a product can run.

For the real default model at one thread: layer 0's seven linears summed, and the tied 49152 x 576 head, each as
(a) the native kernel (``kernels.cpu``: Q4_1 or Q8_0 blocks, int8 activations), (b) torch's packed int4 kernel
(one plane, or two for a Q8_0-shaped layer; bf16 activations), (c) dequantize to fp32 + ``F.linear`` (what
rows past ``quant.KERNEL_MAX_ROWS`` do). ``native`` = the GGUF's Q4_1 layers and Q8_0 head; ``int8`` = group-32
int8 RTN of the fp32 model (two planes, Q8_0-shaped). Median of 5 (dequantize: 3), milliseconds.

    PYTHONPATH=. flock /tmp/cipherlm-bench.lock nice python bench/quant_rows_cpu.py [--formats native,int8]
"""

from __future__ import annotations

import argparse
import statistics
import time


def _ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="native,int8")
    ap.add_argument("--rows", default="1,8,16,32,64,128,512")
    ap.add_argument("--head-rows", default="1,16,32,64,128")
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F

    from engine.default_model import default_model_dir, pull_native
    from engine.loader import load_model
    from engine.quant import QuantLinear

    torch.set_num_threads(1)
    for fmt in args.formats.split(","):
        model = (load_model(pull_native(), weight_format="native") if fmt == "native"
                 else load_model(default_model_dir(), weight_format=fmt, group_size=32))
        named = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
        groups = {"layer 0": [m for n, m in named.items() if ".layers.0." in n],
                  "head": [m for n, m in named.items() if ".layers." not in n]}
        print(f"# {fmt}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, 1 thread")
        for label, layers in groups.items():
            if not layers:
                continue
            print(f"{label}: rows | native | torch kernel | dequantize + F.linear (ms)")
            for rows in (int(r) for r in (args.rows if label == "layer 0" else args.head_rows).split(",")):
                tot = [0.0, 0.0, 0.0]
                for lin in layers:
                    x = torch.randn(rows, lin.in_features)
                    native = lin._native()
                    tot[0] += _ms(lambda f=native, x=x: f(x), 5) if native is not None else float("nan")
                    tot[1] += _ms(lambda m=lin, x=x: m._kernel(x.to(torch.bfloat16)).float(), 5)
                    tot[2] += _ms(lambda m=lin, x=x: F.linear(x, m.dequantize()), 3)
                print(f"{rows} | {tot[0]:.2f} | {tot[1]:.2f} | {tot[2]:.2f}", flush=True)


if __name__ == "__main__":
    main()
