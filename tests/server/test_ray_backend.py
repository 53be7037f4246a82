"""The Ray worker backend (:mod:`server.private.ray_backend`) on a real Ray head on 127.0.0.1.

One head for the module (a start costs seconds); each test gets its own pool of real actors running the
probe state of :mod:`tests.server.worker_states`. What it pins: the backend keeps the local pool's
contract (task failures by code, tenant-fair queues, a lost worker's state reported through
``on_restart``, queued tasks addressed to a dead actor fail instead of running on its replacement) and
moves large arguments through the object store.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

ray = pytest.importorskip("ray")

from server.private.backend import PoolCollector  # noqa: E402
from server.private.config import RaySettings  # noqa: E402
from server.private.ray_backend import RayWorkerPool  # noqa: E402
from server.private.workers import TaskError, WorkerCrashedError, WorkerStartError, WorkerTimeoutError  # noqa: E402

PROBE = "tests.server.worker_states:make_probe"


@pytest.fixture(scope="module")
def cluster():
    """Two logical Ray nodes on this machine (2 CPUs each; Ray's own multi-node test harness), shared by
    the module's pools: a pool reuses the connected driver. The last test removes the second node."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    second = c.add_node(num_cpus=2)
    ray.init(address=c.address, log_to_driver=False, namespace="cipherlm-test")
    c.wait_for_nodes()
    yield c, second
    ray.shutdown()
    c.shutdown()


def pool(size: int = 1, factory: str = PROBE, args: tuple = ("t",), **kw) -> RayWorkerPool:
    return RayWorkerPool(size, factory, args, ray_settings=RaySettings(num_cpus=0.5), **kw)


async def until(cond, timeout: float = 30.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


async def test_tasks_run_in_actors_and_fail_by_code(cluster):
    p = pool(2, keep_running=0)
    await p.start()
    try:
        assert p.running() == []  # started on demand, like the local pool
        assert await p.submit(1, "a", "echo", 7) == ("t", 7, 1)
        assert p.running() == [1] and p.pids()[0] != os.getpid()
        with pytest.raises(TaskError) as err:
            await p.submit(1, "a", "refuse", "bad_ciphertext", "no")
        assert err.value.code.value == "bad_ciphertext"
        with pytest.raises(TaskError) as err:
            await p.submit(1, "a", "fail", "secret detail")
        assert err.value.code.value == "internal" and err.value.exc_type == "ValueError"
        assert await p.submit(1, "a", "echo", 8) == ("t", 8, 2)  # the same actor kept its state
        metrics = {(m.name, tuple(s.labels.values())): s.value
                   for m in PoolCollector(p, "ray", lambda i: 3 * i).collect() for s in m.samples}
        assert metrics[("cipherlm:private_workers_running", ("ray",))] == 1
        assert metrics[("cipherlm:private_worker_open_sessions", ("1",))] == 3
        assert metrics[("cipherlm:private_worker_pending_tasks", ("0",))] == 0
    finally:
        await p.close()


async def test_large_arguments_travel_through_the_object_store(cluster):
    p = pool(keep_running=1)
    await p.start()
    try:
        blob = os.urandom(3 << 20)
        tag, back, _ = await p.submit(0, "a", "echo", blob)
        assert back == blob
    finally:
        await p.close()


async def test_a_killed_actor_is_reported_lost_and_replaced(cluster):
    lost: list[int] = []
    p = pool(keep_running=1, on_restart=lost.append, health_poll_s=0.2, ping_timeout_s=5.0)
    await p.start()
    try:
        pid = p.pids()[0]
        os.kill(pid, signal.SIGKILL)  # the actor process dies between tasks
        await until(lambda: lost == [0] and p.running() == [0])
        assert p.pids()[0] != pid and p.restarts == 1
        assert (await p.submit(0, "a", "echo", 1))[2] == 1  # a fresh state
    finally:
        await p.close()


async def test_death_mid_task_fails_it_and_the_queued_ones(cluster):
    lost: list[int] = []
    p = pool(keep_running=1, on_restart=lost.append)
    await p.start()
    try:
        running = asyncio.ensure_future(p.submit(0, "a", "segfault"))
        queued = asyncio.ensure_future(p.submit(0, "b", "echo", 2))
        with pytest.raises(WorkerCrashedError):
            await running
        with pytest.raises(WorkerCrashedError):  # addressed to the dead actor's state
            await queued
        assert lost == [0]
        assert (await p.submit(0, "a", "echo", 3))[2] == 1
    finally:
        await p.close()


async def test_timeout_kills_the_actor_and_a_broken_factory_is_a_start_error(cluster):
    p = pool(keep_running=1)
    await p.start()
    try:
        with pytest.raises(WorkerTimeoutError):
            await p.submit(0, "a", "sleep", 30.0, "late", timeout=0.5)
        assert await p.submit(0, "a", "sleep", 0.0, "ok") == "ok"
    finally:
        await p.close()
    broken = pool(factory="tests.server.worker_states:make_broken", args=(), keep_running=0, start_timeout=60)
    await broken.start()
    try:
        with pytest.raises(WorkerStartError, match="could not build its state: RuntimeError: this worker state"):
            await broken.submit(0, "a", "echo", 1)
    finally:
        await broken.close()


async def test_losing_a_node_loses_only_its_workers(cluster):
    """Two slots of 2 CPUs: one actor per node. The second node goes away: its slot is reported lost and
    its queued task fails; the slot on the head keeps its state and serves."""
    c, second = cluster
    lost: list[int] = []
    p = RayWorkerPool(2, PROBE, ("t",), ray_settings=RaySettings(num_cpus=2), keep_running=2, start_timeout=5,
                      on_restart=lost.append, health_poll_s=0.2, ping_timeout_s=3.0)
    await p.start()
    try:
        nodes = p.nodes()
        assert len(set(nodes.values())) == 2
        gone = next(i for i, n in nodes.items() if n == second.node_id)
        stays = 1 - gone
        await p.submit(stays, "a", "echo", 1)
        c.remove_node(second)
        with pytest.raises(WorkerCrashedError):
            await p.submit(gone, "a", "echo", 2)
        await until(lambda: gone in lost)
        assert stays not in lost and (await p.submit(stays, "a", "echo", 3))[2] == 2  # same actor, same state
    finally:
        await p.close()
