"""Per module of a serial run: seconds (setup + call + teardown from --durations=0), and from the sampler's rows
that fall in the module's span (collection order, durations summed): least memory available, largest tree RSS,
mean busy cores.

Usage: python timeline.py RUN.log RUN_samples.tsv COLLECT_ORDER.txt [offset_s]
"""
import collections
import re
import sys


def main():
    log, samples, order = sys.argv[1:4]
    offset = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    phases = {}   # a test reported more than once per phase (subtests: test_fuzz) counts its largest report
    for line in open(log):
        m = re.match(r"\s*([\d.]+)s (setup|call|teardown)\s+(\S+)", line)
        if m:
            key = (m.group(3), m.group(2))
            phases[key] = max(phases.get(key, 0.0), float(m.group(1)))
    dur = collections.defaultdict(float)
    for (nid, _), s in phases.items():
        dur[nid] += s
    mods, seen = [], {}
    for nid in (x.strip() for x in open(order)):
        mod = nid.split("::")[0]
        if mod not in seen:
            seen[mod] = 0.0
            mods.append(mod)
        seen[mod] += dur.get(nid, 0.0)
    rows = [r.split("\t") for r in open(samples).read().splitlines()[1:]]
    rows = [(float(r[0]), float(r[1]), float(r[2]), float(r[3])) for r in rows]
    t = offset
    total = 0.0
    out = []
    for mod in mods:
        s = seen[mod]
        span = [r for r in rows if t <= r[0] < t + s] or [min(rows, key=lambda r: abs(r[0] - t))]
        out.append((mod, t, s, min(r[2] for r in span), max(r[3] for r in span), sum(r[1] for r in span) / len(span)))
        t += s
        total += s
    print(f"{'module':60s} {'start':>6s} {'s':>6s} {'availmin':>8s} {'treemax':>7s} {'busy':>5s}")
    for mod, start, s, av, tr, busy in out:
        if s >= 1.0:
            print(f"{mod:60s} {start:6.0f} {s:6.1f} {av:8.2f} {tr:7.2f} {busy:5.2f}")
    print("sum of durations", round(total, 1))


if __name__ == "__main__":
    main()
