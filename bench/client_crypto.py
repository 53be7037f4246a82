"""The SDK's CKKS work per ciphertext at the offload parameters (N = 8192), and whether threads speed it up
(does ``tenseal.sealapi`` release the GIL?): a decode token of the 28-layer offload plan encrypts 112
ciphertexts and parses + decrypts 224 on the client (issue 17: ~0.3-0.5 s of a ~2.3 s token on the H200
machine's CPU).

    python bench/client_crypto.py [--count 64] [--threads 1,2,4,8] [--json out.json]

Per phase, one thread: SEAL's encoder, symmetric encryption, seeded serialization (``encrypt_to_wire``),
answer parsing (``load_ciphertext``, SEAL's load and validity check) and decryption (with decoding). Then
``encrypt_to_wire`` and parse + decrypt of ``--count`` ciphertexts over a thread pool of each size:
speed-up ~ threads where the calls release the GIL, ~1 where they hold it.
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
    }
    out = {"phases_ms": phases, "threads": []}
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


if __name__ == "__main__":
    main()
