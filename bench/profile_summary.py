"""Summarize a py-spy raw profile: seconds per function line, own (leaf) and inclusive.

How the private path was profiled (docs/benchmarks.md): while ``bench/private_e2e.py`` was decoding,

    pip install py-spy
    py-spy record --nonblocking --rate 50 --duration 240 --format raw -o worker.txt --pid <worker pid>
    python bench/profile_summary.py worker.txt --rate 50 --match attention.py,linalg.py,seal.py

(the same for the client and the server process). ``--nonblocking`` never pauses the target, so the run
being profiled keeps its timing; py-spy leaves idle threads out, so the totals are busy time.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path


def summarize(path: Path, rate: float) -> tuple[float, collections.Counter, collections.Counter]:
    """(busy seconds, own seconds per frame, inclusive seconds per frame) of one raw py-spy file."""
    own: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        frames = stack.split(";")
        total += n
        own[frames[-1]] += n / rate
        for frame in set(frames):
            incl[frame] += n / rate
    return total / rate, own, incl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path, help="py-spy record --format raw output")
    ap.add_argument("--rate", type=float, default=100.0, help="the --rate it was recorded at")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--match", default="", help="inclusive list: only frames whose text has one of these")
    args = ap.parse_args()
    busy, own, incl = summarize(args.profile, args.rate)
    print(f"{args.profile}: {busy:.1f} s busy")
    print("own time:")
    for frame, sec in own.most_common(args.top):
        print(f"  {sec:8.1f} s  {frame}")
    keys = [k for k in args.match.split(",") if k]
    print("inclusive time" + (f" (frames matching {', '.join(keys)})" if keys else "") + ":")
    shown = [(f, s) for f, s in incl.most_common() if not keys or any(k in f for k in keys)]
    for frame, sec in shown[: args.top * 2]:
        print(f"  {sec:8.1f} s  {frame}")


if __name__ == "__main__":
    main()
