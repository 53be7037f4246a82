"""Worker states for the pool tests (imported by name inside spawned workers)."""

from __future__ import annotations

import ctypes
import os
import time


class ProbeState:
    """Tasks that behave well, raise, hang, or crash the process natively."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.calls = 0

    def echo(self, x):
        self.calls += 1
        return (self.tag, x, self.calls)

    def pid(self) -> int:
        return os.getpid()

    def sleep(self, seconds: float, label: str) -> str:
        time.sleep(seconds)
        return label

    def fail(self, message: str) -> None:
        raise ValueError(message)

    def refuse(self, code: str, message: str) -> None:
        from server.private.codes import TaskFailure, WorkerCode

        raise TaskFailure(WorkerCode(code), message)

    def scale(self, x: int, factor: int | None) -> int:
        if factor is None:
            raise ValueError("no factor")
        return x * factor

    def scale_batch(self, items: list[tuple]) -> list:
        """``scale`` for several items in one call (results or exceptions, one per item), recorded."""
        self.batches = getattr(self, "batches", []) + [len(items)]
        out = []
        for x, factor in items:
            try:
                out.append(self.scale(x, factor))
            except ValueError as exc:
                out.append(exc)
        return out

    def batch_sizes(self) -> list[int]:
        return getattr(self, "batches", [])

    def segfault(self) -> None:
        ctypes.string_at(0)  # a real native crash, like a bad pointer in SEAL


def make_probe(tag: str) -> ProbeState:
    return ProbeState(tag)


def make_broken() -> ProbeState:
    raise RuntimeError("this worker state cannot be built (e.g. the plan does not load)")
