"""Private workers as Ray actors: the ``ray`` worker backend (``private.backend = "ray"``).

Same contract as the local pool (:class:`server.private.workers.WorkerPool`, the seam is
:class:`server.private.backend.WorkerBackend`): ``size`` worker slots, each at most one actor at a
time, one task at a time per actor, waiting tasks taken round-robin across tenants, a lost actor's state
reported through ``on_restart(i)`` so the service marks its sessions lost (410 ``session_lost``, which the
SDK replays). What Ray adds is where the actor runs: any node of the cluster with room for the worker's
resource shape (:class:`server.private.config.RaySettings`: CPUs, a GPU share, memory for key sets).

* **Placement.** The service still decides which slot a session goes to (a slot that already holds its
  key set, else the least loaded with room, under ``max_keys_per_worker``); Ray decides the node of the
  slot's actor.
* **Large arguments** (key uploads: 150 MB to 1 GB) are put into Ray's object store once
  (``ray.put``) and passed by reference, so the bytes go from this process to the actor's node through
  the object store's transfer, not through the actor-call path.
* **Failure.** A call on a dead actor (its process or node died) raises Ray's ``RayActorError``: the
  task fails with :class:`WorkerCrashedError`, the slot's state is reported lost and the actor is
  replaced. Between tasks an idle slot pings its actor every ``health_poll_s``; a ping that fails or
  does not answer within ``ping_timeout_s`` is the same loss. A task past its timeout kills the actor.
* **Cluster.** ``ray_settings.address`` names an existing cluster; None starts a head on 127.0.0.1
  inside this server (stopped with the pool). A process already connected to Ray (tests) is reused.

Only public evaluation keys and ciphertexts travel: the actors run the same
:class:`server.private.compute.PrivateCompute` as local workers (``docs/operator-guide.md`` says what
must stay on a private network).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from server.private.config import RaySettings
from server.private.workers import (
    HEALTH_POLL_S,
    SlotQueues,
    TaskError,
    WorkerCrashedError,
    WorkerError,
    WorkerStartError,
    WorkerTimeoutError,
    _settle,
    _Slot,
    build_state,
    run_task,
    start_failure,
)

log = logging.getLogger("cipherlm.workers.ray")
#: arguments at least this large go through the object store by reference (key uploads, big steps)
OBJECT_STORE_MIN_BYTES = 1 << 20


class RayUnavailableError(WorkerError):
    """``backend = "ray"`` but Ray is not installed (``pip install 'cipherlm[ray]'``)."""


def _ray():
    try:
        import ray
    except ImportError as exc:
        raise RayUnavailableError("the ray worker backend needs Ray: pip install 'cipherlm[ray]'") from exc
    return ray


class WorkerActor:
    """The body of one worker actor: a worker state and the shared task runner (runs inside Ray)."""

    def __init__(self, factory: str, factory_args: tuple) -> None:
        try:
            self.state, self.failure = build_state(factory, factory_args), None
        except Exception as exc:  # noqa: BLE001 - said by ready(), so the server's log names the cause
            self.state, self.failure = None, start_failure(exc)

    def ready(self) -> tuple[int, str] | str:
        """(process id, node id): the actor is up and its state built; or why the state could not be built."""
        import ray

        return self.failure or (os.getpid(), ray.get_runtime_context().get_node_id())

    def call(self, method: str, *args) -> tuple[str, Any]:
        # top-level ObjectRef arguments arrive resolved (Ray fetches them from the object store)
        return run_task(self.state, method, args)


class _ActorSlot(_Slot):
    """A slot whose worker is an actor handle (``info``: its (pid, node id) once ready)."""

    def __init__(self) -> None:
        super().__init__()
        self.info: tuple[int, str] | None = None

    def alive(self) -> bool:
        return self.worker is not None


class RayWorkerPool(SlotQueues):
    """Up to ``size`` worker actors on a Ray cluster with tenant-fair queues; use from one event loop.

    Args mirror :class:`server.private.workers.WorkerPool`, plus:
        ray_settings: the cluster address and one actor's resource shape.
        ping_timeout_s: an idle actor that does not answer a health ping within this is lost.
    """

    def __init__(self, size: int, factory: str, factory_args: tuple = (), task_timeout: float = 120.0,
                 start_timeout: float = 120.0, on_restart: Callable[[int], None] | None = None, *,
                 ray_settings: RaySettings | None = None, keep_running: int | None = None,
                 idle_stop_s: float | None = None, in_use: Callable[[int], bool] | None = None,
                 health_poll_s: float = HEALTH_POLL_S, ping_timeout_s: float = 10.0) -> None:
        if size < 1:
            raise ValueError("a worker pool needs at least one worker")
        self._ray = _ray()
        self.size, self.factory, self.factory_args = size, factory, factory_args
        self.task_timeout, self.start_timeout = task_timeout, start_timeout
        self.on_restart = on_restart
        self.settings = ray_settings or RaySettings()
        self.keep_running = size if keep_running is None else min(keep_running, size)
        self.idle_stop_s, self.health_poll_s, self.ping_timeout_s = idle_stop_s, health_poll_s, ping_timeout_s
        self.in_use = in_use or (lambda i: False)
        self._slots = [_ActorSlot() for _ in range(size)]
        self._runners: list[asyncio.Task] = []
        self._actor_cls = None
        self._owns_cluster = False
        self.restarts = 0
        self.started = 0
        self._closed = False

    # -- cluster -----------------------------------------------------------------------------------------
    def _connect(self) -> None:
        """Join the configured cluster, or start a head on the loopback address (blocking: in a thread)."""
        ray, cfg = self._ray, self.settings
        if not ray.is_initialized():
            if cfg.address is None:  # "local" forces a new head: never join a stray cluster by accident
                ray.init(address="local", namespace=cfg.namespace, num_cpus=cfg.head_cpus,
                         _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False,
                         configure_logging=False)
            else:
                ray.init(address=cfg.address, namespace=cfg.namespace, log_to_driver=False,
                         configure_logging=False)
            self._owns_cluster = True
        self._actor_cls = ray.remote(max_restarts=0, max_task_retries=0)(WorkerActor)

    def _options(self) -> dict:
        cfg = self.settings
        opts: dict[str, Any] = {"num_cpus": cfg.num_cpus, "num_gpus": cfg.num_gpus}
        if cfg.memory_gb is not None:
            opts["memory"] = int(cfg.memory_gb * (1 << 30))
        return opts

    async def start(self) -> None:
        """Connect, start the ``keep_running`` actors, then the slot runners (others start on demand)."""
        await asyncio.to_thread(self._connect)
        for i in range(self.keep_running):
            await self._spawn_into(i)
        self._runners = [asyncio.create_task(self._run(i), name=f"ray-worker-{i}") for i in range(self.size)]

    # -- the pool's view -----------------------------------------------------------------------------------
    def running(self) -> list[int]:
        """Indices of the slots with an actor up."""
        return [i for i, slot in enumerate(self._slots) if slot.alive()]

    def pids(self) -> list[int]:
        """Process ids of the running actors (on their nodes)."""
        return [slot.info[0] for slot in self._slots if slot.alive() and slot.info]

    def nodes(self) -> dict[int, str]:
        """Slot -> Ray node id of its actor."""
        return {i: slot.info[1] for i, slot in enumerate(self._slots) if slot.alive() and slot.info}

    # -- the slot runner ------------------------------------------------------------------------------------
    async def _run(self, i: int) -> None:
        slot = self._slots[i]
        while True:
            if not slot.pending:
                await self._idle(i)
                continue
            fut, method, args, timeout, generation = slot.take()
            if fut.cancelled():
                continue
            if generation != slot.generation:  # addressed to an actor whose state is gone
                _settle(fut, exc=WorkerCrashedError("the worker died before the task ran; its sessions were lost"))
                continue
            await self._execute(i, fut, method, args, timeout)

    async def _execute(self, i: int, fut: asyncio.Future, method: str, args: tuple, timeout: float) -> None:
        slot = self._slots[i]
        try:
            if slot.worker is None:
                await self._spawn_into(i)
            status, payload = await asyncio.wait_for(self._call(slot.worker, method, args), timeout)
        except WorkerStartError as exc:
            log.error("worker actor %d could not be started: %s", i, exc)
            _settle(fut, exc=exc)
        except TimeoutError:
            _settle(fut, exc=WorkerTimeoutError(f"task {method} exceeded {timeout} s; worker restarted"))
            await self._lost(i, "timeout")
        except self._ray.exceptions.RayError as exc:
            if isinstance(exc, self._ray.exceptions.RayTaskError):  # e.g. a result Ray could not serialize
                _settle(fut, exc=TaskError("internal", f"task {method} failed in Ray", type(exc).__name__))
            else:
                _settle(fut, exc=WorkerCrashedError(f"worker died during {method}; its sessions were lost"))
                await self._lost(i, type(exc).__name__)
        else:
            if status == "error":
                _settle(fut, exc=TaskError(*payload))
            else:
                _settle(fut, result=payload)
        slot.last_active = time.monotonic()

    async def _call(self, actor, method: str, args: tuple) -> tuple[str, Any]:
        """One actor call; large bytes go through the object store by reference."""
        refs = []
        for a in args:
            if isinstance(a, list) and any(isinstance(b, memoryview) for b in a):   # views of a request body
                a = [bytes(b) if isinstance(b, memoryview) else b for b in a]
            if isinstance(a, bytes | bytearray) and len(a) >= OBJECT_STORE_MIN_BYTES:
                a = await asyncio.to_thread(self._ray.put, a)
            refs.append(a)
        return await actor.call.remote(method, *refs)

    async def _idle(self, i: int) -> None:
        """Wait for a task; meanwhile ping the actor (Ray tells a dead one at once) and stop an idle one."""
        slot = self._slots[i]
        slot.wakeup.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(slot.wakeup.wait(), None if slot.worker is None else self.health_poll_s)
        if slot.pending or slot.worker is None:
            return
        actor = slot.worker
        if not await self._healthy(actor):
            if slot.worker is actor:  # not already replaced by a task that found it dead
                await self._lost(i, "died while idle")
        elif self._idle_expired(i):
            log.info("worker actor %d idle for %.0f s; stopping it", i, time.monotonic() - slot.last_active)
            actor = self._detach(i)
            if self.on_restart:
                self.on_restart(i)
            self._kill(actor)

    async def _healthy(self, actor) -> bool:
        try:
            await asyncio.wait_for(actor.ready.remote(), self.ping_timeout_s)
        except (TimeoutError, self._ray.exceptions.RayError):
            return False
        return True

    def _idle_expired(self, i: int) -> bool:
        if self.idle_stop_s is None or i < self.keep_running or self.in_use(i):
            return False
        return time.monotonic() - self._slots[i].last_active >= self.idle_stop_s

    # -- actor start and loss ---------------------------------------------------------------------------
    async def _spawn_into(self, i: int) -> None:
        actor = self._actor_cls.options(**self._options()).remote(self.factory, self.factory_args)
        try:
            info = await asyncio.wait_for(actor.ready.remote(), self.start_timeout)
        except (TimeoutError, self._ray.exceptions.RayError) as exc:
            self._kill(actor)
            raise WorkerStartError(f"worker actor did not start within {self.start_timeout} s "
                                   f"({type(exc).__name__})") from exc
        if isinstance(info, str):
            self._kill(actor)
            raise WorkerStartError(f"worker actor could not build its state: {info}")
        slot = self._slots[i]
        slot.worker, slot.info, slot.last_active = actor, tuple(info), time.monotonic()
        self.started += 1

    def _detach(self, i: int):
        """Forget slot ``i``'s actor; tasks queued for it will fail. Returns the handle, for the caller."""
        slot = self._slots[i]
        actor, slot.worker, slot.info = slot.worker, None, None
        slot.generation += 1
        return actor

    def _kill(self, actor) -> None:
        if actor is not None:
            with contextlib.suppress(Exception):  # already dead, or its node is gone
                self._ray.kill(actor, no_restart=True)

    async def _lost(self, i: int, why: str) -> None:
        """Slot ``i``'s actor died or was killed: report its state lost, replace it if it held sessions."""
        had_sessions = self.in_use(i)
        actor = self._detach(i)
        self.restarts += 1
        log.warning("worker actor %d lost (%s)", i, why)
        if self.on_restart:  # before any await: a session opened meanwhile must not count on its keys
            self.on_restart(i)
        self._kill(actor)
        if had_sessions or i < self.keep_running:
            try:
                await self._spawn_into(i)
            except WorkerError as exc:
                log.error("worker actor %d could not be replaced: %s", i, exc)

    def kill_worker(self, i: int) -> None:
        """Kill slot ``i``'s actor (tests; destroying key material held in memory)."""
        self._kill(self._slots[i].worker)

    async def close(self) -> None:
        """Stop the runners and the actors (and the head this pool started); later tasks fail."""
        self._closed = True
        for t in self._runners:
            t.cancel()
        await asyncio.gather(*self._runners, return_exceptions=True)
        for i, slot in enumerate(self._slots):
            self._kill(self._detach(i))
            for q in slot.queues.values():
                for fut, *_ in q:
                    _settle(fut, exc=WorkerError("worker pool closed"))
        if self._owns_cluster:
            await asyncio.to_thread(self._ray.shutdown)


__all__ = ["OBJECT_STORE_MIN_BYTES", "RayUnavailableError", "RayWorkerPool", "WorkerActor"]
