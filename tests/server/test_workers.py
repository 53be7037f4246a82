"""The worker pool: results, typed failures, crash isolation, timeouts, tenant fairness."""

from __future__ import annotations

import asyncio

import pytest

from server.private.codes import WorkerCode
from server.private.workers import TaskError, WorkerCrashedError, WorkerPool, WorkerTimeoutError

FACTORY = "tests.server.worker_states:make_probe"


@pytest.fixture()
async def pool():
    restarted = []
    p = WorkerPool(2, FACTORY, ("t",), task_timeout=30, on_restart=restarted.append)
    p.restarted = restarted
    await p.start()
    yield p
    await p.close()


async def test_echo_and_state_kept_per_worker(pool):
    assert await pool.submit(0, "a", "echo", 1) == ("t", 1, 1)
    assert await pool.submit(0, "a", "echo", 2) == ("t", 2, 2)
    assert await pool.submit(1, "a", "echo", 3) == ("t", 3, 1)


async def test_task_exception_is_internal_whatever_its_class(pool):
    """A ValueError inside a task is a server bug (code INTERNAL), not a client fault by its name."""
    with pytest.raises(TaskError, match="boom") as e:
        await pool.submit(0, "a", "fail", "boom")
    assert e.value.code is WorkerCode.INTERNAL and e.value.exc_type == "ValueError"
    assert await pool.submit(0, "a", "echo", 1)  # worker still serves


async def test_task_failure_carries_its_code(pool):
    with pytest.raises(TaskError, match="not yours") as e:
        await pool.submit(0, "a", "refuse", "bad_ciphertext", "not yours")
    assert e.value.code is WorkerCode.BAD_CIPHERTEXT


async def test_native_crash_fails_only_that_task(pool):
    pid = await pool.submit(0, "a", "pid")
    other = asyncio.create_task(pool.submit(1, "b", "sleep", 0.5, "other"))
    with pytest.raises(WorkerCrashedError):
        await pool.submit(0, "a", "segfault")
    assert await other == "other"                       # the other worker was untouched
    assert await pool.submit(0, "a", "pid") != pid      # a fresh process took over
    assert pool.restarted == [0]


async def test_killed_worker_mid_task(pool):
    task = asyncio.create_task(pool.submit(1, "a", "sleep", 5, "x"))
    await asyncio.sleep(1.0)
    pool.kill_worker(1)
    with pytest.raises(WorkerCrashedError):
        await task
    assert (await pool.submit(1, "a", "echo", 7))[1] == 7


async def test_hang_times_out(pool):
    with pytest.raises(WorkerTimeoutError):
        await pool.submit(0, "a", "sleep", 30, "late", timeout=1.0)
    assert (await pool.submit(0, "a", "echo", 1))[1] == 1


async def test_round_robin_across_tenants(pool):
    order = []

    async def job(tenant, label):
        order.append(await pool.submit(0, tenant, "sleep", 0.05, label))

    jobs = [asyncio.create_task(job("heavy", f"h{i}")) for i in range(5)]
    await asyncio.sleep(0)  # queue the heavy tenant's work first
    jobs.append(asyncio.create_task(job("light", "l0")))
    await asyncio.gather(*jobs)
    assert order.index("l0") <= 2, order  # not behind all five heavy tasks


async def test_cancelled_before_start_is_dropped(pool):
    blocker = asyncio.create_task(pool.submit(0, "a", "sleep", 0.5, "first"))
    await asyncio.sleep(0.05)
    doomed = asyncio.create_task(pool.submit(0, "a", "echo", "never"))
    await asyncio.sleep(0)
    doomed.cancel()
    await blocker
    after = await pool.submit(0, "a", "echo", "after")
    assert after[2] == 1  # 'never' was not executed: this is the worker's first echo


async def test_queued_tasks_of_one_batch_key_run_as_one_call_each_with_its_own_answer(pool):
    pool.batch_limit = 3
    busy = asyncio.create_task(pool.submit(0, "a", "sleep", 0.5, "busy"))   # the others queue behind it
    await asyncio.sleep(0.1)
    key = ("scale", 1)
    tasks = [asyncio.create_task(pool.submit(0, t, "scale", x, f, batch=key))
             for t, x, f in (("a", 1, 10), ("b", 2, None), ("c", 3, 10), ("b", 4, 10))]
    other = asyncio.create_task(pool.submit(0, "d", "echo", "x"))
    await asyncio.sleep(0)
    assert await busy == "busy"
    results = await asyncio.gather(*tasks, other, return_exceptions=True)
    assert results[0] == 10 and results[2] == 30 and results[3] == 40
    assert isinstance(results[1], TaskError) and results[1].code is WorkerCode.INTERNAL   # fails alone
    assert results[4][1] == "x"                                  # another tenant's task is not starved
    assert await pool.submit(0, "a", "batch_sizes") == [3]       # three at most: the fourth ran alone
    assert dict(pool.batches) == {3: 1}


async def test_a_task_submitted_with_a_stage_sink_gets_its_queue_wait_transfers_and_worker_time(pool):
    """``stages``: the queue wait behind another task, both transfers and the worker's own time (``worker_rest``,
    the probe state notes no split of its own), each non-negative and the sleep inside ``worker_rest``; a task
    cancelled in the queue leaves no sink behind."""
    busy = asyncio.create_task(pool.submit(0, "a", "sleep", 0.3, "busy"))
    await asyncio.sleep(0.05)
    stages: dict[str, float] = {}
    dropped = asyncio.create_task(pool.submit(0, "b", "echo", 1, stages={}))
    await asyncio.sleep(0)
    dropped.cancel()
    assert await pool.submit(0, "a", "sleep", 0.1, "x", stages=stages) == "x"
    await busy
    assert set(stages) == {"queue_wait", "to_worker", "worker_rest", "from_worker"}
    assert all(v >= 0 for v in stages.values())
    assert stages["queue_wait"] >= 0.15 and 0.1 <= stages["worker_rest"] < 1.0
    assert not pool._slots[0].stage_sinks


async def test_large_blob_lists_cross_the_pipe_raw_both_ways_and_small_ones_pickled(pool):
    """A list of byte strings of RAW_MIN_BYTES or more (a step's uploads) goes to the worker raw after the frame and
    comes back the same way inside a tuple answer: the same bytes, in order, with the other arguments untouched; an
    empty or small list is pickled as before (bytes back)."""
    from server.private.workers import RAW_MIN_BYTES

    blobs = [bytes([i]) * (RAW_MIN_BYTES // 3 + i) for i in range(5)]
    views = [memoryview(b"".join(blobs))[: len(blobs[0])]] + blobs[1:]   # views of a body, as the service sends
    tag, back, _ = await pool.submit(0, "a", "echo", views)
    assert tag == "t" and [bytes(b) for b in back] == blobs
    assert await pool.submit(0, "a", "echo", [b"ab", b"c"]) == ("t", [b"ab", b"c"], 2)
    assert await pool.submit(0, "a", "echo", []) == ("t", [], 3)
    small = memoryview(b"a small body")          # a small step's blobs are views too: raw, not pickled
    tag, back, _ = await pool.submit(0, "a", "echo", [small[:7], small[8:]])
    assert [bytes(b) for b in back] == [b"a small", b"body"]


async def test_a_call_that_cannot_cross_the_pipe_fails_typed_and_the_worker_serves_on(pool):
    """An argument pickle refuses (a server bug) fails its task as a lost worker's, not the pool's runner:
    before, the runner died and every later task of that worker waited forever."""
    with pytest.raises(WorkerCrashedError, match="PicklingError|AttributeError|TypeError"):
        await asyncio.wait_for(pool.submit(0, "a", "echo", lambda: 1), 30)
    assert (await asyncio.wait_for(pool.submit(0, "a", "echo", 5), 60))[1] == 5
