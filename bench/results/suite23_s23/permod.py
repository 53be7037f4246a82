import re, sys, collections
# usage: permod.py LOG... -> per-module seconds (setup+call+teardown summed), columns per log
logs = sys.argv[1:]
tabs = []
for f in logs:
    m = collections.Counter()
    for line in open(f):
        r = re.match(r"^([0-9.]+)s (call|setup|teardown)\s+(\S+?)::", line)
        if r:
            m[r.group(3)] += float(r.group(1))
    tabs.append(m)
mods = sorted(set().union(*tabs), key=lambda k: -tabs[0].get(k, 0))
for k in mods:
    print(f"{k:60s} " + " ".join(f"{t.get(k, 0):7.1f}" for t in tabs))
print(f"{'total':60s} " + " ".join(f"{sum(t.values()):7.1f}" for t in tabs))
