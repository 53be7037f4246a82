"""An offload plan's gpu worker on its own: how long it takes to start (model, every layer's diagonals encoded on
the device, every linear step's CUDA graphs captured) and what one step costs on the device once warm, per part,
for one position (decode) and for a 32-position chunk step (CHUNK_ROWS chunks of the chunk layout): no HTTP, no
SEAL parsing, zero inputs and zero keys (the cost does not depend on the values). Issue 17.

    CIPHERLM_HOME=... python bench/gpu_offload_worker.py [--offload-plan default] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _timed(fn, sync, reps: int = 7) -> float:
    out = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    import torch

    from engine.default_model import default_model_dir
    from fhe.backends.gpu.evaluator import GpuCiphertext
    from fhe.offload import default_offload_path
    from server.private.compute import CHUNK_ROWS, PrivateCompute, placeholder_keys

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--offload-plan", default="default")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json")
    args = ap.parse_args()
    plan = str(default_offload_path()) if args.offload_plan == "default" else args.offload_plan
    t0 = time.perf_counter()
    worker = PrivateCompute(str(default_model_dir()), None, 128, args.device, 1, plan)
    start_s = time.perf_counter() - t0
    lin = worker.linear
    sync = (lambda: torch.cuda.synchronize()) if torch.cuda.is_available() else (lambda: None)
    report = {"start_s": start_s, "warm_s": lin.warm_s, "captures": lin.graphs.captures,
              "capture_s": lin.graphs.capture_s, "device_nbytes": lin.device_nbytes(),
              "cuda_allocated": torch.cuda.memory_allocated() if torch.cuda.is_available() else 0,
              "cuda_reserved": torch.cuda.memory_reserved() if torch.cuda.is_available() else 0, "parts": {}}
    print(json.dumps({k: v for k, v in report.items() if k != "parts"}), flush=True)
    keys = placeholder_keys(lin.gpu, lin.steps)
    zero = GpuCiphertext(torch.zeros((2, lin.gpu.top, lin.params.poly_modulus_degree), dtype=torch.int64,
                                     device=lin.gpu.device), lin.gpu.kit.scale)
    first: dict[str, int] = {}   # each part the plan runs (a fused plan: attn_qkv, o_up, down_qkv, mlp_down), once
    for layer, part in lin.parts():
        first.setdefault(part, layer)
    for part, layer in first.items():
        block, _ = lin.part(layer, part)
        tiles = block.chunks.shapes[part].tiles
        one = _timed(lambda p=part, li=layer: lin._device_step(li, p, [zero], keys), sync)
        chunk = _timed(lambda p=part, li=layer, t=tiles: lin._chunks_on_device(li, p, [zero] * (t * CHUNK_ROWS), keys),
                       sync)
        report["parts"][part] = {"decode_ms": one * 1e3, "chunk_step_32_ms": chunk * 1e3, "tiles": tiles}
        print(part, json.dumps(report["parts"][part]), flush=True)
    report["captures_after"] = lin.graphs.captures
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
