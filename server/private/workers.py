"""A pool of worker processes for untrusted ciphertext work.

Untrusted key and ciphertext bytes are deserialized and evaluated only inside these processes, so a
crash in native code (SEAL) or a hang kills one worker, never the server. Each worker owns a state
object built from an importable factory (``"package.module:function"``); a task is ``(method, args)``
called on that state. A task that fails reports a code from the one table of
:mod:`server.private.codes` (:class:`TaskError`), never an exception class name.

Process lifecycle, per slot (``size`` slots):

* **Started on demand.** A slot has no process until a task is queued for it (the first key upload or
  session), except the first ``keep_running`` slots, started with the pool and never stopped when idle.
  A worker's state (the model's encrypted layers) costs gigabytes, so an idle server holds none.
* **Stopped when idle.** A worker with no queued task for ``idle_stop_s`` and nothing ``in_use`` (no
  open session pinned to it) is stopped; its state — loaded keys — is gone, and ``on_restart`` says so.
* **Watched.** Each process's sentinel is watched on the event loop, so a worker that dies *between*
  tasks is noticed at once: ``on_restart`` reports its state lost (the service marks its sessions lost),
  and it is replaced now when it held sessions (their clients are about to replay) or is kept running.
* **Tasks are addressed to a process.** A task queued before its worker died fails with
  :class:`WorkerCrashedError` instead of running on the replacement, which never had that state.

Scheduling, per worker: one task at a time; waiting tasks are taken round-robin across tenants
(a tenant with many queued steps cannot starve another); a task cancelled before it starts is dropped.
A task that outlives its timeout, or a worker that dies mid-task, fails that task with a typed error.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import importlib
import logging
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

from server.private.codes import TaskFailure, WorkerCode

log = logging.getLogger("cipherlm.workers")
#: how often an idle slot re-checks its process when no sentinel event arrives (belt and braces)
HEALTH_POLL_S = 5.0


class WorkerError(Exception):
    """Base of the pool's errors."""


class WorkerCrashedError(WorkerError):
    """The worker died while running the task, or before it ran (its state was lost)."""


class WorkerTimeoutError(WorkerError):
    """The task exceeded its timeout; the worker was killed and restarted."""


class WorkerStartError(WorkerCrashedError):
    """A worker process could not be started (its factory failed or did not answer in time).

    A kind of crash for callers: the work did not happen and it is not the client's fault.
    """


class TaskError(WorkerError):
    """The task failed inside the worker: ``code`` is its :class:`~server.private.codes.WorkerCode`
    (``INTERNAL`` for any exception that was not a :class:`~server.private.codes.TaskFailure`);
    ``exc_type`` names the exception's class, for the server's log only."""

    def __init__(self, code: str, message: str, exc_type: str = "") -> None:
        super().__init__(message)
        self.code = WorkerCode(code)
        self.exc_type = exc_type


#: A task argument (or an answer, or an element of a tuple answer) that is a list of byte strings of at least
#: this many bytes in all crosses the pipe raw, after the pickled frame that names it (:class:`_Raw`): a prefill
#: step's ~7 MB of uploads are then neither pickled nor unpickled (three copies, ~8 ms a step on the 2-core box;
#: docs/benchmarks.md, ttft17), and arrive in one buffer the worker reads straight into.
RAW_MIN_BYTES = 1 << 16


class _Raw:
    """In a pickled frame: a list of byte strings of these ``sizes``, sent raw right after the frame."""

    __slots__ = ("sizes",)

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes


def _blob_list(value: Any) -> bool:
    """A list of byte strings to send raw: large ones, and any holding a memoryview (views of a request body,
    which pickle cannot take)."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(b, bytes | bytearray | memoryview) for b in value)
            and (sum(len(b) for b in value) >= RAW_MIN_BYTES or any(isinstance(b, memoryview) for b in value)))


def split_raw(values: tuple) -> tuple[tuple, list]:
    """``values`` with each large list of byte strings replaced by a :class:`_Raw` marker, and those byte strings
    in order (to send with :func:`send_raw` after the frame)."""
    out, raw = [], []
    for v in values:
        if _blob_list(v):
            out.append(_Raw([len(b) for b in v]))
            raw.extend(v)
        else:
            out.append(v)
    return tuple(out), raw


def send_raw(conn, raw: list) -> None:
    """Write byte strings to the connection's socket as they are (the peer's :func:`recv_raw` reads them)."""
    fd = conn.fileno()
    for b in raw:
        view = memoryview(b).cast("B")
        while view:
            view = view[os.write(fd, view):]


def recv_raw(conn, values: tuple) -> tuple:
    """``values`` with each :class:`_Raw` marker replaced by its list of byte strings, read from the connection
    into one buffer (read-only memoryviews of it: no copy after the socket's). EOFError if the peer went away."""
    total = sum(sum(v.sizes) for v in values if isinstance(v, _Raw))
    if not total:
        return values
    buf = memoryview(bytearray(total))
    got, fd = 0, conn.fileno()
    while got < total:
        n = os.readv(fd, [buf[got:]])
        if n == 0:
            raise EOFError("the peer closed the connection inside a raw transfer")
        got += n
    buf, out, at = buf.toreadonly(), [], 0
    for v in values:
        if isinstance(v, _Raw):
            blobs = []
            for n in v.sizes:
                blobs.append(buf[at:at + n])
                at += n
            v = blobs
        out.append(v)
    return tuple(out)


def _send_task_answer(conn, status: str, payload: Any, timing: tuple) -> None:
    """A task's answer: a list of byte strings, or a tuple holding some (a step's results), go raw."""
    raw: list = []
    if status == "ok" and isinstance(payload, list):
        (payload,), raw = split_raw((payload,))
    elif status == "ok" and type(payload) is tuple:   # a plain tuple only (not a NamedTuple)
        payload, raw = split_raw(payload)
    conn.send((status, payload, timing))
    send_raw(conn, raw)


def _recv_task_answer(conn) -> tuple[str, Any, tuple]:
    status, payload, timing = conn.recv()
    if isinstance(payload, _Raw):
        (payload,) = recv_raw(conn, (payload,))
    elif type(payload) is tuple:
        payload = recv_raw(conn, payload)
    return status, payload, timing


def _worker_main(conn, factory: str, factory_args: tuple) -> None:
    """Worker process: build the state, then serve (method, args) until the pipe closes. A state that cannot
    be built is said on the pipe (``("failed", why)``) before the process exits with the exception."""
    try:
        state = build_state(factory, factory_args)
    except BaseException as exc:
        conn.send(("failed", start_failure(exc)))
        raise
    conn.send(("ready", None))
    while True:
        try:
            method, args = conn.recv()
            args = recv_raw(conn, args)
        except EOFError:
            return
        took_in = time.monotonic()   # CLOCK_MONOTONIC: one clock for every process of the machine
        status, payload = run_task(state, method, args)   # a BATCH task answers every item's outcome at once
        _send_task_answer(conn, status, payload, (took_in, take_stages(state), time.monotonic()))


def take_stages(state: Any) -> dict[str, float]:
    """The stage times (seconds) the state's last task noted (``state.take_stages()``; {} where it notes none)."""
    take = getattr(state, "take_stages", None)
    try:
        return dict(take()) if take is not None else {}
    except Exception:  # noqa: BLE001 - timing must never fail a task
        return {}


def note_stages(sink: dict[str, float] | None, sent: float, timing: tuple, back: float) -> None:
    """Split one worker call (sent at ``sent``, answered at ``back``, both ``time.monotonic()``) into the stages of
    ``server.metrics.PRIVATE_STEP_STAGES``, from the worker's ``timing`` ``(took_in, stages, answered)``."""
    if sink is None:
        return
    took_in, stages, answered = timing
    sink["to_worker"] = took_in - sent
    sink.update(stages)
    sink["worker_rest"] = (answered - took_in) - sum(stages.values())
    sink["from_worker"] = back - answered


def start_failure(exc: BaseException) -> str:
    """Why a worker's state could not be built, for the server's log: the exception's class and the start of
    its message (the factory's arguments are paths and settings; no client data exists yet), and what to do
    where the cause is a known one."""
    why = f"{type(exc).__name__}: {str(exc)[:300]}"
    if "OutOfMemoryError" in type(exc).__name__ or "out of memory" in str(exc).lower():
        why += (" — the device is out of memory: a gpu worker holds its plan's encoded weights and key sets "
                "there (~32 GB for the 28-layer offload plan), beside the plaintext engine's [engine] "
                "gpu_memory_utilization share of the card; lower that share or give the workers another device")
    return why


def build_state(factory: str, factory_args: tuple) -> Any:
    """A worker's state from its importable factory ``"package.module:function"``."""
    module, _, func = factory.partition(":")
    return getattr(importlib.import_module(module), func)(*factory_args)


#: the task name of a batch: ``(BATCH, (method, [args, ...]))`` answers one ``run_task`` outcome per item
BATCH = "__batch__"


def run_task(state: Any, method: str, args: tuple) -> tuple[str, Any]:
    """``state.method(*args)`` as ``("ok", result)`` or ``("error", (code, message, class name))``; shared
    by every backend's worker (the process pool here, the Ray actors of :mod:`server.private.ray_backend`).
    A :data:`BATCH` task answers ``("ok", [outcome, ...])`` (:func:`run_batch`)."""
    try:
        if method == BATCH:
            return "ok", run_batch(state, *args)
        return "ok", getattr(state, method)(*args)
    except Exception as exc:  # noqa: BLE001 - classified by _failure
        return _failure(method, exc)


def run_batch(state: Any, method: str, items: list[tuple]) -> list[tuple[str, Any]]:
    """Several calls of ``method`` as one: ``state.<method>_batch(items)`` where the state has it (one result
    or exception per item), else the items one by one; one ``run_task`` outcome per item."""
    batched = getattr(state, method + "_batch", None)
    if batched is None:
        return [run_task(state, method, args) for args in items]
    results = batched(items)
    if len(results) != len(items):
        raise RuntimeError(f"{method}_batch answered {len(results)} results for {len(items)} items")
    return [_failure(method, r) if isinstance(r, Exception) else ("ok", r) for r in results]


def _failure(method: str, exc: Exception) -> tuple[str, Any]:
    if isinstance(exc, TaskFailure):  # a failure the task names: its code says whose fault it is
        return "error", (exc.code.value, str(exc), type(exc).__name__)
    log.debug("task %s failed: %s", method, "".join(traceback.format_exception(exc)))
    return "error", (WorkerCode.INTERNAL.value, str(exc)[:200], type(exc).__name__)  # a server bug


class _Worker:
    """One process and its pipe (blocking calls; used from a thread)."""

    def __init__(self, ctx, factory: str, factory_args: tuple, start_timeout: float) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, factory, factory_args), daemon=True)
        self.proc.start()
        child.close()
        try:
            answer = self.conn.recv() if self.conn.poll(start_timeout) else None
        except (EOFError, OSError):  # the process exited without a word (killed, or a native crash)
            answer = None
        if answer is None or answer[0] != "ready":
            self.kill()
            if answer is not None and answer[0] == "failed":
                raise WorkerStartError(f"worker could not build its state: {answer[1]}")
            raise WorkerStartError(f"worker did not start within {start_timeout} s "
                                   f"(exit code {self.proc.exitcode})")

    def call(self, method: str, args: tuple, timeout: float, stages: dict[str, float] | None = None) -> Any:
        """``state.method(*args)`` in the worker; ``stages``: filled with the call's stage times
        (:func:`note_stages`)."""
        try:
            sent = time.monotonic()
            args, raw = split_raw(args)
            self.conn.send((method, args))
            send_raw(self.conn, raw)
            if not self.conn.poll(timeout):
                self.kill()
                raise WorkerTimeoutError(f"task {method} exceeded {timeout} s; worker restarted")
            status, payload, timing = _recv_task_answer(self.conn)
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError) as exc:
            self.kill()
            raise WorkerCrashedError(f"worker died during {method}; its sessions were lost") from exc
        note_stages(stages, sent, timing, time.monotonic())
        if status == "error":
            raise TaskError(*payload)
        return payload

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class _Slot:
    """A worker (or none, while stopped) plus its fair queue (per-tenant FIFOs served round-robin).

    ``generation`` counts the processes whose state was lost; a queued item remembers the generation it
    was addressed to.
    """

    def __init__(self) -> None:
        self.queues: dict[str, collections.deque] = collections.OrderedDict()
        self.batch_keys: dict[asyncio.Future, Any] = {}   # queued items that may run batched, by future
        self.stage_sinks: dict[asyncio.Future, tuple[dict, float]] = {}   # (stage times to fill, submitted at)
        self.wakeup = asyncio.Event()
        self.worker: _Worker | None = None
        self.pending = 0
        self.generation = 0
        self.last_active = time.monotonic()

    def put(self, tenant: str, item) -> None:
        self.queues.setdefault(tenant, collections.deque()).append((*item, self.generation))
        self.pending += 1
        self.wakeup.set()

    def take(self):
        tenant, q = next(iter(self.queues.items()))
        item = q.popleft()
        del self.queues[tenant]
        if q:
            self.queues[tenant] = q  # back of the rotation
        self.pending -= 1
        self.taken_key = self.batch_keys.pop(item[0], None)
        return item

    def take_group(self, limit: int) -> list:
        """The next item (round-robin, as :meth:`take`) and, if it was submitted with a batch key, the
        queued items of any tenant with the same key and generation, oldest first, up to ``limit`` in all.
        Only what is queued now: no item waits for a batch to fill, and the others keep their place."""
        first = self.take()
        key, group = self.taken_key, [first]
        if key is None or limit <= 1:
            return group
        for tenant in list(self.queues):
            kept = collections.deque()
            for item in self.queues[tenant]:
                if len(group) < limit and self.batch_keys.get(item[0]) == key and item[-1] == first[-1]:
                    del self.batch_keys[item[0]]
                    group.append(item)
                    self.pending -= 1
                else:
                    kept.append(item)
            if kept:
                self.queues[tenant] = kept   # same place in the rotation
            else:
                del self.queues[tenant]
        return group

    def alive(self) -> bool:
        return self.worker is not None and self.worker.proc.is_alive()


class SlotQueues:
    """What both worker backends share: per-slot tenant queues, submission, broadcast and the load measure.

    A subclass sets ``size``, ``task_timeout``, ``_closed`` and ``_slots`` (one :class:`_Slot` each) and
    runs each slot's queue (``_run``): :class:`WorkerPool` in processes, ``ray_backend.RayWorkerPool`` in
    actors.
    """

    size: int
    task_timeout: float
    _closed: bool
    _slots: list

    def pending(self, i: int) -> int:
        """Tasks queued for or running in worker ``i``."""
        return self._slots[i].pending

    def least_loaded(self, among: list[int] | None = None) -> int:
        """Index of the worker with the fewest queued tasks (for pinning a new session), optionally
        among some workers only; on a tie a running worker is preferred (no new process)."""
        return min(among or range(self.size), key=lambda i: (self._slots[i].pending, not self._slots[i].alive()))

    async def submit(self, worker: int, tenant: str, method: str, *args, timeout: float | None = None,
                     batch: Any = None, stages: dict[str, float] | None = None) -> Any:
        """Run ``state.method(*args)`` on worker ``worker`` (starting it if needed); cancel-safe before
        the task starts. ``batch``: a key; tasks with the same key queued together on a worker that batches
        (``batch_limit`` > 1) run as one call (:func:`run_batch`), each still getting its own answer.
        ``stages``: filled with the task's stage times (``server.metrics.PRIVATE_STEP_STAGES``: queue wait,
        transfers, the worker's own split) where the backend measures them (the process pool does)."""
        if self._closed:
            raise WorkerError("worker pool closed")
        fut = asyncio.get_running_loop().create_future()
        slot = self._slots[worker]
        if batch is not None:
            slot.batch_keys[fut] = batch
        if stages is not None:   # the runner takes it when the task starts; gone with the task whatever happens
            slot.stage_sinks[fut] = (stages, time.monotonic())
            fut.add_done_callback(lambda f: slot.stage_sinks.pop(f, None))
        slot.put(tenant, (fut, method, args, timeout or self.task_timeout))
        return await fut

    async def broadcast(self, method: str, *args) -> list[Any]:
        """Run a task on every worker that is up or about to be (e.g. dropping a revoked key everywhere);
        a stopped worker holds no state, so it is not started for this."""
        live = [i for i, slot in enumerate(self._slots) if slot.worker is not None or slot.pending]
        return await asyncio.gather(*(self.submit(i, "_pool", method, *args) for i in live))


class WorkerPool(SlotQueues):
    """Up to ``size`` worker processes with tenant-fair queues; use from one asyncio event loop.

    Args:
        size: slots (most processes at once).
        factory: ``"module:function"`` building a worker's state; ``factory_args`` its arguments.
        task_timeout: default seconds a task may run before its worker is killed.
        start_timeout: seconds a new worker may take to build its state.
        on_restart: told ``i`` whenever worker ``i``'s state is gone (crash, kill, timeout, idle stop).
        keep_running: the first ``keep_running`` slots start with the pool and are never idle-stopped.
        idle_stop_s: stop a worker after this long without tasks (None: never).
        in_use: ``in_use(i)`` is True while worker ``i`` holds state that must not be dropped (sessions).
    """

    def __init__(self, size: int, factory: str, factory_args: tuple = (), task_timeout: float = 120.0,
                 start_timeout: float = 120.0, on_restart: Callable[[int], None] | None = None, *,
                 keep_running: int | None = None, idle_stop_s: float | None = None,
                 in_use: Callable[[int], bool] | None = None, health_poll_s: float = HEALTH_POLL_S) -> None:
        if size < 1:
            raise ValueError("a worker pool needs at least one worker")
        self.size, self.factory, self.factory_args = size, factory, factory_args
        self.task_timeout, self.start_timeout = task_timeout, start_timeout
        self.on_restart = on_restart
        self.keep_running = size if keep_running is None else min(keep_running, size)
        self.idle_stop_s, self.health_poll_s = idle_stop_s, health_poll_s
        self.in_use = in_use or (lambda i: False)
        self._ctx = mp.get_context("spawn")
        self._slots = [_Slot() for _ in range(size)]
        self._runners: list[asyncio.Task] = []
        self.restarts = 0   # processes lost (crash, kill, timeout); idle stops are not counted
        self.started = 0    # processes started
        self._closed = False
        #: most tasks of one batch key run as one call ([private] batch_steps; 1: one task at a time)
        self.batch_limit = 1
        self.batches: collections.Counter = collections.Counter()   # batch size -> calls (metrics, tests)

    async def start(self) -> None:
        """Start the slot runners and the ``keep_running`` workers (in threads: a worker builds its state
        at start-up); the other slots start a process when their first task arrives."""
        for i in range(self.keep_running):
            await self._spawn_into(i)
        self._runners = [asyncio.create_task(self._run(i), name=f"worker-{i}") for i in range(self.size)]

    def running(self) -> list[int]:
        """Indices of the slots whose process is up."""
        return [i for i, slot in enumerate(self._slots) if slot.alive()]

    def pids(self) -> list[int]:
        """Process ids of the running workers (for memory accounting and tests)."""
        return [slot.worker.proc.pid for slot in self._slots if slot.alive()]

    # -- the slot runner -------------------------------------------------------------------------------
    async def _run(self, i: int) -> None:
        slot = self._slots[i]
        while True:
            if not slot.pending:
                await self._idle(i)
                continue
            group = [item for item in slot.take_group(self.batch_limit) if not item[0].cancelled()]
            if not group:
                continue
            if slot.worker is not None and not slot.alive():  # died before this task ran
                await self._lost(i, "died while idle")
            if group[0][-1] != slot.generation:  # addressed to a process whose state is gone (one generation)
                for fut, *_ in group:
                    _settle(fut, exc=WorkerCrashedError("the worker died before the task ran; its sessions were lost"))
                continue
            sinks = [self._queued_for(slot, item[0]) for item in group]
            if len(group) == 1:
                fut, method, args, timeout, _ = group[0]
                await self._execute(i, fut, method, args, timeout, sinks[0])
            else:
                await self._execute_batch(i, group, sinks)

    @staticmethod
    def _queued_for(slot: _Slot, fut: asyncio.Future) -> dict[str, float] | None:
        """The stage sink of a task being started (its queue wait noted), or None."""
        sink = slot.stage_sinks.pop(fut, None)
        if sink is None:
            return None
        stages, submitted = sink
        stages["queue_wait"] = time.monotonic() - submitted
        return stages

    async def _execute(self, i: int, fut: asyncio.Future, method: str, args: tuple, timeout: float,
                       stages: dict[str, float] | None = None) -> None:
        slot = self._slots[i]
        try:
            if slot.worker is None:
                await self._spawn_into(i)
            result = await asyncio.to_thread(slot.worker.call, method, args, timeout, stages)
        except WorkerStartError as exc:  # nothing was running: nothing lost; the next task tries again
            log.error("worker %d could not be started: %s", i, exc)
            _settle(fut, exc=exc)
        except (WorkerCrashedError, WorkerTimeoutError) as exc:
            _settle(fut, exc=exc)  # first: the caller need not wait for the replacement to start
            await self._lost(i, type(exc).__name__)
        except TaskError as exc:
            _settle(fut, exc=exc)
        except Exception as exc:  # noqa: BLE001 - e.g. a task that cannot cross the pipe: the runner must live on
            await self._unexpected(i, [fut], exc)
        else:
            _settle(fut, result=result)
        slot.last_active = time.monotonic()

    async def _unexpected(self, i: int, futs: list, exc: Exception) -> None:
        """A call failed in a way the pipe protocol does not name (a server bug): its tasks fail as a lost
        worker's would, and the process is replaced, since what it read of the call is unknown. Without this
        the worker's runner task would end and every later task of that worker would wait forever."""
        log.error("worker %d: call failed unexpectedly (%s); replacing the worker", i, type(exc).__name__)
        crash = WorkerCrashedError(f"the worker's call failed ({type(exc).__name__}); its sessions were lost")
        for fut in futs:
            _settle(fut, exc=crash)
        await self._lost(i, type(exc).__name__)

    async def _execute_batch(self, i: int, group: list, sinks: list) -> None:
        """Several tasks of one method as one call (:data:`BATCH`); each future gets its own outcome, and a
        lost worker fails them all, as it would one task. Each task's stage times are the batch's."""
        futs, method = [item[0] for item in group], group[0][1]
        items, timeout = [item[2] for item in group], max(item[3] for item in group)
        self.batches[len(group)] += 1
        outcomes, stages = [], {}
        try:
            outcomes = await self._batch_call(i, method, items, timeout, stages)
            for sink in sinks:
                if sink is not None:
                    sink.update(stages)
        except WorkerStartError as exc:
            log.error("worker %d could not be started: %s", i, exc)
            outcomes = [exc] * len(futs)
        except (WorkerCrashedError, WorkerTimeoutError) as exc:
            for fut in futs:
                _settle(fut, exc=exc)
            await self._lost(i, type(exc).__name__)
        except TaskError as exc:   # the batch itself failed (a server bug): every task with it
            outcomes = [exc] * len(futs)
        except Exception as exc:  # noqa: BLE001 - see _unexpected
            await self._unexpected(i, futs, exc)
        for fut, outcome in zip(futs, outcomes, strict=False):
            if isinstance(outcome, BaseException):
                _settle(fut, exc=outcome)
            elif outcome[0] == "error":
                _settle(fut, exc=TaskError(*outcome[1]))
            else:
                _settle(fut, result=outcome[1])
        self._slots[i].last_active = time.monotonic()

    async def _batch_call(self, i: int, method: str, items: list, timeout: float, stages: dict | None = None) -> list:
        slot = self._slots[i]
        if slot.worker is None:
            await self._spawn_into(i)
        # the batch runs what its tasks would one by one: allow each its time (a bound for a hang, not a cost)
        return await asyncio.to_thread(slot.worker.call, BATCH, (method, items), timeout * len(items), stages)

    async def _idle(self, i: int) -> None:
        """Wait for a task; meanwhile notice a dead process and stop one idle past ``idle_stop_s``."""
        slot = self._slots[i]
        slot.wakeup.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(slot.wakeup.wait(), self._idle_wait(i))
        if slot.pending or slot.worker is None:
            return
        if not slot.alive():
            await self._lost(i, "died while idle")
        elif self._idle_expired(i):
            log.info("worker %d idle for %.0f s; stopping it", i, time.monotonic() - slot.last_active)
            worker = self._detach(i)
            if self.on_restart:  # before any await: a session opened meanwhile must not count on its keys
                self.on_restart(i)
            await asyncio.to_thread(worker.kill)

    def _idle_wait(self, i: int) -> float | None:
        """How long an idle runner may sleep: forever without a process, else until the next health
        poll or the idle deadline, whichever comes first."""
        if self._slots[i].worker is None:
            return None
        if self.idle_stop_s is None or i < self.keep_running:
            return self.health_poll_s
        if self.in_use(i):  # look again later: sessions can end without a task (lost, revoked)
            return min(self.health_poll_s, self.idle_stop_s)
        left = self._slots[i].last_active + self.idle_stop_s - time.monotonic()
        return max(0.01, min(self.health_poll_s, left))

    def _idle_expired(self, i: int) -> bool:
        if self.idle_stop_s is None or i < self.keep_running or self.in_use(i):
            return False
        return time.monotonic() - self._slots[i].last_active >= self.idle_stop_s

    # -- process start and loss ----------------------------------------------------------------------------
    async def _spawn_into(self, i: int) -> None:
        slot = self._slots[i]
        worker = await asyncio.to_thread(_Worker, self._ctx, self.factory, self.factory_args, self.start_timeout)
        slot.worker, slot.last_active = worker, time.monotonic()
        self.started += 1
        self._watch(i, worker)

    def _watch(self, i: int, worker: _Worker) -> None:
        """Wake slot ``i``'s runner the moment its process exits (the sentinel turns readable)."""
        loop, fd, wakeup = asyncio.get_running_loop(), worker.proc.sentinel, self._slots[i].wakeup

        def exited() -> None:
            loop.remove_reader(fd)  # level-triggered: once is enough
            wakeup.set()

        with contextlib.suppress(NotImplementedError):  # loops without add_reader: HEALTH_POLL_S polling
            loop.add_reader(fd, exited)

    def _detach(self, i: int) -> _Worker | None:
        """Forget slot ``i``'s process (synchronously: nothing can be queued for it in between); queued
        tasks addressed to it will fail. Returns the process, for the caller to kill."""
        slot = self._slots[i]
        worker, slot.worker = slot.worker, None
        slot.generation += 1
        if worker is not None:
            with contextlib.suppress(NotImplementedError, ValueError, OSError):
                asyncio.get_running_loop().remove_reader(worker.proc.sentinel)
        return worker

    async def _drop(self, i: int) -> None:
        """Detach slot ``i``'s process and kill it if still up."""
        worker = self._detach(i)
        if worker is not None:
            await asyncio.to_thread(worker.kill)

    async def _lost(self, i: int, why: str) -> None:
        """Worker ``i`` died or was killed: report its state lost, replace it now if it held sessions."""
        had_sessions = self.in_use(i)
        worker = self._detach(i)
        self.restarts += 1
        log.warning("worker %d lost (%s)", i, why)
        if self.on_restart:  # before any await, as for an idle stop
            self.on_restart(i)
        if worker is not None:
            await asyncio.to_thread(worker.kill)
        if had_sessions or i < self.keep_running:
            try:
                await self._spawn_into(i)
            except WorkerError as exc:  # the next task tries again
                log.error("worker %d could not be replaced: %s", i, exc)

    def kill_worker(self, i: int) -> None:
        """Kill worker ``i``'s process (for tests and for destroying key material held in memory)."""
        if self._slots[i].worker is not None:
            self._slots[i].worker.proc.kill()

    async def close(self) -> None:
        """Stop the runners and the processes; queued and later tasks fail with :class:`WorkerError`."""
        self._closed = True
        for t in self._runners:
            t.cancel()
        await asyncio.gather(*self._runners, return_exceptions=True)
        for i, slot in enumerate(self._slots):
            await self._drop(i)
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
