"""``Lifecycle.until_cut``: what a stream does when the drain window ends, and that however it ends the
engine stream behind it is closed (no task left iterating it)."""

from __future__ import annotations

import asyncio

import pytest

from server.app import Lifecycle
from server.errors import ServiceUnavailableError


class Ticks:
    """An endless async stream that records whether it was closed."""

    def __init__(self) -> None:
        self.closed = False

    async def gen(self):
        try:
            i = 0
            while True:
                await asyncio.sleep(0.01)
                yield i
                i += 1
        finally:
            self.closed = True


async def test_cut_ends_the_stream_with_server_shutdown_and_closes_it():
    lc, ticks, got = Lifecycle(), Ticks(), []

    async def consume():
        async for x in lc.until_cut(ticks.gen()):
            got.append(x)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.1)
    lc.cut()
    with pytest.raises(ServiceUnavailableError) as info:
        await asyncio.wait_for(task, 2)
    assert info.value.code == "server_shutdown" and got and ticks.closed and lc.draining


async def test_a_consumer_that_stops_closes_the_stream():
    lc, ticks = Lifecycle(), Ticks()
    it = lc.until_cut(ticks.gen())
    assert await anext(it) == 0
    await it.aclose()
    assert ticks.closed

    cancelled = Ticks()

    async def consume():
        async for _ in lc.until_cut(cancelled.gen()):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    task.cancel()  # a client disconnect
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cancelled.closed


async def test_reset_admits_again():
    lc = Lifecycle()
    lc.cut()
    lc.reset()
    assert not lc.draining and not lc.closing.is_set()
