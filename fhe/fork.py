"""One layer step on two cores: a forked copy of this process runs part of it (issue 15 item 4).

Why fork: the evaluator, the layer's encoded maps, the session's key set and its KV cache are gigabytes,
and SEAL through ``tenseal.sealapi`` holds the GIL (two threads give no speedup), so the second core
needs a second process that already has all of that. ``os.fork`` gives it for free (copy-on-write: the
pages are shared until one side writes them, and neither writes the shared state), and a fork per step
means there is no second copy of any state to keep in step with the first: the child sees the cache
exactly as it is at the fork and exits when its part is done.

The two sides talk through two pipes, in ciphertexts only (the evaluator's own serialization): the
child's function gets a :class:`Channel` to receive what the parent sends after the fork and to send
its results back. Order is the caller's contract: a side that sends first must have the other side
receiving next (a pipe holds 64 KiB, a ciphertext megabytes), i.e. ``recv`` before ``send`` on the
parent whenever the child is sending. The child runs no torch (an OpenMP pool does not survive fork):
callers compute what needs torch (RoPE's cos/sin) before forking.

A child that raises sends the exception's type and message back (:class:`ForkedStepError` in the
parent); one that dies (a native crash) ends its pipe early, which is the same error. Nothing about a
ciphertext's content is ever in a message.
"""

from __future__ import annotations

import os
import signal
import struct
import sys
from collections.abc import Callable, Sequence

from fhe.errors import FHEError
from fhe.evaluator import Ciphertext, Evaluator

_COUNT = struct.Struct("<i")      # number of ciphertexts in a frame; -1: an error message follows
_LEN = struct.Struct("<q")


class ForkedStepError(FHEError, RuntimeError):
    """The forked half of a step failed or died: the step fails as a whole (the parent's state is intact)."""


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise ForkedStepError("the forked half of the step ended before its answer was complete")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


class Channel:
    """One side's end of the two pipes: send and receive lists of ciphertexts of one evaluator."""

    def __init__(self, ev: Evaluator, rfd: int, wfd: int) -> None:
        self.ev, self.rfd, self.wfd = ev, rfd, wfd

    def send(self, cts: Sequence[Ciphertext]) -> None:
        blobs = [self.ev.serialize(c) for c in cts]
        frame = [_COUNT.pack(len(blobs))] + [_LEN.pack(len(b)) + b for b in blobs]
        _write_all(self.wfd, b"".join(frame))

    def send_error(self, exc: BaseException) -> None:
        msg = f"{type(exc).__name__}: {exc}".encode()[:4096]
        _write_all(self.wfd, _COUNT.pack(-1) + _LEN.pack(len(msg)) + msg)

    def recv(self) -> list[Ciphertext]:
        (count,) = _COUNT.unpack(_read_exact(self.rfd, _COUNT.size))
        if count < 0:
            (n,) = _LEN.unpack(_read_exact(self.rfd, _LEN.size))
            raise ForkedStepError(f"the forked half of the step failed: {_read_exact(self.rfd, n).decode()}")
        out = []
        for _ in range(count):
            (n,) = _LEN.unpack(_read_exact(self.rfd, _LEN.size))
            out.append(self.ev.deserialize(_read_exact(self.rfd, n)))
        return out


class Forked:
    """``with Forked(ev, fn) as ch:`` runs ``fn(channel)`` in a forked child while the body runs here.

    ``fn`` returns a list of ciphertexts (sent back as its last message); ``ch.recv()`` in the parent
    gets every message in order, the last one being that list. Leaving the block reaps the child (killed
    first if the parent leaves early, e.g. on an error of its own half).
    """

    def __init__(self, ev: Evaluator, fn: Callable[[Channel], Sequence[Ciphertext]]) -> None:
        self.ev, self.fn = ev, fn
        self.pid = 0

    def __enter__(self) -> Channel:
        to_child_r, to_child_w = os.pipe()
        to_parent_r, to_parent_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the caller's code
            os.close(to_child_w)
            os.close(to_parent_r)
            _child(Channel(self.ev, to_child_r, to_parent_w), self.fn, parent)
        os.close(to_child_r)
        os.close(to_parent_w)
        self.pid = pid
        self.channel = Channel(self.ev, to_parent_r, to_child_w)
        return self.channel

    def __exit__(self, exc_type, exc, tb) -> None:
        os.close(self.channel.rfd)
        os.close(self.channel.wfd)
        if exc_type is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.waitpid(self.pid, 0)


def _die_with_parent(parent: int) -> None:
    """Linux: the child is killed when the parent dies (a worker killed on its task timeout must not leave
    its half-step running on a core); elsewhere the child ends at its next write into the closed pipe."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)     # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:          # the parent died before prctl took effect
        os._exit(1)


def _child(ch: Channel, fn: Callable[[Channel], Sequence[Ciphertext]], parent: int) -> None:
    code = 0
    try:
        _die_with_parent(parent)
        ch.send(list(fn(ch)))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent, then the child exits
        code = 1
        try:
            ch.send_error(exc)
        except OSError:
            pass
    finally:
        os._exit(code)


def split_ranges(items: Sequence, share: float) -> tuple[list, list]:
    """``items`` cut in two: the first ``round(len * share)`` and the rest."""
    cut = round(len(items) * share)
    return list(items[:cut]), list(items[cut:])


__all__ = ["Channel", "Forked", "ForkedStepError", "split_ranges"]
