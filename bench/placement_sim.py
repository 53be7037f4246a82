"""Placement of encrypted sessions on a worker fleet, simulated at a scale one machine cannot run.

A discrete-event simulation of ``--workers`` workers (one task at a time each, at most ``--keys-per-worker``
key sets loaded: the server's ``max_keys_per_worker``) serving ``--sessions`` encrypted sessions. Each
policy sees the same seeded workload:

* **arrivals**: a Poisson process whose rate follows a day curve (±40 % around the mean, two cycles over
  the run), sized so the fleet's offered load is ``--load`` of its capacity;
* **key sets**: ``--key-sets`` tenants' keys with Zipf(1.1) popularity (a few users open most sessions);
  each key set is 158 MB, 300 MB or 720 MB (30/40/30 %: N = 16384 level-aware keys up to N = 32768
  full keys, ``docs/benchmarks.md``'s key sizes);
* **steps**: a session is a prefill (prompt lognormal, median 64 tokens, in chunks of 64) then decode
  steps (lognormal, median 32 tokens); a step costs ``--step-s`` seconds of a worker (one token through
  the plan's encrypted layers on one core, lognormal σ 0.25) plus 0.02 s per extra prefill token; between
  steps the client's round trip (decrypt, exact non-linearity, re-encrypt, network) takes 0.15 s;
* **key loads**: a session placed on a worker without its key set first loads it: the bytes travel at
  ``--net-gbps`` and the worker spends 0.8 s per GB parsing them (it runs no step meanwhile).

Policies:

* ``affinity`` — the server's before issue 20 (:meth:`server.private.service.PrivateService._pick_worker`): a worker
  already holding the key set, else one with room for another key set, else one whose loaded key sets
  no open session uses (the least recently used is evicted); among those the fewest pending tasks;
* ``naive`` — the fewest pending tasks among workers that can take the key set (room or an evictable
  key set), ignoring where key sets already are;
* ``random`` — a random worker among those that can take it;
* ``affinity-spill`` — a holder only while it has fewer than ``--spill`` open sessions
  (``private.spill_sessions``), else a worker with room, else any holder; least loaded by pending tasks;
* ``affinity-spill-open`` — the server's policy since issue 20: the same, but "least loaded" counts open
  sessions before pending tasks (pending is 0 while a session's client is between steps, so it
  undercounts a worker's sessions).

A session no worker can take waits (the server answers 429 ``worker_keys_full`` and the SDK retries) until
a session closes. Reported per policy: utilisation (share of worker-seconds running steps; key parsing is
counted apart), step queueing delay (ready at the server → running) p50/p99, admission wait p50/p99,
key-upload traffic in total and per session, and session time p50.

``--overhead`` then measures, in the same run, the per-step cost of the Ray backend vs the local process
pool on this machine: the same no-op step (``--payload-kb`` of ciphertext in and out) through
:class:`server.private.workers.WorkerPool` and :class:`server.private.ray_backend.RayWorkerPool` (a Ray
head started on 127.0.0.1), medians over ``--overhead-steps`` steps.

Usage: python bench/placement_sim.py [--workers 1000 --sessions 100000] [--overhead] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import heapq
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

KEY_SIZES_MB = (158, 300, 720)
KEY_SIZE_P = (0.3, 0.4, 0.3)
CLIENT_RTT_S = 0.15
PREFILL_TOKEN_S = 0.02
PARSE_S_PER_GB = 0.8
CHUNK = 64


# -- workload ---------------------------------------------------------------------------------------------
def make_workload(args, rng: random.Random) -> list[tuple[float, int, list[float]]]:
    """Sessions as (arrival time, key set, step costs in seconds), arrival-ordered."""
    steps = [_session_steps(args, rng) for _ in range(args.sessions)]
    mean_work = statistics.fmean(sum(s) for s in steps)
    rate = args.load * args.workers / mean_work  # sessions per second at the mean of the day curve
    weights = [1.0 / (k + 1) ** 1.1 for k in range(args.key_sets)]
    keys = rng.choices(range(args.key_sets), weights, k=args.sessions)
    span = args.sessions / rate
    t, out = 0.0, []
    for i in range(args.sessions):
        t = _next_arrival(t, rate, span, rng)
        out.append((t, keys[i], steps[i]))
    return out


def _session_steps(args, rng: random.Random) -> list[float]:
    prompt = max(1, int(rng.lognormvariate(math.log(64), 0.6)))
    decode = max(1, int(rng.lognormvariate(math.log(32), 0.7)))
    costs = []
    for start in range(0, prompt, CHUNK):
        n = min(CHUNK, prompt - start)
        costs.append(args.step_s * rng.lognormvariate(0, 0.25) + PREFILL_TOKEN_S * (n - 1))
    costs += [args.step_s * rng.lognormvariate(0, 0.25) for _ in range(decode)]
    return costs


def _next_arrival(t: float, rate: float, span: float, rng: random.Random) -> float:
    """Thinning of a Poisson process with rate(t) = rate * (1 + 0.4 sin(4 pi t / span))."""
    peak = rate * 1.4
    while True:
        t += rng.expovariate(peak)
        if rng.random() < (1 + 0.4 * math.sin(4 * math.pi * t / span)) / 1.4:
            return t


# -- fleet ------------------------------------------------------------------------------------------------
class Fleet:
    """One policy over one workload. Per worker: a FIFO of ready tasks, the key sets it holds (key -> last
    use) and its open sessions per key; the counters placement reads are numpy arrays (1,000 workers)."""

    def __init__(self, args, policy: str, key_size: list[int], rng: random.Random) -> None:
        import numpy as np

        n = args.workers
        self.np, self.args, self.policy, self.key_size, self.rng = np, args, policy, key_size, rng
        self.pending = np.zeros(n)      # queued + running tasks (the server's least_loaded)
        self.open_n = np.zeros(n)       # open sessions
        self.nkeys = np.zeros(n)        # key sets loaded
        self.idle_keys = np.zeros(n)    # loaded key sets no open session uses (evictable)
        self.busy = [False] * n
        self.queues = [collections.deque() for _ in range(n)]
        self.keys: list[dict[int, float]] = [{} for _ in range(n)]
        self.open: list[collections.Counter] = [collections.Counter() for _ in range(n)]
        self.holders: dict[int, set[int]] = collections.defaultdict(set)  # key set -> workers holding it
        self.busy_s = self.parse_s = self.key_bytes = 0.0
        self.events: list = []
        self.seq = 0
        self.waiting: collections.deque = collections.deque()  # sessions no worker could take (429, retry)
        self.queue_delay: list[float] = []
        self.admit_wait: list[float] = []
        self.session_time: list[float] = []
        self.now = 0.0

    def push(self, t: float, kind: str, payload) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload))

    def run(self, workload) -> dict:
        for arrival, key, steps in workload:
            self.push(arrival, "arrive", [arrival, key, steps, 0, None])  # [t0, key, steps, next, worker]
        while self.events:
            self.now, _, kind, payload = heapq.heappop(self.events)
            getattr(self, "_" + kind)(payload)
        return self.report()

    # -- placement --------------------------------------------------------------------------------------
    def _least(self, mask):
        """The fewest pending tasks among ``mask`` (``*-open`` policies: the fewest open sessions first)."""
        np = self.np
        if not mask.any():
            return None
        load = self.pending + (self.open_n * 1000 if self.policy.endswith("-open") else 0)
        return int(np.argmin(np.where(mask, load, np.inf)))

    def pick(self, key: int) -> int | None:
        room = self.nkeys < self.args.keys_per_worker
        able = room | (self.idle_keys > 0)
        holders = list(self.holders[key])
        if self.policy.startswith("affinity"):
            if self.policy.startswith("affinity-spill"):  # a holder only while it is not crowded
                holders = [i for i in holders if self.open_n[i] < self.args.spill]
            if holders:
                return min(holders, key=lambda i: (self.open_n[i] if self.policy.endswith("-open") else 0,
                                                   self.pending[i]))
            return self._least(room) if room.any() else self._least(able)
        for i in holders:
            able[i] = True
        if self.policy == "random":
            idx = self.np.flatnonzero(able)
            return int(self.rng.choice(idx)) if len(idx) else None
        return self._least(able)

    def _arrive(self, s) -> None:
        i = self.pick(s[1])
        if i is None:
            self.waiting.append(s)
            return
        self.admit_wait.append(self.now - s[0])
        s[4], key = i, s[1]
        self._open(i, key)
        if key in self.keys[i]:
            self.keys[i][key] = self.now
            self._ready(s)
        else:
            self._load_key(i, key, s)

    def _open(self, i: int, key: int) -> None:
        self.open[i][key] += 1
        self.open_n[i] += 1
        if key in self.keys[i] and self.open[i][key] == 1:
            self.idle_keys[i] -= 1

    def _load_key(self, i: int, key: int, s) -> None:
        keys = self.keys[i]
        if len(keys) >= self.args.keys_per_worker:  # evict the least recently used idle key set
            victim = min((k for k in keys if self.open[i][k] == 0), key=keys.get)
            del keys[victim]
            self.holders[victim].discard(i)
            self.nkeys[i] -= 1
            self.idle_keys[i] -= 1
        keys[key] = self.now
        self.holders[key].add(i)
        self.nkeys[i] += 1
        mb = KEY_SIZES_MB[self.key_size[key]]
        self.key_bytes += mb * 1e6
        transfer = mb * 8e6 / (self.args.net_gbps * 1e9)
        self.push(self.now + transfer, "enqueue", (i, ("parse", mb / 1000 * PARSE_S_PER_GB, s)))

    # -- steps --------------------------------------------------------------------------------------------
    def _ready(self, s) -> None:
        """The session's next step reaches its worker's queue."""
        self._enqueue((s[4], ("step", s[2][s[3]], s)))

    def _enqueue(self, item) -> None:
        i, task = item
        self.queues[i].append((self.now, task))
        self.pending[i] += 1
        if not self.busy[i]:
            self._start(i)

    def _start(self, i: int) -> None:
        ready_at, (kind, cost, s) = self.queues[i].popleft()
        self.busy[i] = True
        if kind == "step":
            self.queue_delay.append(self.now - ready_at)
            self.busy_s += cost
        else:
            self.parse_s += cost
        self.push(self.now + cost, "done", (i, kind, s))

    def _done(self, item) -> None:
        i, kind, s = item
        self.busy[i] = False
        self.pending[i] -= 1
        if self.queues[i]:
            self._start(i)
        if kind == "parse":
            self._ready(s)
            return
        s[3] += 1
        if s[3] < len(s[2]):
            self.push(self.now + CLIENT_RTT_S, "ready", s)
        else:
            self._close(s)

    def _close(self, s) -> None:
        i, key = s[4], s[1]
        self.open[i][key] -= 1
        self.open_n[i] -= 1
        if self.open[i][key] == 0:
            self.idle_keys[i] += 1
        self.session_time.append(self.now - s[0])
        waiting, self.waiting = self.waiting, collections.deque()
        for w in waiting:  # a key slot freed: the waiting retry, oldest first (the rest wait again)
            self._arrive(w)

    def report(self) -> dict:
        cap = self.now * self.args.workers
        return {"policy": self.policy, "sim_hours": round(self.now / 3600, 2),
                "utilisation": self.busy_s / cap, "key_parse_share": self.parse_s / cap,
                "step_queue_p50_s": _q(self.queue_delay, 0.5), "step_queue_p99_s": _q(self.queue_delay, 0.99),
                "admit_wait_p50_s": _q(self.admit_wait, 0.5), "admit_wait_p99_s": _q(self.admit_wait, 0.99),
                "key_upload_tb": self.key_bytes / 1e12,
                "key_upload_gb_per_session": self.key_bytes / 1e9 / max(1, len(self.session_time)),
                "session_p50_s": _q(self.session_time, 0.5), "sessions": len(self.session_time)}


def _q(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def simulate(args) -> list[dict]:
    rows = []
    for policy in args.policy:
        rng = random.Random(args.seed)
        workload = make_workload(args, rng)
        key_size = random.Random(args.seed + 1).choices(range(len(KEY_SIZES_MB)), KEY_SIZE_P, k=args.key_sets)
        fleet = Fleet(args, policy, key_size, random.Random(args.seed + 2))
        t0 = time.perf_counter()
        row = fleet.run(workload)
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# -- the Ray path vs the local pool, per step -------------------------------------------------------------------
ECHO = "tests.server.worker_states:make_probe"  # echo(x) returns x: a step with no computation


async def _step_times(pool, payload: bytes, steps: int) -> list[float]:
    await pool.start()
    try:
        await pool.submit(0, "bench", "echo", payload)  # warm: the worker is up, the path is hot
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            await pool.submit(0, "bench", "echo", payload)
            times.append(time.perf_counter() - t0)
        return times
    finally:
        await pool.close()


def overhead(args) -> list[dict]:
    """Median round trip of one no-op step (payload in and out) through each backend, same run."""
    from server.private.config import RaySettings
    from server.private.ray_backend import RayWorkerPool
    from server.private.workers import WorkerPool

    rows = []
    for kb in args.payload_kb:
        payload = os.urandom(kb * 1024)
        pools = {"local": lambda: WorkerPool(1, ECHO, ("b",)),
                 "ray": lambda: RayWorkerPool(1, ECHO, ("b",), ray_settings=RaySettings(head_cpus=2))}
        for name in args.backends:
            times = asyncio.run(_step_times(pools[name](), payload, args.overhead_steps))
            row = {"backend": name, "payload_kb": kb, "steps": len(times),
                   "median_ms": statistics.median(times) * 1e3, "p90_ms": _q(times, 0.9) * 1e3}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--sessions", type=int, default=100_000)
    p.add_argument("--key-sets", type=int, default=20_000, help="distinct key sets (tenants' keys)")
    p.add_argument("--keys-per-worker", type=int, default=2, help="the server's max_keys_per_worker")
    p.add_argument("--load", type=float, default=0.7, help="offered load as a share of the fleet's capacity")
    p.add_argument("--step-s", type=float, default=1.0, help="median worker seconds of one decode step")
    p.add_argument("--net-gbps", type=float, default=10.0, help="bandwidth a key upload travels at")
    p.add_argument("--spill", type=int, default=3, help="affinity-spill: open sessions a holder may have")
    p.add_argument("--policy", action="append",
                   help="affinity, affinity-spill, affinity-spill-open, naive, random (default: all)")
    p.add_argument("--seed", type=int, default=20)
    p.add_argument("--overhead", action="store_true", help="also time a step through the local pool and Ray")
    p.add_argument("--no-sim", action="store_true", help="skip the simulation (with --overhead)")
    p.add_argument("--backends", nargs="+", default=["local", "ray"])
    p.add_argument("--payload-kb", type=int, nargs="+", default=[1024])
    p.add_argument("--overhead-steps", type=int, default=200)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    args.policy = args.policy or ["affinity", "affinity-spill", "affinity-spill-open", "naive", "random"]
    out = {"args": {k: v for k, v in vars(args).items() if k != "json"}}
    if not args.no_sim:
        out["simulation"] = simulate(args)
    if args.overhead:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: server/, tests/
        out["overhead"] = overhead(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
