"""The worker pool's process lifecycle: started on demand, stopped when idle, a death between tasks
noticed at once (its state reported lost, tasks addressed to it failed, the worker replaced)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest

from server.private.workers import WorkerCrashedError, WorkerPool, WorkerStartError

FACTORY = "tests.server.worker_states:make_probe"


async def until(predicate, timeout_s: float = 10.0, poll_s: float = 0.02) -> float:
    """Seconds until ``predicate()`` holds (fails the test after ``timeout_s``)."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout_s, "condition not reached"
        await asyncio.sleep(poll_s)
    return time.monotonic() - t0


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture()
async def lazy():
    """Two slots, none started, idle workers stopped after 0.5 s; sessions tracked in ``p.sessions``."""
    lost: list[int] = []
    sessions: set[int] = set()
    p = WorkerPool(2, FACTORY, ("t",), task_timeout=30, on_restart=lost.append, keep_running=0,
                   idle_stop_s=0.5, in_use=lambda i: i in sessions, health_poll_s=60)
    p.lost, p.sessions = lost, sessions
    await p.start()
    yield p
    await p.close()


async def test_no_process_until_a_task_needs_one(lazy):
    assert lazy.running() == [] and lazy.started == 0
    pid = await lazy.submit(1, "a", "pid")
    assert lazy.running() == [1] and lazy.pids() == [pid] and psutil.pid_exists(pid)
    assert lazy.least_loaded() == 1  # a tie goes to the worker already up, not to a new process


async def test_idle_worker_is_stopped_and_its_state_reported_gone(lazy):
    pid = await lazy.submit(0, "a", "pid")
    # checked at every turn of the loop: the state is reported gone the moment the worker is, so a session
    # opened in between cannot count on keys the stopped process held
    await until(lambda: lazy.running() == [], 5, poll_s=0)
    assert lazy.lost == [0] and lazy.restarts == 0   # a stop, not a crash
    await until(lambda: not running(pid), 5)      # and the process really ends (killed just after)
    assert (await lazy.submit(0, "a", "echo", 1))[2] == 1   # a fresh process (its first call) on demand


async def test_worker_holding_sessions_is_not_stopped(lazy):
    lazy.sessions.add(0)
    pid = await lazy.submit(0, "a", "pid")
    await asyncio.sleep(1.2)
    assert lazy.pids() == [pid] and lazy.lost == []
    lazy.sessions.clear()
    await until(lambda: lazy.running() == [], 2)


async def test_worker_killed_while_idle_is_reported_at_once_and_replaced(lazy):
    lazy.sessions.add(0)
    pid = await lazy.submit(0, "a", "pid")
    os.kill(pid, signal.SIGKILL)
    # health_poll_s is 60: only the process sentinel can make this fast
    assert await until(lambda: lazy.lost == [0], 5) < 3
    lazy.sessions.clear()  # what the service does: its sessions are now lost
    await until(lambda: len(lazy.pids()) == 1, 10)
    assert lazy.pids() != [pid] and lazy.restarts == 1


async def test_task_queued_for_a_dead_worker_fails_instead_of_running_on_its_replacement(lazy):
    lazy.sessions.add(0)
    assert (await lazy.submit(0, "a", "echo", "x"))[2] == 1
    lazy.kill_worker(0)
    lazy._slots[0].worker.proc.join(5)  # dead, and the event loop has not run since
    with pytest.raises(WorkerCrashedError, match="before the task ran"):
        await lazy.submit(0, "a", "echo", "addressed to the dead process")
    assert lazy.lost == [0]
    assert (await lazy.submit(0, "a", "echo", "y"))[2] == 1  # the replacement serves new work


async def test_a_worker_that_cannot_start_is_a_typed_error_and_retried():
    pool = WorkerPool(1, "tests.server.worker_states:make_broken", (), keep_running=0, start_timeout=60)
    await pool.start()
    try:
        for _ in range(2):  # each task tries to start the worker again; the error names the factory's failure
            with pytest.raises(WorkerStartError, match="could not build its state: RuntimeError: this worker state"):
                await pool.submit(0, "a", "echo", 1)
        assert pool.running() == [] and pool.restarts == 0
    finally:
        await pool.close()


def test_a_start_failure_says_what_failed_and_what_to_do_about_device_memory():
    from server.private.workers import start_failure

    assert start_failure(ValueError("no plan at /x")) == "ValueError: no plan at /x"
    oom = start_failure(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert oom.startswith("RuntimeError: CUDA out of memory") and "gpu_memory_utilization" in oom
    assert len(start_failure(ValueError("x" * 10_000))) < 400


async def test_eager_workers_start_with_the_pool_and_stay():
    pool = WorkerPool(2, FACTORY, ("t",), keep_running=1, idle_stop_s=0.2, health_poll_s=0.05)
    await pool.start()
    try:
        assert pool.running() == [0]
        await pool.submit(1, "a", "pid")
        await until(lambda: pool.running() == [0], 5)  # slot 1 stopped, slot 0 kept
        await asyncio.sleep(0.4)
        assert pool.running() == [0]
    finally:
        await pool.close()
    assert pool.running() == []
