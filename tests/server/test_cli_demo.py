"""``cipherlm demo`` end to end: a real server subprocess, a plaintext and an encrypted answer, clean stop."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.demo]


def test_demo_answers_with_both_tenants(default_model_dir):
    proc = subprocess.run([sys.executable, "-m", "server.cli", "demo", "--layers", "1", "--max-tokens", "2"],
                          capture_output=True, text=True, timeout=1500)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    plain, _, enc = out.partition("== encrypted tenant")
    assert "== plaintext tenant" in plain
    answers = re.findall(r"answer: .*?\u2192'(.*)'", out)
    assert len(answers) == 2 and all(a.strip() for a in answers), out
    # the encrypted half reports its one-time costs and, per token, the bytes on the wire
    assert re.search(r"bundle [\d.]+ MB downloaded and SHA-256 verified", enc), enc
    assert re.search(r"public evaluation keys registered \([\d.]+ MB uploaded\)", enc), enc
    token_lines = re.findall(r"token +\d+ .* up +([\d.]+) (?:MB|kB) +down +([\d.]+) (?:MB|kB)", enc)
    assert len(token_lines) == 2 and all(float(u) > 0 and float(d) > 0 for u, d in token_lines), enc
    assert "server stopped (exit status 0)" in out
    state = re.search(r"state in (\S+)\)", out).group(1)
    assert not Path(state).exists(), "the demo left its temporary state behind"


def test_sigterm_stops_the_server_it_started(default_model_dir, tmp_path):
    """``running_server`` starts the server in its own session: a SIGTERM to the bench or demo process must
    still stop the server and its workers, not leave them holding their memory."""
    import signal

    import psutil

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
