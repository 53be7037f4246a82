"""The SDK's CKKS work per ciphertext at the offload parameters (N = 8192), and whether threads speed it up
(does ``tenseal.sealapi`` release the GIL?): a decode token of the 28-layer offload plan encrypts 112
ciphertexts and parses + decrypts 224 on the client (issue 17: ~0.3-0.5 s of a ~2.3 s token on the H200
machine's CPU).

    python bench/client_crypto.py [--count 64] [--threads 1,2,4,8] [--json out.json]

Per phase, one thread: SEAL's encoder, symmetric encryption, seeded serialization (``encrypt_to_wire``),
answer parsing (``load_ciphertext``, SEAL's load and validity check) and decryption (with decoding). Then
``encrypt_to_wire`` and parse + decrypt of ``--count`` ciphertexts over a thread pool of each size:
speed-up ~ threads where the calls release the GIL, ~1 where they hold it.

Session 13 (issue 17) adds: full (unseeded) uploads — ``encrypt_to_wire(seeded=False)`` on the client, and on the
server the gpu backend's direct parse (``GpuEvaluator.deserialize_fresh``, no SEAL) against the SEAL path the GPU
worker took before (SEAL's load with seed expansion, SEAL's save, our parse), on this machine's torch device — and
the SDK's forked crypto pool (``--processes 1,2,...``: a step of ``--count`` ciphertexts encrypted, then its
answers parsed + decrypted, per ciphertext; 1 = one at a time in this process, the path before).

    python bench/client_crypto.py [--count 36] [--threads 1,2] [--processes 1,2,4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def _ms(fn, items) -> float:
    t = time.perf_counter()
    for it in items:
        fn(it)
    return (time.perf_counter() - t) / len(items) * 1e3


def main() -> None:
    from fhe import wire
    from fhe.backends.seal import hazmat as seal
    from fhe.backends.seal.keys import CKKSClient
    from fhe.mlp import MLP_PARAMS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=64)
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--processes", default="1,2")
    ap.add_argument("--json")
    args = ap.parse_args()
    c = CKKSClient(MLP_PARAMS, (1,))
    rng = np.random.default_rng(0)
    vals = [rng.normal(size=MLP_PARAMS.slots) for _ in range(args.count)]
    kit = c.kit
    pts = [kit.encode(v, kit.top, kit.scale) for v in vals]
    blobs = [wire.encrypt_to_wire(c, v) for v in vals]
    cts = [wire.load_ciphertext(b, kit, c.fingerprint) for b in blobs]
    phases = {
        "encode (SEAL)": _ms(lambda v: kit.encode(v, kit.top, kit.scale), vals),
        "encrypt_symmetric + seeded save (from a plaintext)": _ms(
            lambda p: seal.to_bytes(seal.sa.Encryptor(kit.context, c.keys.secret).encrypt_symmetric(p)), pts),
        "encrypt_to_wire (all of the above + envelope)": _ms(lambda v: wire.encrypt_to_wire(c, v), vals),
        "load_ciphertext (parse + check)": _ms(lambda b: wire.load_ciphertext(b, kit, c.fingerprint), blobs),
        "decrypt + decode": _ms(c.decrypt, cts),
        "encrypt_to_wire, full (unseeded) upload": _ms(lambda v: wire.encrypt_to_wire(c, v, seeded=False), vals),
    }
    server, sizes = _server_parse(c, vals)
    phases.update(server)
    print(f"bytes per upload: {sizes}")
    out = {"phases_ms": phases, "upload_bytes": sizes, "threads": [], "processes": _pool(c, vals, args.processes)}
    for name, ms in phases.items():
        print(f"{name}: {ms:.3f} ms")
    for k in (int(x) for x in args.threads.split(",")):
        with ThreadPoolExecutor(k) as ex:
            list(ex.map(lambda v: wire.encrypt_to_wire(c, v), vals[:k]))          # warm the pool
            enc, dec = [], []
            for _ in range(3):
                t = time.perf_counter()
                list(ex.map(lambda v: wire.encrypt_to_wire(c, v), vals))
                enc.append((time.perf_counter() - t) / len(vals) * 1e3)
                t = time.perf_counter()
                list(ex.map(lambda b: c.decrypt(wire.load_ciphertext(b, kit, c.fingerprint)), blobs))
                dec.append((time.perf_counter() - t) / len(vals) * 1e3)
        row = {"threads": k, "encrypt_ms_per_ct": statistics.median(enc),
               "parse_decrypt_ms_per_ct": statistics.median(dec)}
        out["threads"].append(row)
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


def _server_parse(c, vals) -> tuple[dict[str, float], dict[str, float]]:
    """The GPU worker's parse of one upload, ms per ciphertext (synchronised, median of 5): the SEAL path it took before
    (seeded upload: SEAL's load, which expands c1, SEAL's save, our parse, the copy to the device) and the
    direct parse of a full upload (:meth:`~fhe.backends.gpu.evaluator.GpuEvaluator.deserialize_fresh`), one at a
    time and a step's at once (``deserialize_fresh_many``, what the worker calls)."""
    import torch

    from fhe import wire
    from fhe.backends.gpu.evaluator import GpuEvaluator
    from fhe.backends.seal import hazmat as seal

    ev = GpuEvaluator(c.params)
    sync = torch.cuda.synchronize if ev.device.type == "cuda" else (lambda: None)
    seeded = [wire.encrypt_to_wire(c, v) for v in vals]
    full = [wire.encrypt_to_wire(c, v, seeded=False) for v in vals]

    def old(b):
        ct = wire.load_ciphertext(b, c.kit, c.fingerprint, level=ev.top)
        return ev.deserialize(seal.to_bytes(ct))

    def new(b):
        return ev.deserialize_fresh(wire.ciphertext_payload(b, c.params, c.fingerprint))

    assert all(torch.equal(new(b).data, old(b).data) for b in full[:4])   # the same residues
    for fn, items in ((old, seeded), (new, full)):
        _ms(fn, items[:4])
    def step(items):   # a step's uploads at once, as the worker parses them (threads, one device copy)
        return ev.deserialize_fresh_many([wire.ciphertext_payload(b, c.params, c.fingerprint) for b in items])

    assert all(torch.equal(x.data, new(b).data) for x, b in zip(step(full[:4]), full[:4], strict=True))
    step(full[:4])
    out = {}
    for name, fn, items in ((f"server: SEAL path, seeded upload ({ev.device.type})", old, seeded),
                            (f"server: direct parse, full upload ({ev.device.type})", new, full),
                            (f"server: direct parse of the step's uploads at once ({ev.device.type})", None, full)):
        reps = []
        for _ in range(5):
            t = time.perf_counter()
            if fn is None:
                step(items)
            else:
                for b in items:
                    fn(b)
            sync()
            reps.append((time.perf_counter() - t) / len(items) * 1e3)
        out[name] = statistics.median(reps)
    return out, {"seeded": statistics.mean(len(b) for b in seeded), "full": statistics.mean(len(b) for b in full)}


def _pool(c, vals, spec: str) -> list[dict]:
    """A step of ``len(vals)`` ciphertexts through the forked crypto pool of each size (1: serial, in this
    process): encryption (seeded, as a SEAL server asks, and full) and parse + decryption, ms per ciphertext."""
    from client_sdk._crypto_pool import CryptoPool
    from fhe import wire

    blobs = [wire.encrypt_to_wire(c, v) for v in vals]
    rows = []
    for k in (int(x) for x in spec.split(",") if x):
        pool = CryptoPool(c, k) if k > 1 else None
        full_pool = CryptoPool(c, k, seeded=False) if k > 1 else None
        enc = pool.encrypt if pool else (lambda vs: [wire.encrypt_to_wire(c, v) for v in vs])
        enc_full = (full_pool.encrypt if full_pool else
                    (lambda vs: [wire.encrypt_to_wire(c, v, seeded=False) for v in vs]))
        dec = pool.decrypt if pool else (
            lambda bs: [c.decrypt(wire.load_ciphertext(b, c.kit, c.fingerprint)) for b in bs])
        try:
            got = dec(blobs)                                                  # warm
            assert all(np.array_equal(g, c.decrypt(wire.load_ciphertext(b, c.kit, c.fingerprint)))
                       for g, b in zip(got[:4], blobs[:4], strict=False))
            times = {"encrypt_ms_per_ct": [], "encrypt_full_ms_per_ct": [], "parse_decrypt_ms_per_ct": []}
            for _ in range(3):
                for key, fn, items in (("encrypt_ms_per_ct", enc, vals), ("encrypt_full_ms_per_ct", enc_full, vals),
                                       ("parse_decrypt_ms_per_ct", dec, blobs)):
                    t = time.perf_counter()
                    fn(items)
                    times[key].append((time.perf_counter() - t) / len(items) * 1e3)
        finally:
            for p in (pool, full_pool):
                if p is not None:
                    p.close()
        row = {"processes": k, "ciphertexts": len(vals), **{k2: statistics.median(v) for k2, v in times.items()}}
        rows.append(row)
        print(json.dumps(row))
    return rows


if __name__ == "__main__":
    main()
