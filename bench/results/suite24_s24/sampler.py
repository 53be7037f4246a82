"""Sample the box every 2 s while a test run goes: CPU busy (both cores, from /proc/stat), memory available,
the resident memory of the process tree under PID (summed RSS: forked children's shared pages count twice; and
summed PSS from /proc/PID/smaps_rollup: shared pages split between the processes that map them). With KILL_GB,
a watchdog: below that much memory available it kills the tree (each process by its id) and says so.

Usage: python sampler.py PID OUT.tsv [KILL_GB]   (stops when PID exits)
"""
import sys
import time

import psutil


def cpu_times():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v), idle


def pss(pid):
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_rss(root):
    total, n, p_sum = 0, 0, 0
    try:
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return 0, 0, 0
    for p in procs:
        try:
            total += p.memory_info().rss
            p_sum += pss(p.pid)
            n += 1
        except psutil.Error:
            pass
    return total, n, p_sum


def main():
    root = psutil.Process(int(sys.argv[1]))
    out = open(sys.argv[2], "w")
    kill_gb = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    out.write("t\tbusy_cores\tavail_gb\ttree_rss_gb\tnprocs\tload1\ttree_pss_gb\n")
    t0 = time.time()
    tot0, idle0 = cpu_times()
    while root.is_running() and root.status() != psutil.STATUS_ZOMBIE:
        time.sleep(2)
        tot, idle = cpu_times()
        busy = 2 * (1 - (idle - idle0) / max(tot - tot0, 1))
        tot0, idle0 = tot, idle
        rss, n, p_sum = tree_rss(root)
        avail = psutil.virtual_memory().available
        out.write(f"{time.time() - t0:.0f}\t{busy:.2f}\t{avail / 1e9:.2f}\t{rss / 1e9:.2f}\t{n}\t"
                  f"{psutil.getloadavg()[0]:.2f}\t{p_sum / 1e9:.2f}\n")
        out.flush()
        if kill_gb and avail < kill_gb * 1e9:
            out.write(f"# watchdog: {avail / 1e9:.2f} GB available < {kill_gb} GB: killing the tree\n")
            out.flush()
            for p in [root] + root.children(recursive=True):
                try:
                    p.kill()
                except psutil.Error:
                    pass
            return


if __name__ == "__main__":
    main()
