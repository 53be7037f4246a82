"""``server.cli_demo.running_server`` (used by ``cipherlm demo`` and ``bench/private_e2e.py``): the server it
starts lives in its own session, so stopping it is its job."""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.model]


def test_sigterm_stops_the_server_it_started(default_model_dir, tmp_path):
    """``running_server`` starts the server in its own session: a SIGTERM to the bench or demo process must
    still stop the server and its workers, not leave them holding their memory."""
    script = (f"import sys, time\nfrom pathlib import Path\nfrom server.cli_demo import plan_with_layers, "
              f"running_server\nroot = Path({str(tmp_path)!r})\n"
              "with running_server(root, None, plan_with_layers('1', root), 1) as s:\n"
              "    print(s.proc.pid, flush=True)\n    time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        server = psutil.Process(int(proc.stdout.readline()))
        family = [server, *server.children(recursive=True)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 128 + signal.SIGTERM
        gone, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, f"still running after SIGTERM: {alive}"
    finally:
        proc.kill()
