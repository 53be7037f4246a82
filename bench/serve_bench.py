"""Serving benchmark: streamed completions against ``cipherlm serve`` over loopback HTTP.

For each concurrency level (users), requests arrive as a Poisson process at ``--request-rate`` per
second, at most ``users`` in flight at once, for ``--duration`` seconds (then the in-flight ones finish,
bounded by ``--timeout``). Each request streams (SSE) a completion of exactly ``--output-len`` tokens
(``ignore_eos``) for a prompt of about ``--input-len`` tokens. Reported per level: request throughput,
output-token throughput, and p50/p99 of TTFT (first token), TPOT (mean time per output token after the
first, per request) and ITL (every gap between streamed chunks) — vLLM's ``benchmark_serving`` definitions.

By default the script starts ``cipherlm serve`` itself (one plaintext tenant with a fresh key, on a free
loopback port, the default model unless ``--model``) and stops it at the end; ``--url``/``--api-key``
measure a running server instead. ``--engine-process off on`` measures the server twice in one run, with
the engine in a thread of the API process (the old layout) and in its own process (the default);
``--offline`` then runs the offline engine (``engine.LLM``, same model, device, threads, lengths, at most
``users`` sequences per step) in this process with no server running, and reports each row's output
tokens per second as a share of it and its TPOT p50 against the engine's own time per output token.
Example::

    python bench/serve_bench.py --users 1 8 32 --duration 60 --output-len 32 --engine-process off on \
        --offline --json bench/serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import tomllib

from server.metrics import watch_loop_lag

CLIENT_LAG_INTERVAL_S = 0.01  # the clients' event-loop timer (the server's samples every 50 ms)
WORDS = ("the river carried small boats past quiet houses while children watched from old stone bridges and "
         "merchants counted coins under bright lanterns near the market square at dusk").split()


@dataclasses.dataclass
class RequestResult:
    """Timings of one streamed request (seconds)."""

    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    error: str = ""
    text_chunks: int = 0  # chunks whose text was not empty
    chunks: int = 0       # chunks with a choice (several tokens each when the server coalesced them)
    sent: float = 0.0     # time.time() when the request went out (the slowest first tokens: when they were asked)
    headers: float = 0.0  # seconds to the response's headers (sent once the server's handler has started it)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def make_prompt(rng: random.Random, n_words: int) -> str:
    """A synthetic prompt (about 1.2 tokens per word with SmolLM2's tokenizer)."""
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


async def one_request(session: aiohttp.ClientSession, url: str, key: str, prompt: str, output_len: int,
                      timeout: float) -> RequestResult:
    """Send one streamed completion and time its chunks (aiohttp, as vLLM's benchmark client: httpx spent
    ~14x its CPU per streamed token, and a busy client inflates every latency it times)."""
    body = {"prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    last = None
    res = RequestResult(ok=False, sent=time.time())
    try:
        async with session.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout),
                                headers={"Authorization": f"Bearer {key}"}) as resp:
            res.headers = time.perf_counter() - start
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return res
            async for raw in resp.content:  # one SSE line at a time
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                event = json.loads(line[5:])
                now = time.perf_counter()
                if event.get("error"):  # an in-band error after the headers (the stream then ends)
                    res.error = f"in-band: {json.dumps(event['error'])[:200]}"
                if event.get("usage"):
                    res.output_tokens = event["usage"]["completion_tokens"]
                # a chunk is one engine step's new tokens; its text may be "" (an incomplete UTF-8 byte, a
                # skipped special token): greedy random weights can repeat such a token for a whole stream,
                # which the 2026-12-02 H200 runs counted as failed ("stream ended without a text chunk")
                if event.get("choices"):
                    res.chunks += 1
                    res.text_chunks += bool(event["choices"][0].get("text"))
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - start
        res.ok = last is not None and not res.error
        if last is None and not res.error:
            res.error = "stream ended without a token chunk"
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        res.error = repr(exc)
    return res


async def _drive(url: str, key: str, users: int, rate: float, duration: float, input_len: int,
                 output_len: int, timeout: float, seed: int) -> tuple[list[RequestResult], float, float, list[float]]:
    """Poisson arrivals for ``duration`` s, at most ``users`` in flight; (results, start, end in time.time(), this
    client's event-loop lags: a client too busy to read its streams on time inflates every latency it times)."""
    rng = random.Random(seed)
    lags: list[float] = []
    watcher = asyncio.create_task(watch_loop_lag(lags.append, CLIENT_LAG_INTERVAL_S))
    sem = asyncio.Semaphore(users)
    results: list[RequestResult] = []

    async def worker(prompt: str) -> None:
        try:
            results.append(await one_request(session, url, key, prompt, output_len, timeout))
        finally:
            sem.release()

    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=users + 4)) as session:
            tasks = []
            start, t0 = time.time(), time.perf_counter()
            while time.perf_counter() - t0 < duration:
                await sem.acquire()
                if time.perf_counter() - t0 >= duration:
                    sem.release()
                    break
                tasks.append(asyncio.create_task(worker(make_prompt(rng, input_len))))
                await asyncio.sleep(rng.expovariate(rate) if rate != float("inf") else 0)
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=timeout)
    finally:  # a level that timed out must not leave the watcher sampling the next one's loop
        watcher.cancel()
    return results, start, time.time(), lags


def _client_proc(*drive_args) -> tuple[list[dict], float, float, float, list[float]]:
    """One client process's share of a level (``--clients``): its results (as dicts: the script runs as
    ``__main__``, whose classes do not unpickle across processes), span, CPU seconds and loop lags."""
    cpu = time.process_time()
    results, start, end, lags = asyncio.run(_drive(*drive_args))
    return [dataclasses.asdict(r) for r in results], start, end, time.process_time() - cpu, lags


async def run_level(url: str, key: str, users: int, rate: float, duration: float, input_len: int,
                    output_len: int, timeout: float, seed: int, clients: int = 1) -> dict:
    """One concurrency level: Poisson arrivals for ``duration`` s, at most ``users`` in flight, from
    ``clients`` processes (users and rate split between them; one Python client parsing every SSE event
    of hundreds of streams runs out of CPU before a fast server does). ``client_cpu_s`` in the row."""
    clients = max(1, min(clients, users))
    if clients == 1:
        cpu = time.process_time()
        results, start, end, lags = await _drive(url, key, users, rate, duration, input_len, output_len, timeout,
                                                 seed)
        return summarize(users, results, end - start) | {"client_cpu_s": time.process_time() - cpu} | _lag(lags)
    import concurrent.futures
    import multiprocessing

    shares = [users // clients + (i < users % clients) for i in range(clients)]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(clients, mp_context=ctx) as pool:
        loop = asyncio.get_running_loop()
        parts = await asyncio.gather(*(
            loop.run_in_executor(pool, _client_proc, url, key, u, rate * u / users, duration, input_len,
                                 output_len, timeout, seed + i) for i, u in enumerate(shares)))
    results = [RequestResult(**r) for part in parts for r in part[0]]
    wall = max(p[2] for p in parts) - min(p[1] for p in parts)
    return (summarize(users, results, wall) | {"client_cpu_s": sum(p[3] for p in parts), "clients": clients}
            | _lag([g for p in parts for g in p[4]]))


def _lag(lags: list[float]) -> dict:
    """The clients' event-loop lag in a row: its mean and largest (ms)."""
    return {"client_loop_lag_mean_ms": 1e3 * statistics.fmean(lags), "client_loop_lag_max_ms": 1e3 * max(lags)
            } if lags else {}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def summarize(users: int, results: list[RequestResult], wall: float) -> dict:
    """Throughput and latency percentiles (milliseconds) of one level."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft * 1e3 for r in ok]
    tpot = [r.tpot * 1e3 for r in ok if r.tpot is not None]
    itl = [g * 1e3 for r in ok for g in r.itl]
    t0 = min((r.sent for r in ok), default=0.0)
    return {"users": users, "requests": len(results), "failed": len(results) - len(ok), "wall_s": wall,
            "req_per_s": len(ok) / wall, "out_tok_per_s": sum(r.output_tokens for r in ok) / wall,
            **{f"{name}_p{q}_ms": _pct(vals, q)
               for name, vals in (("ttft", ttft), ("tpot", tpot), ("itl", itl)) for q in (50, 99)},
            "chunks_per_token": sum(r.chunks for r in ok) / max(1, sum(r.output_tokens for r in ok)),
            "errors": sorted({r.error for r in results if not r.ok})[:3],
            # the ten slowest first tokens: (seconds after the level's first request went out, TTFT ms, ms to the
            # response's headers), to tell a start-up burst from requests starved later, and a late start from a
            # late first token
            "ttft_slowest": [(round(r.sent - t0, 3), round(r.ttft * 1e3, 1), round(r.headers * 1e3, 1))
                             for r in sorted(ok, key=lambda r: -r.ttft)[:10]],
            f"ttft_over_{TAIL_S:g}s": sum(1 for r in ok if r.ttft > TAIL_S),  # beside the server's (step_mix)
            "ok_without_text": sum(1 for r in ok if not r.text_chunks)}


def markdown(rows: list[dict]) -> str:
    """The results as a markdown table."""
    head = ("| users | requests | req/s | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 "
            "| ITL p50 | ITL p99 | API CPU µs/tok | core CPU µs/tok | client CPU µs/tok | chunks/tok |\n"
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r.get('engine', '')} {r['users']} | {r['requests'] - r['failed']} | {r['req_per_s']:.2f} "
                     f"| {r['out_tok_per_s']:.1f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} "
                     f"| {r['tpot_p50_ms']:.1f} "
                     f"| {r['tpot_p99_ms']:.1f} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} "
                     f"| {r.get('api_cpu_us_per_token', 0):.0f} | {r.get('core_cpu_us_per_token', 0):.0f} "
                     f"| {r.get('client_cpu_us_per_token', 0):.0f} | {r.get('chunks_per_token', 0):.2f} |")
    return "\n".join(lines) + "\n\n(latencies in ms)"


# --- a server to measure ----------------------------------------------------------------------------


def start_server(args: argparse.Namespace, workdir: Path) -> tuple[subprocess.Popen, str, str]:
    """``cipherlm serve`` with one fresh plaintext tenant on a free loopback port; waits for readiness."""
    from server.local_server import free_port
    from server.tenants import generate_api_key

    key, port = generate_api_key(), free_port()
    engine = f'device = "{args.device}"' + (f"\nnum_threads = {args.threads}" if args.threads else "")
    engine += "".join(f"\n{k} = {v}" for k, v in args.engine_set)
    settings = workdir / "bench-settings.toml"
    settings.write_text(f'host = "127.0.0.1"\nport = {port}\nengine_process = {str(args.process).lower()}\n'
                        + (f"stream_interval = {args.stream_interval}\n" if args.stream_interval else "")
                        + (f'model = "{args.model}"\n' if args.model else "")
                        + "".join(f"{k} = {v}\n" for k, v in args.server_set)
                        + f"[engine]\n{engine}\n" + bench_tenant(key))
    cmd = [sys.executable, "-m", "server.cli_serve", "--config", str(settings), "--log-level", "warning"]
    return launch(cmd, workdir, port, 300, 0.5), f"http://127.0.0.1:{port}", key


def bench_tenant(key: str) -> str:
    """Settings TOML: the one tenant ``bench`` (API key ``key``) with limits that never refuse the load."""
    from server.tenants import hash_api_key

    return ("[limits_default]\nmax_concurrent = 1024\nrequests_per_minute = 1000000\n"
            "tokens_per_minute = 0\n"  # 0: off (the default 60k/min 429s a GPU at 32+ users)
            f'[[tenants]]\nid = "bench"\napi_key_hashes = ["{hash_api_key(key)}"]\n')


def launch(cmd: list[str], workdir: Path, port: int, timeout_s: float, poll_s: float,
           env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a server process (output to ``workdir/server.log``) and wait until it answers on ``port``."""
    from server.local_server import exit_with_parent, wait_ready

    log = open(workdir / "server.log", "w")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=exit_with_parent,
                            env=None if env is None else os.environ | env)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}", timeout_s, workdir / "server.log", poll_s=poll_s)
    except RuntimeError:
        proc.kill()
        raise
    return proc


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process so far (Linux ``/proc``; 0.0 where unreadable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (the engine core, multiprocessing's helpers)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return kids


class CpuMeter:
    """CPU seconds spent by the API process, its children (the engine core) and this client per level."""

    def __init__(self, server_pid: int | None) -> None:  # the client's CPU comes with each level's row
        self.pid = server_pid
        self.kids = child_pids(server_pid) if server_pid else []

    def sample(self) -> tuple[float, float]:
        if not self.pid:
            return 0.0, 0.0
        return cpu_seconds(self.pid), sum(cpu_seconds(k) for k in self.kids)

    @staticmethod
    def per_token(row: dict, before: tuple, after: tuple) -> dict:
        """µs of CPU per streamed output token, per process (the API's is what issue 19.4 cuts)."""
        tokens = max(1.0, row["out_tok_per_s"] * row["wall_s"])
        spent = {"api": after[0] - before[0], "core": after[1] - before[1], "client": row["client_cpu_s"]}
        return {f"{n}_cpu_us_per_token": v / tokens * 1e6 for n, v in spent.items()}


async def bench(args: argparse.Namespace, url: str, key: str, server_pid: int | None = None) -> list[dict]:
    """Warm up, then every level in turn."""
    async with aiohttp.ClientSession() as session:
        await one_request(session, url, key, "warm up", 4, args.timeout)
    rows = []
    meter = CpuMeter(server_pid)
    for users in args.users:
        before, steps, started = meter.sample(), await engine_steps(url), time.time()
        spies = spy(args, meter, users)
        row = await run_level(url, key, users, args.request_rate, args.duration, args.input_len,
                              args.output_len, args.timeout, args.seed, args.clients)
        row |= meter.per_token(row, before, meter.sample()) | step_mix(steps, await engine_steps(url))
        row["started_at"] = started  # the level's first arrival (unix time: e.g. to date JIT compiles against)
        for proc in spies:
            proc.wait(30)
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    return rows


STEP_COUNTERS = ("steps_total", "prefill_steps_total", "graph_steps_total", "step_tokens_total",
                 "step_seconds_total")
# server-side histograms whose tail a level reports, with the threshold of the tail: where a slow first token
# waited (the API, the engine's queue, on its way back to the stream; the client's own count beside them), and
# how late the API's event loop woke its timer (sampled 20 times a second: a saturated API process)
TAIL_S = 1.0  # a slow first token: the client's own count and the server's three below
TAIL_HISTOGRAMS = {"cipherlm:time_to_first_token_seconds": ("server_ttft", TAIL_S),
                   "cipherlm:request_queue_time_seconds": ("queue_time", TAIL_S),
                   "cipherlm:first_token_delivery_seconds": ("delivery", TAIL_S),
                   "cipherlm:api_event_loop_lag_seconds": ("api_loop_lag", 0.1)}


async def engine_steps(url: str) -> dict[str, float]:
    """:func:`read_counters` of the server's /metrics; {} if unreadable."""
    try:
        async with aiohttp.ClientSession() as session, session.get(
                url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            return read_counters(await resp.text())
    except (aiohttp.ClientError, TimeoutError):
        return {}


def read_counters(text: str) -> dict[str, float]:
    """The engine's step counters (``cipherlm:engine_*``) and the tail histograms' counts and sums, summed over
    tenants (``server_ttft_count``, ``server_ttft_sum``; ``server_ttft_le``: those at or under the histogram's
    threshold in ``TAIL_HISTOGRAMS``), from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {f"cipherlm:engine_{c}": c for c in STEP_COUNTERS}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in names:
                out[names[s.name]] = s.value
            stem, _, part = s.name.rpartition("_")
            base, threshold = TAIL_HISTOGRAMS.get(stem, (None, None))
            if base is None or part not in ("count", "sum", "bucket"):
                continue
            if part == "bucket":
                if float(s.labels["le"]) != threshold:
                    continue
                part = "le"
            out[f"{base}_{part}"] = out.get(f"{base}_{part}", 0.0) + s.value
    return out


def step_mix(before: dict, after: dict) -> dict:
    """Between two readings of :func:`engine_steps`: steps, the shares that carried prompt tokens and that ran
    eagerly (no graph replay), the mean host time per step (ms) and tokens per step; and how many requests
    took over a second to their first token as the server saw it, to their first step (queue time), and
    from the engine's first token to the API's stream (delivery); how often and how late on average the API's
    event loop woke its timer."""
    d = {c: after.get(c, 0.0) - before.get(c, 0.0) for c in after}
    tails = {f"{base}_over_{threshold:g}s": int(d[f"{base}_count"] - d.get(f"{base}_le", 0))
             for base, threshold in TAIL_HISTOGRAMS.values() if f"{base}_count" in d}
    if d.get("api_loop_lag_count"):
        tails["api_loop_lag_mean_ms"] = 1e3 * d.get("api_loop_lag_sum", 0.0) / d["api_loop_lag_count"]
    if not d.get("steps_total"):
        return tails
    n = d["steps_total"]
    return tails | {"steps": int(n), "prefill_step_share": d["prefill_steps_total"] / n,
                    "eager_step_share": 1 - d["graph_steps_total"] / n,
                    "ms_per_step": 1e3 * d["step_seconds_total"] / n, "tokens_per_step": d["step_tokens_total"] / n}


def spy(args: argparse.Namespace, meter: CpuMeter, users: int) -> list[subprocess.Popen]:
    """``--py-spy DIR``: sample the API process and the engine core for the level's arrival window
    (``py-spy record --nonblocking``: the processes are never paused; raw stacks, bench/profile_summary.py)."""
    if not getattr(args, "py_spy", None) or not meter.pid:
        return []
    Path(args.py_spy).mkdir(parents=True, exist_ok=True)
    label = args.label or "serve"
    return [subprocess.Popen([args.py_spy_bin, "record", "--nonblocking", "--rate", "100", "--duration",
                              str(max(1, int(args.duration))), "--format", "raw", "-o",
                              str(Path(args.py_spy) / f"{label}_{users}_{name}.txt"), "--pid", str(pid)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pid in [("api", meter.pid)] + [(f"child{i}", k) for i, k in enumerate(meter.kids)]]


# --- the offline engine on the same lengths ----------------------------------------------------------


def offline_level(args: argparse.Namespace, users: int) -> dict:
    """The offline engine at ``users`` sequences per step: output tok/s and its own time per output token."""
    from engine.default_model import default_model_dir
    from engine.engine_config import EngineConfig
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    cfg = {"device": args.device} | ({"num_threads": args.threads} if args.threads else {})
    cfg |= {k: tomllib.loads(f"v = {v}")["v"] for k, v in args.engine_set}
    llm = LLM(args.model or str(default_model_dir()), engine_config=EngineConfig(max_num_seqs=users, **cfg))
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    llm.generate([make_prompt(rng, args.input_len) for _ in range(min(users, 4))], params)  # warm-up
    n = max(2 * users, 8) if args.offline_requests is None else args.offline_requests
    prompts = [make_prompt(rng, args.input_len) for _ in range(n)]
    t0, before = time.perf_counter(), dataclasses.asdict(llm.engine.stats())
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    mix = step_mix(before, dataclasses.asdict(llm.engine.stats()))
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    tpot = [(o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1) * 1e3
            for o in outs if o.metrics and o.metrics.first_token_time and len(o.outputs[0].token_ids) > 1]
    return {"users": users, "requests": n, "wall_s": wall, "out_tok_per_s": tokens / wall,
            "tpot_p50_ms": _pct(tpot, 50)} | mix


def _share(row: dict, key: str) -> str:
    return f"{100 * row[key]:.0f} %" if key in row else "-"


def compare(rows: list[dict], offline: list[dict]) -> str:
    """Every served row against the offline engine at the same users."""
    by_users = {o["users"]: o for o in offline}
    lines = ["| engine | users | served out tok/s | offline out tok/s | share | served TPOT p50 | engine TPOT p50 "
             "| ratio | steps with prompt tokens, served / offline | eager steps, served / offline "
             "| ms per step, served / offline |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        o = by_users.get(r["users"])
        if o is None:
            continue
        lines.append(f"| {r.get('engine', '?')} | {r['users']} | {r['out_tok_per_s']:.1f} | {o['out_tok_per_s']:.1f} "
                     f"| {100 * r['out_tok_per_s'] / o['out_tok_per_s']:.0f} % | {r['tpot_p50_ms']:.2f} "
                     f"| {o['tpot_p50_ms']:.2f} | {r['tpot_p50_ms'] / o['tpot_p50_ms']:.2f}x "
                     f"| {_share(r, 'prefill_step_share')} / {_share(o, 'prefill_step_share')} "
                     f"| {_share(r, 'eager_step_share')} / {_share(o, 'eager_step_share')} "
                     f"| {r.get('ms_per_step', float('nan')):.2f} / {o.get('ms_per_step', float('nan')):.2f} |")
    return "\n".join(lines)


def serve_once(args: argparse.Namespace, tmp: Path) -> list[dict]:
    """Every level against one server (started here unless ``--url``)."""
    proc = None
    if args.url:
        url, key = args.url.rstrip("/"), args.api_key
    else:
        proc, url, key = start_server(args, tmp)
    try:
        rows = asyncio.run(bench(args, url, key, proc.pid if proc is not None else None))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    label = args.label or ("url" if args.url else ("process" if args.process else "thread"))
    return [{**r, "engine": label} for r in rows]


def engine_setting(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` of ``--engine-set``: the value must parse as TOML (``true``, ``4``, ``"fp8"``)."""
    key, sep, value = text.partition("=")
    try:
        tomllib.loads(f"v = {value}")
    except tomllib.TOMLDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: the value is no TOML value ({exc})") from exc
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE")
    return key, value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (default: start `cipherlm serve`)")
    p.add_argument("--api-key", default=os.environ.get("CIPHERLM_API_KEY"))
    p.add_argument("--model", help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="auto", help="engine device when the script starts the server")
    p.add_argument("--threads", type=int, help="torch threads of the server's engine (CPU)")
    p.add_argument("--users", type=int, nargs="+", default=[1, 8, 32], help="max requests in flight")
    p.add_argument("--request-rate", type=float, default=16.0,
                   help="Poisson arrival rate (req/s; inf = back-to-back)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per level")
    p.add_argument("--input-len", type=int, default=100, help="prompt words (~1.2 tokens each)")
    p.add_argument("--output-len", type=int, default=32, help="generated tokens per request")
    p.add_argument("--timeout", type=float, default=600.0, help="bound on one request and on a level's tail")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", help="the rows' engine column (default: process / thread / url)")
    p.add_argument("--stream-interval", type=int,
                   help="the server's stream_interval (tokens per chunk; unset: the server's default)")
    p.add_argument("--clients", type=int, default=1,
                   help="client processes per level (users split between them); see client CPU µs/tok")
    p.add_argument("--engine-process", nargs="+", choices=("on", "off"), default=["on"],
                   help="engine core in its own process (on, the default) or a thread (off); both: one run each")
    p.add_argument("--offline", action="store_true", help="also run the offline engine at every level")
    p.add_argument("--offline-requests", type=int, help="requests per offline level (default 2 x users, >= 8)")
    p.add_argument("--engine-set", action="append", default=[], type=engine_setting, metavar="KEY=VALUE",
                   help="an engine setting (TOML value) for the server and the offline engine, e.g. "
                        "async_scheduling=false; repeatable")
    p.add_argument("--server-set", action="append", default=[], type=engine_setting, metavar="KEY=VALUE",
                   help="a top-level server setting (TOML value), e.g. stream_coalesce_streams=0; repeatable")
    p.add_argument("--py-spy", metavar="DIR", help="record py-spy profiles of the API process and its children "
                   "(the engine core) during each level's arrivals into DIR")
    p.add_argument("--py-spy-bin", default="py-spy", help="the py-spy executable")
    p.add_argument("--json", type=Path, help="write the rows here")
    args = p.parse_args(argv)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="cipherlm-bench-") as tmp:
        for mode in ([None] if args.url else args.engine_process):
            args.process = mode == "on"
            rows += serve_once(args, Path(tmp))
    offline = [offline_level(args, users) for users in args.users] if args.offline else []
    if args.json:
        record = {"args": {k: str(v) for k, v in vars(args).items() if k != "api_key"}, "rows": rows,
                  "offline": offline}
        args.json.write_text(json.dumps(record, indent=2))
    print(markdown(rows))
    if offline:
        print()
        print(compare(rows, offline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
