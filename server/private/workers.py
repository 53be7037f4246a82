"""A pool of worker processes for untrusted ciphertext work.

Untrusted key and ciphertext bytes are deserialized and evaluated only inside these processes, so a
crash in native code (SEAL) or a hang kills one worker, never the server. Each worker owns a state
object built from an importable factory (``"package.module:function"``); a task is ``(method, args)``
called on that state. A task that fails reports a code from the one table of
:mod:`server.private.codes` (:class:`TaskError`), never an exception class name.

Scheduling, per worker: one task at a time; waiting tasks are taken round-robin across tenants
(a tenant with many queued steps cannot starve another); a task cancelled before it starts is dropped.
A task that outlives its timeout, or a worker that dies mid-task, fails that task with a typed error;
the worker is restarted (its in-memory state — sessions pinned to it — is lost, and
:attr:`WorkerPool.on_restart` is told which worker lost it).
"""

from __future__ import annotations

import asyncio
import collections
import importlib
import logging
import multiprocessing as mp
import traceback
from collections.abc import Callable
from typing import Any

from server.private.codes import TaskFailure, WorkerCode

log = logging.getLogger("cipherlm.workers")


class WorkerError(Exception):
    """Base of the pool's errors."""


class WorkerCrashedError(WorkerError):
    """The worker died while running the task (its state was lost)."""


class WorkerTimeoutError(WorkerError):
    """The task exceeded its timeout; the worker was killed and restarted."""


class TaskError(WorkerError):
    """The task failed inside the worker: ``code`` is its :class:`~server.private.codes.WorkerCode`
    (``INTERNAL`` for any exception that was not a :class:`~server.private.codes.TaskFailure`);
    ``exc_type`` names the exception's class, for the server's log only."""

    def __init__(self, code: str, message: str, exc_type: str = "") -> None:
        super().__init__(message)
        self.code = WorkerCode(code)
        self.exc_type = exc_type


def _worker_main(conn, factory: str, factory_args: tuple) -> None:
    """Worker process: build the state, then serve (method, args) until the pipe closes."""
    module, _, func = factory.partition(":")
    state = getattr(importlib.import_module(module), func)(*factory_args)
    conn.send(("ready", None))
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", getattr(state, method)(*args)))
        except TaskFailure as exc:  # a failure the task names: its code says whose fault it is
            conn.send(("error", (exc.code.value, str(exc), type(exc).__name__)))
        except Exception as exc:  # noqa: BLE001 - anything else is a server bug, whatever its class
            log.debug("task %s failed: %s", method, traceback.format_exc())
            conn.send(("error", (WorkerCode.INTERNAL.value, str(exc)[:200], type(exc).__name__)))


class _Worker:
    """One process and its pipe (blocking calls; used from a thread)."""

    def __init__(self, ctx, factory: str, factory_args: tuple, start_timeout: float) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, factory, factory_args), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(start_timeout):
            self.kill()
            raise WorkerError(f"worker did not start within {start_timeout} s")
        status, _ = self.conn.recv()
        assert status == "ready"

    def call(self, method: str, args: tuple, timeout: float) -> Any:
        try:
            self.conn.send((method, args))
            if not self.conn.poll(timeout):
                self.kill()
                raise WorkerTimeoutError(f"task {method} exceeded {timeout} s; worker restarted")
            status, payload = self.conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError) as exc:
            self.kill()
            raise WorkerCrashedError(f"worker died during {method}; its sessions were lost") from exc
        if status == "error":
            raise TaskError(*payload)
        return payload

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class _Slot:
    """A worker plus its fair queue (per-tenant FIFOs served round-robin)."""

    def __init__(self) -> None:
        self.queues: dict[str, collections.deque] = collections.OrderedDict()
        self.wakeup = asyncio.Event()
        self.worker: _Worker | None = None
        self.pending = 0

    def put(self, tenant: str, item) -> None:
        self.queues.setdefault(tenant, collections.deque()).append(item)
        self.pending += 1
        self.wakeup.set()

    def take(self):
        tenant, q = next(iter(self.queues.items()))
        item = q.popleft()
        del self.queues[tenant]
        if q:
            self.queues[tenant] = q  # back of the rotation
        self.pending -= 1
        return item


class WorkerPool:
    """``size`` worker processes with tenant-fair queues; use from one asyncio event loop."""

    def __init__(self, size: int, factory: str, factory_args: tuple = (), task_timeout: float = 120.0,
                 start_timeout: float = 120.0, on_restart: Callable[[int], None] | None = None) -> None:
        if size < 1:
            raise ValueError("a worker pool needs at least one worker")
        self.size, self.factory, self.factory_args = size, factory, factory_args
        self.task_timeout, self.start_timeout = task_timeout, start_timeout
        self.on_restart = on_restart
        self._ctx = mp.get_context("spawn")
        self._slots = [_Slot() for _ in range(size)]
        self._runners: list[asyncio.Task] = []
        self.restarts = 0

    async def start(self) -> None:
        """Start every worker (in threads: a worker builds its state at start-up)."""
        for i, slot in enumerate(self._slots):
            slot.worker = await asyncio.to_thread(self._spawn)
            self._runners.append(asyncio.create_task(self._run(i), name=f"worker-{i}"))

    def _spawn(self) -> _Worker:
        return _Worker(self._ctx, self.factory, self.factory_args, self.start_timeout)

    def least_loaded(self, among: list[int] | None = None) -> int:
        """Index of the worker with the fewest queued tasks (for pinning a new session), optionally
        among some workers only."""
        return min(among or range(self.size), key=lambda i: self._slots[i].pending)

    async def submit(self, worker: int, tenant: str, method: str, *args, timeout: float | None = None) -> Any:
        """Run ``state.method(*args)`` on worker ``worker``; cancel-safe before the task starts."""
        fut = asyncio.get_running_loop().create_future()
        self._slots[worker].put(tenant, (fut, method, args, timeout or self.task_timeout))
        return await fut

    async def broadcast(self, method: str, *args) -> list[Any]:
        """Run a task on every worker (e.g. dropping a revoked key everywhere)."""
        return await asyncio.gather(*(self.submit(i, "_pool", method, *args) for i in range(self.size)))

    async def _run(self, i: int) -> None:
        slot = self._slots[i]
        while True:
            if not slot.pending:
                slot.wakeup.clear()
                await slot.wakeup.wait()
                continue
            fut, method, args, timeout = slot.take()
            if fut.cancelled():
                continue
            if not slot.worker.proc.is_alive():  # died while idle: its state is gone too
                await self._restart(i)
            try:
                result = await asyncio.to_thread(slot.worker.call, method, args, timeout)
            except (WorkerCrashedError, WorkerTimeoutError) as exc:
                await self._restart(i)
                _settle(fut, exc=exc)
            except TaskError as exc:
                _settle(fut, exc=exc)
            else:
                _settle(fut, result=result)

    async def _restart(self, i: int) -> None:
        self.restarts += 1
        log.warning("worker %d lost; restarting", i)
        self._slots[i].worker = await asyncio.to_thread(self._spawn)
        if self.on_restart:
            self.on_restart(i)

    def kill_worker(self, i: int) -> None:
        """Kill worker ``i``'s process (for tests and for destroying key material held in memory)."""
        self._slots[i].worker.proc.kill()

    async def close(self) -> None:
        """Stop the runners and the processes."""
        for t in self._runners:
            t.cancel()
        await asyncio.gather(*self._runners, return_exceptions=True)
        for slot in self._slots:
            if slot.worker:
                await asyncio.to_thread(slot.worker.kill)
            for q in slot.queues.values():
                for fut, *_ in q:
                    _settle(fut, exc=WorkerError("worker pool closed"))


def _settle(fut: asyncio.Future, result: Any = None, exc: BaseException | None = None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
