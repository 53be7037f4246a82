"""The API's event-loop lag (``cipherlm:api_event_loop_lag_seconds``): a loop held up by a long callback shows
its delay; an idle one shows next to none. The app samples it for as long as its lifespan runs."""

from __future__ import annotations

import asyncio
import time

from server.metrics import ServerMetrics
from tests.server.app_helpers import tiny_model_dir  # noqa: F401 - fixture


def _samples(m: ServerMetrics) -> tuple[float, float]:
    count = total = 0.0
    for family in m.registry.collect():
        for s in family.samples:
            if s.name == "cipherlm:api_event_loop_lag_seconds_count":
                count = s.value
            elif s.name == "cipherlm:api_event_loop_lag_seconds_sum":
                total = s.value
    return count, total


def test_a_blocked_loop_shows_as_lag_and_an_idle_one_does_not():
    m = ServerMetrics("m")

    async def run(block_s: float) -> None:
        watcher = asyncio.create_task(m.watch_event_loop(interval_s=0.01))
        await asyncio.sleep(0.05)  # idle: the timer wakes about on time
        time.sleep(block_s)        # a callback that holds the loop (a saturated API process)
        await asyncio.sleep(0.03)
        watcher.cancel()

    asyncio.run(run(0.0))
    idle_count, idle_total = _samples(m)
    assert idle_count >= 3 and idle_total / idle_count < 0.1  # a loaded test box wakes timers a little late
    asyncio.run(run(0.3))
    count, total = _samples(m)
    assert total - idle_total >= 0.25  # the held loop's 0.3 s, seen by the sample that spanned it


def test_the_app_samples_the_loop_while_it_runs(tiny_model_dir):  # noqa: F811
    from fastapi.testclient import TestClient

    from server.app import create_app
    from tests.server.app_helpers import make_settings

    with TestClient(create_app(make_settings(tiny_model_dir))) as client:  # the lifespan: engine and watcher
        time.sleep(0.3)
        text = client.get("/metrics").text
    line = next(ln for ln in text.splitlines() if ln.startswith("cipherlm:api_event_loop_lag_seconds_count"))
    assert float(line.split()[-1]) >= 2
