"""A ``cipherlm serve`` subprocess on loopback: a free port, the readiness poll, the stop.

Shared by ``cipherlm demo`` (:mod:`server.cli_demo`), the benchmarks and the tests that start a real
server process, so that there is one readiness poll (not one per caller) and none of them imports the
demo's CLI module for it. Nothing here imports ``client_sdk``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_with_parent() -> None:
    """``preexec_fn`` for a server subprocess: it gets SIGTERM when the process that started it dies
    (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing), so a killed test run, benchmark or demo leaves no
    server — and none of its GB-sized workers, which follow the server — behind."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float, log_path: Path | None = None,
               poll_s: float = 1.0) -> None:
    """Poll ``url``/health/ready until 200; RuntimeError (with the log's tail, when there is a log) if
    the server process exits or is not ready in time."""
    import httpx

    def tail() -> str:
        return "" if log_path is None else ":\n" + log_path.read_text(errors="replace")[-3000:]

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}{tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health/ready", timeout=2).status_code == 200:
                return
        time.sleep(poll_s)
    raise RuntimeError(f"the server was not ready after {timeout_s:.0f} s{tail()}")


def stop_server(proc: subprocess.Popen, timeout_s: float = 60.0) -> int:
    """SIGTERM (the server drains and stops its workers); SIGKILL the group if it does not exit in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode



__all__ = ["exit_with_parent", "free_port", "stop_server", "wait_ready"]
