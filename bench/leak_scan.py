"""The tests' leak scanner (tests/leaks.py) against plain ``needle in hay`` per needle, same haystack, same run.

    python bench/leak_scan.py [--mb 256] [--repeats 3]

The haystack imitates what a private server writes: serialized RNS residues (little-endian 64-bit words below
2^50, so two zero high bytes in every eight, which defeats a substring search's skip table). The needles are
what tests/e2e/test_private_e2e.py searches for: ~64 evenly spread 32-byte windows of a secret made the same
way, plus a prompt. Both methods run on the same bytes, alternately, after one warm-up each; medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.leaks import found  # noqa: E402


def residues(n_words: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 1 << 50, n_words, dtype=np.uint64).astype("<u8").tobytes()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    hay = residues(args.mb * (1 << 20) // 8, 0)
    secret = residues(1 << 14, 1)
    step = (len(secret) - 32) // 64
    needles = {f"secret[{i}]": secret[o:o + 32] for i, o in enumerate(range(0, len(secret) - 32, step))}
    needles["prompt"] = b"The capital of France is"

    def plain():
        return [name for name, n in needles.items() if n in hay]

    def scanner():
        return found(needles, hay)

    times = {"plain `in`": [], "tests/leaks.py": []}
    assert plain() == scanner() == []                      # warm-up, and the same answer
    for _ in range(args.repeats):
        for name, fn in (("plain `in`", plain), ("tests/leaks.py", scanner)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"haystack_mb": args.mb, "needles": len(needles), "median_s": med, "all_s": times,
           "speedup": med["plain `in`"] / med["tests/leaks.py"],
           "scanner_gb_per_s": len(hay) / med["tests/leaks.py"] / 1e9}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
