"""torch's intra-op threads while the SDK runs a decode step's clear layers and head.

A decode token's clear work is ~600 small torch ops (26 clear attention layers, 30 MLPs, one row each). torch
starts with one OpenMP thread per logical CPU, and every op is a parallel region that waits for all of them: on a
machine where other processes keep cores busy (the server on the same host, other work), each region waits for
a preempted thread's time slice. On this project's 2-core box with one core busy, a token's clear forward of
SmolLM2-135M took 1.0-1.6 s with torch's 2 threads and 56 ms with 1 (``bench/client_token_cpu.py``,
docs/benchmarks.md). The cipherlm commands apply :mod:`engine.threads`' policy to their process at start; the SDK
is a library inside someone else's process, so it applies the same policy only **around its own torch work of one
row** (each decode step's forward and head, in the thread that runs it) and restores the caller's setting after.
Prefills and speculative verify steps (several rows) keep the caller's setting: see :meth:`ThreadScope.applied`.
So does the sampler: a reduction over one 49152-wide row of logits may be split over threads (torch's grain is
32768 elements), and it costs little.

The count is chosen once per generation (:meth:`ThreadScope.choose`): an explicit ``PrivateRuntime.threads``,
else ``$CIPHERLM_THREADS`` / ``$OMP_NUM_THREADS``, else the physical cores minus the ones other work keeps busy
(:func:`engine.threads.choose_threads`). The thread count does not change the results of one-row work (each output
element is reduced by one thread; ``tests/client_sdk/test_threads.py`` checks a decode step's logits bit for bit).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class ThreadScope:
    """The intra-op thread count of one generation's torch work, applied in :meth:`applied` blocks."""

    def __init__(self) -> None:
        #: the count chosen for the current generation (None: leave torch's setting alone)
        self.count: int | None = None
        self.reason = ""

    def choose(self, requested: int | None = None) -> int:
        """Pick the count for the next generation (``requested``: an explicit count; None: the policy)."""
        from engine.threads import choose_threads

        if requested is not None and requested < 1:
            raise ValueError(f"threads must be a positive integer or None, got {requested!r}")
        choice = choose_threads(requested)
        self.count, self.reason = choice.threads, choice.reason
        return choice.threads

    @contextlib.contextmanager
    def applied(self, rows: int = 1) -> Iterator[None]:
        """torch's intra-op threads set to :attr:`count` in this thread for a block of work on ``rows`` rows (token
        positions), then restored. Only single-row work is moved: a product of one row gives the same bits for
        every thread count, one of several rows may not (MKL's sgemm of 6 rows by 576 x 576 differed by 2e-6
        between 1 and 2 threads), so a prefill or a verify step keeps the caller's setting and the outputs do
        not depend on the count chosen."""
        before = torch.get_num_threads()
        if self.count is None or self.count == before or rows != 1:
            yield
            return
        torch.set_num_threads(self.count)
        try:
            yield
        finally:
            torch.set_num_threads(before)


def threads_of(runtime: object, rows: int) -> contextlib.AbstractContextManager:
    """``runtime.thread_scope.applied(rows)``, or nothing for an object without a scope (a bare stand-in)."""
    scope = getattr(runtime, "thread_scope", None)
    return scope.applied(rows) if scope is not None else contextlib.nullcontext()
