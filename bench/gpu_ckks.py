"""Key switching on our gpu backend (CUDA) against SEAL on the CPU, same inputs, same run.

    python bench/gpu_ckks.py --steps 8 --repeat 20 [--out result.json]

At the shipped parameters (``ckks_params_for("sqexp", 6)``: N = 32768, 12 data primes + a 60-bit
special prime): one rotation, one relinearization, and ``--steps`` rotations of one input (a loop of
single rotations and the hoisted ``rotate_many``), each on SEAL (tenseal.sealapi, one CPU thread) and
on the GPU evaluator (with its CUDA graphs, and without: the same kernels launched one by one); every
GPU result is compared residue by residue with SEAL's. Also prints the
device bytes of the loaded key set. Medians; GPU times are wall time around a synchronized call.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import numpy as np
import tenseal.sealapi as sa
import torch

from fhe import sealio
from fhe.backends.gpu import GpuEvaluator
from fhe.backends.seal import hazmat as seal
from fhe.backends.seal.keys import CKKSClient
from fhe.params import ckks_params_for


def _median_s(fn, repeat: int, sync: bool) -> float:
    out = []
    for _ in range(repeat):
        if sync:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def _radix4() -> bool:
    from fhe.backends.gpu import triton_ops

    return triton_ops.RADIX4


def _gpu_times(ev, A, C, keys, steps, pt, r: int) -> dict:
    """Median ms of the key-switching operations (and mul_plain) on one evaluator, after a warm-up."""
    ev.rotate_many(A, steps, keys)
    ev.relinearize(C, keys)
    ev.rotate(A, 1, keys)
    return {"rotate": 1e3 * _median_s(lambda: ev.rotate(A, 1, keys), r, True),
            "relinearize": 1e3 * _median_s(lambda: ev.relinearize(C, keys), r, True),
            "rotate_loop": 1e3 * _median_s(lambda: [ev.rotate(A, s, keys) for s in steps], r, True),
            "rotate_many_hoisted": 1e3 * _median_s(lambda: ev.rotate_many(A, steps, keys), r, True),
            "mul_plain": 1e3 * _median_s(lambda: ev.mul_plain(A, pt), r, True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--seal-repeat", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    params = ckks_params_for("sqexp", 6)
    steps = tuple(range(1, args.steps + 1))
    t0 = time.perf_counter()
    client = CKKSClient(params, steps)
    server = client.server_keys()
    keygen_s = time.perf_counter() - t0
    ev = GpuEvaluator(params, device="cuda")
    t0 = time.perf_counter()
    keys = ev.load_keys(dict(client.public_blobs), steps)
    load_s = time.perf_counter() - t0
    kit, sev = client.kit, client.kit.evaluator
    rng = np.random.default_rng(0)
    a, b = (client.encrypt(rng.uniform(-1, 1, params.slots)) for _ in range(2))
    A, B = ev.deserialize(seal.to_bytes(a)), ev.deserialize(seal.to_bytes(b))
    c, C = kit.mul(a, b), ev.mul(A, B)

    def same(ours, theirs) -> bool:
        raw = sealio.read_ciphertext(seal.to_bytes(theirs), params.poly_modulus_degree, ev.top)
        return bool(np.array_equal(ev.to_raw(ours).data, raw.data)) and ours.scale == raw.scale

    def seal_relin():
        out = sa.Ciphertext()
        sev.relinearize(c, server.relin, out)
        return out

    res = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
           "device": torch.cuda.get_device_name(), "params": params.to_dict(), "steps": list(steps),
           "radix4_default": _radix4(),
           "keygen_s": keygen_s, "key_load_s": load_s, "key_device_bytes": keys.nbytes()}
    ev.rotate_many(A, steps, keys)                                        # warm-up: Triton compiles, caches
    ev.relinearize(C, keys)
    many = ev.rotate_many(A, steps, keys)
    res["bit_identical"] = {
        "relinearize": same(ev.relinearize(C, keys), seal_relin()),
        "rotate": all(same(ev.rotate(A, s, keys), kit.rotate(a, s, server.galois)) for s in steps),
        "rotate_many": all(same(many[s], kit.rotate(a, s, server.galois)) for s in steps),
        "rescale": same(ev.rescale(ev.relinearize(C, keys)), kit.relin_rescale(seal_relin(), None)),
    }
    r, sr = args.repeat, args.seal_repeat
    ev_pt = ev.encode(np.ones(8), ev.top, ev.scale)
    res["gpu_ms"] = _gpu_times(ev, A, C, keys, steps, ev_pt, r)
    # the same evaluator without CUDA graphs (plain launches): the before of the graphs change, same run
    plain = GpuEvaluator(params, device="cuda", graphs=False)
    res["gpu_ms_no_graphs"] = _gpu_times(plain, A, C, keys, steps, ev_pt, r)
    res["bit_identical"]["no_graphs"] = (same(plain.relinearize(C, keys), seal_relin())
                                         and same(plain.rotate(A, 1, keys), kit.rotate(a, 1, server.galois)))
    # two NTT stages per launch (triton_ops.RADIX4), graphs on: a fresh evaluator captures its own graphs
    from fhe.backends.gpu import triton_ops

    default, triton_ops.RADIX4 = triton_ops.RADIX4, not triton_ops.RADIX4
    other = GpuEvaluator(params, device="cuda")
    keys = other.load_keys(dict(client.public_blobs), steps)   # its own keys: graphs of whole ops live on the keys
    res[f"gpu_ms_radix4_{triton_ops.RADIX4}"] = _gpu_times(other, A, C, keys, steps, ev_pt, r)
    res["bit_identical"][f"radix4_{triton_ops.RADIX4}"] = (
        same(other.relinearize(C, keys), seal_relin())
        and all(same(other.rotate(A, s, keys), kit.rotate(a, s, server.galois)) for s in steps)
        and all(same(v, kit.rotate(a, s, server.galois)) for s, v in other.rotate_many(A, steps, keys).items()))
    triton_ops.RADIX4 = default
    pt = kit.encode(np.ones(8), kit.top, kit.scale)
    res["seal_ms"] = {"rotate": 1e3 * _median_s(lambda: kit.rotate(a, 1, server.galois), sr, False),
                      "relinearize": 1e3 * _median_s(seal_relin, sr, False),
                      "rotate_loop": 1e3 * _median_s(lambda: [kit.rotate(a, s, server.galois) for s in steps],
                                                     max(1, sr // 2), False),
                      "mul_plain": 1e3 * _median_s(lambda: kit.mul_plain(a, pt), sr, False)}
    res["speedup"] = {k: res["seal_ms"][k] / res["gpu_ms"][k] for k in res["seal_ms"]}
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
