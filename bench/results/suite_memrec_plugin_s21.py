"""pytest plugin: per-test wall time and peak RSS of the pytest process tree (sampled every 0.25 s)."""
import json
import os
import threading
import time

import psutil

_peak = [0]
_me = psutil.Process()

def _tree_rss():
    total = 0
    try:
        procs = [_me] + _me.children(recursive=True)
    except psutil.Error:
        procs = [_me]
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total

def _sampler():
    while True:
        r = _tree_rss()
        if r > _peak[0]:
            _peak[0] = r
        time.sleep(0.25)

_out = open(os.environ.get("MEMREC_OUT", "memrec.jsonl"), "a")

def pytest_sessionstart(session):
    threading.Thread(target=_sampler, daemon=True).start()

def pytest_runtest_logstart(nodeid, location):
    _peak[0] = _tree_rss()
    _t[0] = time.monotonic()
    _self[0] = _me.memory_info().rss

_t = [0.0]
_self = [0]

def pytest_runtest_logfinish(nodeid, location):
    _out.write(json.dumps({"id": nodeid, "s": round(time.monotonic() - _t[0], 2),
                           "peak_gb": round(_peak[0] / 1e9, 2), "self_start_gb": round(_self[0] / 1e9, 2),
                           "self_end_gb": round(_me.memory_info().rss / 1e9, 2)}) + "\n")
    _out.flush()
