"""The one table of worker failure codes, shared by the worker processes and the service.

A worker task fails in one of two ways: a :class:`TaskFailure` raised on purpose, whose code says *what*
went wrong (the client's ciphertext did not parse, the worker no longer holds the session, ...), or any
other exception, which is a bug on the server: its code is :attr:`WorkerCode.INTERNAL` whatever its
class (a ``ValueError`` from deep inside the computation is not the client's fault). The service
translates each code to an HTTP error in one place (``server.private.service.task_error``); the table
of what each becomes is in ``docs/protocol.md``.
"""

from __future__ import annotations

import enum


class WorkerCode(str, enum.Enum):
    """Why a worker task failed (the values travel over the worker pipe)."""

    BAD_CIPHERTEXT = "bad_ciphertext"      # the client's ciphertext bytes were refused while parsing them
    SESSION_UNKNOWN = "session_unknown"    # the worker holds no such session (restarted, or dropped it)
    SESSION_DESYNC = "session_desync"      # the worker's cache holds other positions than the service expects
    KEY_NOT_LOADED = "key_not_loaded"      # the worker does not hold the key set a task names
    INTERNAL = "internal"                  # anything else: a bug on the server, never blamed on the client


class TaskFailure(Exception):
    """Raised inside a worker task to report ``code``; the message must hold no secret and no ciphertext.

    Args:
        code: the failure's code.
        message: a short, safe explanation (sent to the client for client faults).
    """

    def __init__(self, code: WorkerCode, message: str) -> None:
        super().__init__(message)
        self.code = WorkerCode(code)


__all__ = ["TaskFailure", "WorkerCode"]
