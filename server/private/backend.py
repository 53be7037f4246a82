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

from collections.abc import Callable
from typing import Any, Protocol

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

    async def submit(self, worker: int, tenant: str, method: str, *args, timeout: float | None = None) -> Any: ...

    async def broadcast(self, method: str, *args) -> list[Any]: ...

    def kill_worker(self, i: int) -> None: ...

    async def close(self) -> None: ...


def make_pool(cfg: PrivateSettings, factory: str, factory_args: tuple) -> WorkerBackend:
    """The worker pool ``cfg.backend`` names, with the bounds of ``cfg``."""
    common = dict(task_timeout=cfg.task_timeout_s, keep_running=cfg.min_workers, idle_stop_s=cfg.worker_idle_s)
    if cfg.backend == "ray":
        from server.private.ray_backend import RayWorkerPool

        return RayWorkerPool(cfg.workers, factory, factory_args, ray_settings=cfg.ray, **common)
    from server.private.workers import WorkerPool

    return WorkerPool(cfg.workers, factory, factory_args, **common)


__all__ = ["WorkerBackend", "make_pool"]
