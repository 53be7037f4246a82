"""The GPU worker's per-step host work around an attention step, main's paths against the direct ones (issue 16).

A worker on the gpu backend (``[private] device = "cuda"``) hands each client ciphertext to the device and each
result back to the wire. Before session 21 an attention step took every upload through SEAL (its load of the
seeded bytes, which expands c1 with SEAL's PRNG and checks the residues), saved it again (sealapi's ``save``
always zstd-compresses) and parsed that save with the gpu backend's reader; each result went out through our
serialization, SEAL's load and SEAL's save. Session 21 had GPU servers ask for full (unseeded) uploads, which
``server.private.compute.device_inputs`` reads straight into device tensors, at twice the bytes up. Session 22:
seeded uploads are read directly too, c1 expanded on the device from the seed (``fhe.backends.gpu.uniform``: the
Blake2xb stream by a Triton kernel on CUDA, by its torch reference on the CPU), and the manifest asks every
backend for seeded uploads again.

Timed here on the same client values, in one process on one thread (``torch.set_num_threads(1)``, as a worker
runs), at the shipped plan's parameters (N = 32768, 12 data primes + the special one): the evaluator runs on
the torch-CPU device by default (``--device cuda`` adds what a CUDA worker adds: the host-to-device copies, the
expansion on the card, the device-to-host copy of each result; each timed call ends with a device
synchronization). Median of ``--repeat`` timings of each row, the rows timed in turn round after round:

* inputs, main: the seeded upload -> SEAL's load and the freshness check -> SEAL's save -> our parse (what a
  malformed or Shake256-seeded upload still takes: the fallback);
* inputs, session 21: the full upload -> ``device_inputs`` (the envelope check and the direct parse);
* inputs, now: the seeded upload -> ``device_inputs`` (the direct parse of c0 and the seed, c1 expanded on the
  device); ``expand_c1_ms``: the expansion alone (``sample_poly_uniform``);
* results, main / now: one result ciphertext at ``--result-level`` primes (1: the attention block's output);
* the client's encryption of one upload: seeded and full by SEAL, each on an encryption of zero made ahead
  (``client_sdk._zeros``: what the SDK's step then does, while the zero's own cost, ``client_zero_*_ms``, runs on a
  thread during the previous step's wait), and the bytes of each.

    python -m bench.worker_handoff --json bench/results/worker_handoff.json
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


def _medians_ms(fns: dict, repeat: int) -> dict[str, float]:
    """Median milliseconds of each of ``fns``, timed in turn round after round (a shared box's load drifts: each
    round times every row under about the same load), after one untimed round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(repeat + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if r:
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def _setup(plan: Path, device: str = "cpu"):
    """(plan params, client, server keys, gpu evaluator on ``device``, one input vector)."""
    from fhe.backends.gpu import GpuEvaluator
    from fhe.backends.seal.keys import CKKSClient
    from fhe.params import CKKSParams

    params = CKKSParams.from_dict(json.loads(plan.read_text())["ckks"])
    client = CKKSClient(params, ())
    gpu = GpuEvaluator(params, device, encoder="fft")
    values = np.random.default_rng(0).normal(size=params.slots)
    return params, client, client.server_keys(), gpu, values


def run(plan: Path, repeat: int, result_level: int, device: str = "cpu") -> dict:
    from fhe.backends.gpu.uniform import sample_poly_uniform
    from fhe.backends.seal import hazmat as seal
    from fhe.backends.seal import wire
    from server.private.compute import PrivateCompute, device_inputs, device_results

    torch.set_num_threads(1)
    params, client, keys, gpu, values = _setup(plan, device)
    top, n = keys.kit.top, params.poly_modulus_degree
    zeros = iter([client.encrypt_zero() for _ in range(repeat + 1)])            # made ahead: client_sdk._zeros
    seeded_zeros = iter([client.encrypt_zero_seeded() for _ in range(repeat + 1)])
    seeded = wire.encrypt_to_wire(client, values)
    full = wire.encrypt_to_wire(client, values, seeded=False)
    synced = _synced(gpu.device)

    def main_inputs(blob: bytes):
        (ct,) = PrivateCompute._inputs([blob], keys, top)
        return gpu.deserialize(seal.to_bytes(ct))

    # the same ciphertext three ways: the full upload holds the residues SEAL expands from the seeded one
    a = main_inputs(seeded)
    b = device_inputs(gpu, [wire.pack_ciphertext(
        seal.to_bytes(seal.from_bytes("ciphertext", keys.kit, wire.ciphertext_payload(seeded, params,
                                                                                      client.fingerprint))),
        params, client.fingerprint)], keys, top)[0]
    c = device_inputs(gpu, [seeded], keys, top)[0]
    assert torch.equal(a.data, b.data) and torch.equal(a.data, c.data) and a.scale == b.scale == c.scale
    result = gpu.mod_switch(a, result_level)
    members = _seeded_members(seeded, params, client.fingerprint)
    c1 = torch.empty((top, n), dtype=torch.int64, device=gpu.device)
    primes = list(gpu.ctx.primes[:top])

    def main_results():
        ct = seal.from_bytes("ciphertext", keys.kit, gpu.serialize(result))
        return [wire.dump_ciphertext(ct, params, keys.fingerprint)]

    rows = _medians_ms({
        "inputs_main_seeded_ms": synced(lambda: main_inputs(seeded)),
        "inputs_s21_full_ms": synced(lambda: device_inputs(gpu, [full], keys, top)),
        "inputs_now_seeded_ms": synced(lambda: device_inputs(gpu, [seeded], keys, top)),
        "expand_c1_ms": synced(lambda: sample_poly_uniform(members.seed, primes, n, c1)),
        "results_main_ms": synced(main_results),
        "results_now_ms": synced(lambda: device_results(gpu, [result], keys.fingerprint)),
        "client_encrypt_seeded_ms": lambda: wire.encrypt_to_wire(client, values),
        "client_encrypt_full_ms": lambda: wire.encrypt_to_wire(client, values, seeded=False),
        "client_encrypt_full_zero_ahead_ms": lambda: wire.encrypt_to_wire(client, values, seeded=False,
                                                                          zero=next(zeros)),
        "client_encrypt_seeded_zero_ahead_ms": lambda: wire.encrypt_to_wire(client, values, zero=next(seeded_zeros)),
        "client_zero_full_ms": client.encrypt_zero,
        "client_zero_seeded_ms": client.encrypt_zero_seeded,
    }, repeat)
    ahead = wire.encrypt_to_wire(client, values, zero=client.encrypt_zero_seeded())
    rows |= {"upload_seeded_bytes": len(seeded), "upload_seeded_zero_ahead_bytes": len(ahead),
             "upload_full_bytes": len(full), "result_main_bytes": len(main_results()[0]),
             "result_now_bytes": len(device_results(gpu, [result], keys.fingerprint)[0])}
    rows["handoff_main_ms"] = rows["inputs_main_seeded_ms"] + rows["results_main_ms"]
    rows["handoff_s21_ms"] = rows["inputs_s21_full_ms"] + rows["results_now_ms"]
    rows["handoff_now_ms"] = rows["inputs_now_seeded_ms"] + rows["results_now_ms"]
    return {"device": str(gpu.device), "N": params.poly_modulus_degree, "primes": len(params.coeff_mod_bit_sizes),
            "result_level": result_level, "repeat": repeat, "host": platform.node(),
            "cpu": platform.processor() or platform.machine(),
            "gpu": torch.cuda.get_device_name(gpu.device) if gpu.device.type == "cuda" else None, **rows}


def _synced(device: torch.device):
    """``fn`` -> ``fn`` followed by a wait for the device's queued work (CUDA; nothing to wait for on the CPU)."""
    def wrap(fn):
        if device.type != "cuda":
            return fn
        return lambda: (fn(), torch.cuda.synchronize(device))
    return wrap


def _seeded_members(blob: bytes, params, fingerprint: str):
    from fhe import sealio
    from fhe.backends.seal import wire

    payload = wire.ciphertext_payload(blob, params, fingerprint)
    return sealio.read_fresh_ct_members(sealio.open_object(payload, 1 << 30), params.poly_modulus_degree)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", type=Path, default=Path(__file__).resolve().parents[1] / "fhe" / "data"
                    / "smollm2-135m-instruct.plan.json")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--result-level", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="the gpu backend's device (cuda: the worker's copy included)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = run(args.plan, args.repeat, args.result_level, args.device)
    for k, v in out.items():
        print(f"{k:28s} {v:.2f}" if isinstance(v, float) else f"{k:28s} {v}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
