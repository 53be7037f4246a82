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

    def segfault(self) -> None:
        ctypes.string_at(0)  # a real native crash, like a bad pointer in SEAL


def make_probe(tag: str) -> ProbeState:
    return ProbeState(tag)
