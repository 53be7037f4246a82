"""Per xdist worker, the modules it ran in order (from wtime_plugin's records): start and end (s from the run's
start), the worker's PSS when the module ended, and the box's least available memory and largest tree PSS
(sampler.py) while it ran.

Usage: python workers.py WTIME.jsonl SAMPLES.tsv START_EPOCH
"""
import json
import sys


def main():
    recs = [json.loads(x) for x in open(sys.argv[1])]
    rows = [r.split("\t") for r in open(sys.argv[2]).read().splitlines()[1:] if not r.startswith("#")]
    rows = [(float(r[0]), float(r[2]), float(r[6])) for r in rows]
    t0 = float(sys.argv[3])
    mods = {}
    for r in recs:
        key = (r["w"], r["id"].split("::")[0])
        m = mods.setdefault(key, [r["t0"], r["t1"], 0.0])
        m[0], m[1], m[2] = min(m[0], r["t0"]), max(m[1], r["t1"]), r["pss_gb"]
    for w in sorted({k[0] for k in mods}):
        print(f"== {w}")
        for (ww, mod), (a, b, pss) in sorted(mods.items(), key=lambda kv: kv[1][0]):
            if ww != w or b - a < 3:
                continue
            span = [x for x in rows if a - t0 <= x[0] <= b - t0] or [(0, 99.0, 0.0)]
            print(f"{a - t0:6.0f} {b - t0:6.0f} {b - a:6.1f}s pss_end {pss:5.2f}  avail_min {min(x[1] for x in span):5.2f}"
                  f"  tree_pss_max {max(x[2] for x in span):5.2f}  {mod}")


if __name__ == "__main__":
    main()
