"""bench/serve_bench.py's stream accounting: a served stream whose chunks all carry empty text is a success.

Greedy decoding on random weights can repeat one token whose text is "" (an incomplete UTF-8 byte) for a
whole stream; the 2026-12-02 H200 serving runs counted those as failed with an empty or "without a text
chunk" error although the server had sent every token and the usage.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import sys
from pathlib import Path

import aiohttp
import pytest

_SPEC = importlib.util.spec_from_file_location(
    "serve_bench", Path(__file__).resolve().parents[2] / "bench" / "serve_bench.py")
serve_bench = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("serve_bench", serve_bench)  # dataclasses look their module up
_SPEC.loader.exec_module(serve_bench)


def _sse(events: list) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, str) else json.dumps(e)).encode() + b"\n\n" for e in events)


def _run(body: bytes, status: int = 200) -> serve_bench.RequestResult:
    """``one_request`` against a real loopback HTTP server that answers ``body`` (in two writes, the second
    splitting a line: the client must reassemble SSE lines across reads)."""
    from aiohttp import web

    async def handler(request: web.Request) -> web.StreamResponse:
        assert request.headers["Authorization"] == "Bearer k" and (await request.json())["max_tokens"] == 3
        resp = web.StreamResponse(status=status, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        half = len(body) // 2
        await resp.write(body[:half])
        await resp.write(body[half:])
        await resp.write_eof()
        return resp

    async def go():
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        await web.SockSite(runner, sock).start()
        try:
            async with aiohttp.ClientSession() as session:
                return await serve_bench.one_request(session, f"http://127.0.0.1:{port}", "k", "p", 3, 5.0)
        finally:
            await runner.cleanup()

    return asyncio.run(go())


def test_empty_text_chunks_count_as_tokens():
    chunk = {"choices": [{"index": 0, "text": "", "finish_reason": None}]}
    res = _run(_sse([chunk, chunk, {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
                     {"choices": [], "usage": {"completion_tokens": 3}}, "[DONE]"]))
    assert res.ok and res.error == "" and res.output_tokens == 3
    assert len(res.itl) == 2 and res.text_chunks == 0
    summary = serve_bench.summarize(1, [res], 1.0)
    assert summary["failed"] == 0 and summary["ok_without_text"] == 1


def test_stream_without_token_chunks_and_in_band_error_fail_with_a_name():
    res = _run(_sse([{"choices": [], "usage": {"completion_tokens": 0}}, "[DONE]"]))
    assert not res.ok and res.error == "stream ended without a token chunk"
    res = _run(_sse([{"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
                     {"error": {"message": "boom", "type": "server_error"}}]))
    assert not res.ok and res.error.startswith("in-band:") and res.text_chunks == 1
    assert serve_bench.summarize(1, [res], 1.0)["errors"] == [res.error]


def test_cpu_per_token_per_process():
    import os

    assert serve_bench.cpu_seconds(os.getpid()) > 0 and serve_bench.cpu_seconds(2**22 + 7) == 0.0
    row = {"out_tok_per_s": 1000.0, "wall_s": 2.0, "client_cpu_s": 0.2}
    got = serve_bench.CpuMeter.per_token(row, (1.0, 3.0), (1.1, 3.4))
    assert got == pytest.approx({"api_cpu_us_per_token": 50.0, "core_cpu_us_per_token": 200.0,
                                 "client_cpu_us_per_token": 100.0})


def test_server_tail_counts_between_two_scrapes():
    """The server's TTFT and queue-time histograms, scraped before and after a level, give how many of the
    level's requests waited over a second as the server saw them (and in the engine's queue)."""
    from prometheus_client import generate_latest

    from server.metrics import ServerMetrics

    m = ServerMetrics("tiny")
    m.ttft.labels("a", "tiny").observe(3.0)  # before the level: not counted
    before = serve_bench.read_counters(generate_latest(m.registry).decode())
    for tenant, ttft, queue, delivery in (("a", 0.2, 0.1, 0.05), ("a", 1.5, 0.1, 1.3), ("b", 4.0, 3.9, 0.05),
                                          ("b", 1.0, 0.9, 0.05)):
        m.ttft.labels(tenant, "tiny").observe(ttft)
        m.queue_time.labels(tenant, "tiny").observe(queue)
        m.first_token_delivery.labels(tenant, "tiny").observe(delivery)
    for lag in (0.001, 0.003, 0.5, 0.002):
        m.loop_lag.observe(lag)
    after = serve_bench.read_counters(generate_latest(m.registry).decode())
    assert serve_bench.step_mix(before, after) == pytest.approx({
        "server_ttft_over_1s": 2, "queue_time_over_1s": 1, "delivery_over_1s": 1, "api_loop_lag_over_0.1s": 1,
        "api_loop_lag_mean_ms": 126.5})
