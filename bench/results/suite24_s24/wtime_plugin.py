"""pytest plugin (``-p wtime_plugin`` with this folder on PYTHONPATH): per test, the worker (xdist's gw0/gw1, or
"main"), wall-clock start and end, and the test process's RSS and PSS at its end, one JSON line each to
$WTIME_OUT (default wtime.jsonl). Loaded in every xdist worker too (xdist passes -p on)."""
import json
import os
import time

_start = {}


def _pss() -> int:
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pytest_runtest_logstart(nodeid, location):
    _start[nodeid] = time.time()


def pytest_runtest_logfinish(nodeid, location):
    if os.environ.get("PYTEST_XDIST_WORKER") is None and os.environ.get("WTIME_CONTROLLER_SKIP"):
        return
    rec = {"id": nodeid, "w": os.environ.get("PYTEST_XDIST_WORKER", "main"), "t0": round(_start.pop(nodeid, 0), 2),
           "t1": round(time.time(), 2), "rss_gb": round(_rss() / 1e9, 2), "pss_gb": round(_pss() / 1e9, 2)}
    with open(os.environ.get("WTIME_OUT", "wtime.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")
