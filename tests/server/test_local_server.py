"""A server subprocess started with ``exit_with_parent`` dies with the process that started it, so a
killed test run or demo leaves no server (nor its workers) behind."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

PARENT = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    from server.local_server import exit_with_parent
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL,
                             preexec_fn=exit_with_parent if sys.argv[1] == "1" else None)
    print(child.pid, flush=True)
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)   # the parent dies without cleaning up
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _orphan_after_parent_killed(watch: bool) -> bool:
    out = subprocess.run([sys.executable, "-c", PARENT, "1" if watch else "0"], capture_output=True, text=True,
                         timeout=60, cwd=os.getcwd())
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _alive(pid)
    if alive:
        os.kill(pid, 9)
    return alive


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_child_started_with_exit_with_parent_dies_with_its_parent():
    assert _orphan_after_parent_killed(watch=False)  # without it the child outlives its parent ...
    assert not _orphan_after_parent_killed(watch=True)  # ... with it, it does not
