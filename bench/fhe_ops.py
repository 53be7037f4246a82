"""Per-operation cost of SEAL at the shipped plan's parameters: encode, multiply_plain, rotate, rescale.

The packed prefill's projection is ~3264 encode + multiply_plain pairs and ~220 rotations per chunk
(docs/fhe.md §3a); these are the unit costs that split comes from. Mean of 5 (rotations 3) after one
warm-up, at the top level, one below it and at 4 primes (where the V map runs)::

    flock /tmp/cipherlm-heavy.lock python bench/fhe_ops.py
"""

from __future__ import annotations

import sys
import time


def _ms(f, n: int = 5) -> float:
    f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n * 1e3


def _row(ev, keys, c, v, lvl: int) -> str:
    pt = ev.encode(v, lvl, ev.prime(lvl))
    return (f"level {lvl}: encode {_ms(lambda: ev.encode(v, lvl, ev.prime(lvl))):.1f} ms, "
            f"multiply_plain {_ms(lambda: ev.mul_plain(c, pt)):.1f} ms, "
            f"rotate {_ms(lambda: ev.rotate(c, 1, keys), 3):.1f} ms, "
            f"multiply_plain + rescale {_ms(lambda: ev.rescale(ev.mul_plain(c, pt)), 3):.1f} ms")


def main() -> int:
    import numpy as np

    from fhe.backends.seal.evaluator import SealEvaluator
    from fhe.backends.seal.keys import CKKSClient
    from fhe.params import CKKSParams
    from fhe.plan import load_default_plan

    params = CKKSParams.from_dict(load_default_plan().ckks)
    client = CKKSClient(params, [1])
    keys, ev = client.server_keys(), SealEvaluator(params)
    v = np.random.default_rng(0).standard_normal(ev.slots)
    ct = ev.deserialize(client.encrypt_bytes(v))
    for lvl in (ev.top, ev.top - 1, 4):
        print(_row(ev, keys, ev.mod_switch(ct, lvl), v, lvl), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
