"""torch's intra-op threads while the SDK runs a decode step's clear layers and head.

A decode token's clear work is ~600 small torch ops (26 clear attention layers, 30 MLPs, one row each). torch
starts with one OpenMP thread per logical CPU, and every op is a parallel region that waits for all of them: on a
machine where other processes keep cores busy (the server on the same host, other work), each region waits for
a preempted thread's time slice. On this project's 2-core box with one core busy, a token's clear forward of
SmolLM2-135M took 1.0-1.6 s with torch's 2 threads and 56-60 ms with 1, while on the idle box 2 threads took
38 ms (``bench/client_token_cpu.py``, docs/benchmarks.md). The cipherlm commands apply :mod:`engine.threads`'
policy to their process at start; the SDK is a library inside someone else's process, so it applies a count only
**around its own torch work of one row** (each decode step's forward and head, in the thread that runs it) and
restores the caller's setting after. Prefills and speculative verify steps (several rows) keep the caller's
setting: see :meth:`ThreadScope.applied`. So does the sampler: a reduction over one 49152-wide row of logits may
be split over threads (torch's grain is 32768 elements), and it costs little.

The count (:meth:`ThreadScope.choose`): an explicit ``PrivateRuntime.threads``, else ``$CIPHERLM_THREADS`` /
``$OMP_NUM_THREADS``, else, at the start of each decode step and after each of its server steps
(:meth:`ThreadScope.refresh`), the physical cores minus the tasks running elsewhere at that moment
(:func:`engine.threads.pick_threads` of one ``/proc/loadavg`` read, not the 1-minute average, which lags).
The thread count does not change the results of one-row work (each output element is reduced by one thread;
``tests/client_sdk/test_threads.py`` checks a decode step's logits bit for bit).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch


def running_others() -> int:
    """Runnable tasks of other processes on this machine now (``/proc/loadavg``'s running count less this
    process's running threads: its own OpenMP threads still spin for a moment after a parallel region; 0 where
    ``/proc`` is absent). A few reads, well under a millisecond, so it can be asked at every decode step."""
    try:
        with open("/proc/loadavg") as fh:
            running = int(fh.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return 0
    return max(0, running - _own_running())


def _own_running() -> int:
    """This process's threads in state R (the caller's included)."""
    count = 0
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return 1
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue   # the thread ended meanwhile
        count += stat[stat.rindex(")") + 2:].startswith("R")
    return max(1, count)


class ThreadScope:
    """The intra-op thread count of a generation's one-row torch work, applied in :meth:`applied` blocks."""

    def __init__(self) -> None:
        #: an explicit count for every step (``PrivateRuntime.threads``, ``$CIPHERLM_THREADS``, ``$OMP_NUM_THREADS``)
        self.fixed: int | None = None
        #: the physical cores a step may use when no count is fixed; None: nothing chosen (torch left alone)
        self.cores: int | None = None
        #: the count of the last step that ran under the scope (the benchmarks read it)
        self.count: int | None = None
        self.reason = ""

    def choose(self, requested: int | None = None) -> None:
        """Set the policy of the next generation: ``requested`` (an explicit count), else the environment's
        count, else per step the physical cores minus the tasks running elsewhere at that moment.

        Per step rather than once: the 1-minute load average lags (a server that was busy until its answer, a
        benchmark that just ended) and the SDK's steps come between the server's, when the machine may be free:
        on the 2-core box, idle, a decode token's clear layers took 38 ms on 2 threads and 60 ms on 1."""
        from engine.threads import ENV_THREADS, parse_threads, physical_cores

        if requested is not None and requested < 1:
            raise ValueError(f"threads must be a positive integer or None, got {requested!r}")
        self.fixed, self.reason = requested, "PrivateRuntime.threads"
        for var in (ENV_THREADS, "OMP_NUM_THREADS"):
            if self.fixed is not None:
                break
            try:
                self.fixed, self.reason = parse_threads(os.environ.get(var, "auto")), f"${var}"
            except ValueError:
                continue
        if self.fixed is None:
            self.cores, self.reason = physical_cores(), "per step: physical cores minus running tasks"

    def step_count(self) -> int | None:
        """The count for a step starting now (None: leave torch's setting)."""
        if self.fixed is not None:
            return self.fixed
        if self.cores is None:
            return None
        from engine.threads import pick_threads

        return pick_threads(self.cores, running_others())

    @contextlib.contextmanager
    def applied(self, rows: int = 1) -> Iterator[None]:
        """torch's intra-op threads set to :meth:`step_count` in this thread for a block of work on ``rows`` rows
        (token positions), then restored. Only single-row work is moved: a product of one row gives the same bits
        for every thread count, one of several rows may not (MKL's sgemm of 6 rows by 576 x 576 differed by 2e-6
        between 1 and 2 threads), so a prefill or a verify step keeps the caller's setting and the outputs do
        not depend on the count chosen."""
        before = torch.get_num_threads()
        count = self.step_count() if rows == 1 else None
        self.count = count if count is not None else before
        if count is None:
            yield
            return
        self._active = True
        _set(count)
        try:
            yield
        finally:
            self._active = False
            _set(before)

    def refresh(self) -> None:
        """Inside an :meth:`applied` block of one row, pick the count again: after a server step, whose seconds
        may have changed what else runs on this machine (other work starting or ending)."""
        if getattr(self, "_active", False):
            count = self.step_count()
            if count is not None:
                self.count = count
                _set(count)


def _set(count: int) -> None:
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)


def threads_of(runtime: object, rows: int) -> contextlib.AbstractContextManager:
    """``runtime.thread_scope.applied(rows)``, or nothing for an object without a scope (a bare stand-in)."""
    scope = getattr(runtime, "thread_scope", None)
    return scope.applied(rows) if scope is not None else contextlib.nullcontext()


def refresh(runtime: object) -> None:
    """``runtime.thread_scope.refresh()``, or nothing for an object without a scope."""
    scope = getattr(runtime, "thread_scope", None)
    if scope is not None:
        scope.refresh()
