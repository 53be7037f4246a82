"""The expansion of one seeded upload's c1 on the gpu backend's device, against SEAL's load of the same bytes (#16).

At the shipped plan's parameters (N = 32768, 12 data primes: 393,216 stream words, 768 + 1 Blake2xb buffers), median of
``--repeat`` timings, each synchronized on CUDA, the rows timed in turn round after round:

* ``roots_ms``: the 769 buffers' roots ``H0`` on the host (hashlib);
* ``kernel_ms``: the output blocks (the Triton kernel on CUDA, the torch reference on the CPU), from roots already on
  the device (CUDA events on CUDA);
* ``expand_ms``: all of ``sample_poly_uniform`` (roots, their copy, the blocks, the redraws, the reduction, the one
  synchronization), what a seeded upload adds on the worker;
* ``seal_load_ms``: SEAL's load of the same seeded bytes (its own expansion and checks, on the host CPU), the path a
  GPU worker took before session 21.

    python -m bench.seeded_expand --device cuda --json bench/results/seeded_expand.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch


def run(plan: Path, repeat: int, device: str) -> dict:
    from fhe import sealio
    from fhe.backends.gpu import GpuEvaluator, blake2xb
    from fhe.backends.gpu.uniform import sample_poly_uniform
    from fhe.backends.seal import hazmat as seal
    from fhe.backends.seal.keys import CKKSClient
    from fhe.params import CKKSParams

    torch.set_num_threads(1)
    params = CKKSParams.from_dict(json.loads(plan.read_text())["ckks"])
    client = CKKSClient(params, ())
    gpu = GpuEvaluator(params, device, encoder="fft")
    n, top = params.poly_modulus_degree, gpu.top
    payload = client.encrypt_bytes(np.random.default_rng(0).normal(size=params.slots))
    members = sealio.read_fresh_ct_members(sealio.open_object(payload, 1 << 30), n)
    primes = list(gpu.ctx.primes[:top])
    refills = -(-top * n // blake2xb.WORDS_PER_REFILL) + 1
    roots = torch.from_numpy(blake2xb.refill_roots(members.seed, 0, refills).view(np.int64).copy()).to(gpu.device)
    out = torch.empty((top, n), dtype=torch.int64, device=gpu.device)
    want = sealio.read_ciphertext(seal.to_bytes(seal.from_bytes("ciphertext", client.kit, payload)), n, top)
    assert np.array_equal(sample_poly_uniform(members.seed, primes, n, out).cpu().numpy().view(np.uint64),
                          want.data[1])
    cuda = gpu.device.type == "cuda"
    if cuda:
        from fhe.backends.gpu.blake2xb_triton import xof_blocks
    else:
        xof_blocks = blake2xb.xof_blocks_torch

    def kernel() -> float:
        if not cuda:
            t0 = time.perf_counter()
            xof_blocks(roots)
            return (time.perf_counter() - t0) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        xof_blocks(roots)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def timed(fn):
        def wrapped() -> float:
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize(gpu.device)
            return (time.perf_counter() - t0) * 1e3
        return wrapped

    rows = {"roots_ms": timed(lambda: blake2xb.refill_roots(members.seed, 0, refills)), "kernel_ms": kernel,
            "expand_ms": timed(lambda: sample_poly_uniform(members.seed, primes, n, out)),
            "seal_load_ms": timed(lambda: seal.from_bytes("ciphertext", client.kit, payload))}
    times: dict[str, list[float]] = {k: [] for k in rows}
    for r in range(repeat + 1):
        for k, fn in rows.items():
            t = fn()
            if r:
                times[k].append(t)
    return {"device": str(gpu.device), "gpu": torch.cuda.get_device_name(gpu.device) if cuda else None,
            "N": n, "primes": top, "refills": refills, "repeat": repeat, "host": platform.node(),
            **{k: statistics.median(v) for k, v in times.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", type=Path, default=Path(__file__).resolve().parents[1] / "fhe" / "data"
                    / "smollm2-135m-instruct.plan.json")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = run(args.plan, args.repeat, args.device)
    for k, v in out.items():
        print(f"{k:14s} {v:.3f}" if isinstance(v, float) else f"{k:14s} {v}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
