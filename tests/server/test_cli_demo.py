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
