"""Sample the box every 2 s while a test run goes: CPU busy (both cores, from /proc/stat), memory available,
and the resident memory of the process tree under PID (summed RSS; forked children's shared pages count twice).

Usage: python sampler.py PID OUT.tsv   (stops when PID exits)
"""
import sys
import time

import psutil


def cpu_times():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v), idle


def tree_rss(root):
    total, n = 0, 0
    try:
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return 0, 0
    for p in procs:
        try:
            total += p.memory_info().rss
            n += 1
        except psutil.Error:
            pass
    return total, n


def main():
    root = psutil.Process(int(sys.argv[1]))
    out = open(sys.argv[2], "w")
    out.write("t\tbusy_cores\tavail_gb\ttree_rss_gb\tnprocs\tload1\n")
    t0 = time.time()
    tot0, idle0 = cpu_times()
    while root.is_running() and root.status() != psutil.STATUS_ZOMBIE:
        time.sleep(2)
        tot, idle = cpu_times()
        busy = 2 * (1 - (idle - idle0) / max(tot - tot0, 1))
        tot0, idle0 = tot, idle
        rss, n = tree_rss(root)
        avail = psutil.virtual_memory().available
        out.write(f"{time.time() - t0:.0f}\t{busy:.2f}\t{avail / 1e9:.2f}\t{rss / 1e9:.2f}\t{n}\t{psutil.getloadavg()[0]:.2f}\n")
        out.flush()


if __name__ == "__main__":
    main()
