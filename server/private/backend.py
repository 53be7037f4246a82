"""The seam between the encrypted-session service and where its workers run.

The service (:mod:`server.private.service`) places sessions and submits tasks through
:class:`WorkerBackend` only; two backends implement it:

* ``local`` — :class:`server.private.workers.WorkerPool`, processes of this server (the default);
* ``ray`` — :class:`server.private.ray_backend.RayWorkerPool`, actors of a Ray cluster.

Both index workers ``0 .. size-1``, run one task at a time per worker with tenant-fair queues, report a
lost worker's state through ``on_restart(i)`` and fail tasks with the errors of
:mod:`server.private.workers` (so the HTTP mapping of the service does not depend on the backend).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from server.private.config import PrivateSettings


class WorkerBackend(Protocol):
    """What the service needs of a worker pool (see the module docstring)."""

    size: int
    on_restart: Callable[[int], None] | None
    in_use: Callable[[int], bool]
    restarts: int
    started: int

    async def start(self) -> None: ...

    def running(self) -> list[int]: ...

    def least_loaded(self, among: list[int] | None = None) -> int: ...

    def pending(self, i: int) -> int: ...

    async def submit(self, worker: int, tenant: str, method: str, *args, timeout: float | None = None,
                     batch: Any = None, stages: dict[str, float] | None = None) -> Any: ...

    async def broadcast(self, method: str, *args) -> list[Any]: ...

    def kill_worker(self, i: int) -> None: ...

    async def close(self) -> None: ...


def make_pool(cfg: PrivateSettings, factory: str, factory_args: tuple) -> WorkerBackend:
    """The worker pool ``cfg.backend`` names, with the bounds of ``cfg``."""
    common = dict(task_timeout=cfg.task_timeout_s, keep_running=cfg.min_workers, idle_stop_s=cfg.worker_idle_s,
                  start_timeout=cfg.worker_start_timeout_s)
    if cfg.backend == "ray":
        from server.private.ray_backend import RayWorkerPool

        return RayWorkerPool(cfg.workers, factory, factory_args, ray_settings=cfg.ray, **common)
    from server.private.workers import WorkerPool

    return WorkerPool(cfg.workers, factory, factory_args, **common)


class PoolCollector(Collector):
    """``/metrics`` for the workers, per worker (process or actor) and in total, read at scrape time:

    ``cipherlm:private_workers_running`` (gauge, label ``backend``),
    ``cipherlm:private_worker_restarts`` (counter: workers lost), and per worker (label ``worker``)
    ``cipherlm:private_worker_pending_tasks`` and ``cipherlm:private_worker_open_sessions``.
    """

    def __init__(self, pool: WorkerBackend, backend: str, sessions_on: Callable[[int], int]) -> None:
        self.pool, self.backend, self.sessions_on = pool, backend, sessions_on

    def collect(self) -> Iterable[Metric]:
        running = GaugeMetricFamily("cipherlm:private_workers_running", "Encrypted workers up", labels=["backend"])
        running.add_metric([self.backend], len(self.pool.running()))
        restarts = CounterMetricFamily("cipherlm:private_worker_restarts", "Encrypted workers lost",
                                       labels=["backend"])
        restarts.add_metric([self.backend], self.pool.restarts)
        pending = GaugeMetricFamily("cipherlm:private_worker_pending_tasks", "Tasks queued or running, per worker",
                                    labels=["worker"])
        sessions = GaugeMetricFamily("cipherlm:private_worker_open_sessions", "Open sessions, per worker",
                                     labels=["worker"])
        for i in range(self.pool.size):
            pending.add_metric([str(i)], self.pool.pending(i))
            sessions.add_metric([str(i)], self.sessions_on(i))
        yield from (running, restarts, pending, sessions)


__all__ = ["PoolCollector", "WorkerBackend", "make_pool"]
