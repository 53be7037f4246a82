"""`cipherlm serve` as a process: zero-config first run (demo settings, keys shown once) and SIGTERM draining."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx

from tests.server.app_helpers import (  # noqa: F401 (fixtures)
    KEYS,
    LiveServer,
    free_port,
    tiny_model_dir,
    wait_ready,
    write_settings_toml,
)


def test_zero_config_first_run_writes_demo_settings(tiny_model_dir, tmp_path):  # noqa: F811
    port = free_port()
    env = dict(os.environ, CIPHERLM_HOME=str(tmp_path), PYTHONUNBUFFERED="1")
    env.pop("CIPHERLM_CONFIG", None)
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(tiny_model_dir), "--port", str(port),
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = [proc.stdout.readline() for _ in range(5)]
        out = "".join(lines)
        path = tmp_path / "server" / "settings.toml"
        assert f"wrote demo settings to {path}" in out
        keys = dict(re.findall(r"^\s+(demo-\S+)\s+(clm-\S+)$", out, re.M))
        assert set(keys) == {"demo-plaintext", "demo-encrypted"}
        text = path.read_text()
        assert all(k not in text for k in keys.values()) and text.count("sha256:") == 2
        assert (path.stat().st_mode & 0o777) == 0o600
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url, 180, poll_s=0.3)
        me = httpx.get(url + "/v1/tenant", headers={"Authorization": f"Bearer {keys['demo-encrypted']}"}).json()
        assert me["privacy_mode"] == "encrypted"
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       headers={"Authorization": f"Bearer {keys['demo-plaintext']}"})
        assert r.status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    # second run: the file exists, keys are not shown again
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        head = [proc.stdout.readline() for _ in range(2)]   # the thread-policy line, then the settings line
        assert any("settings" in line for line in head)
        assert not any("wrote demo" in line or "clm-" in line for line in head)
    finally:
        proc.kill()
        proc.wait()


def test_sigterm_drains_in_flight_requests(tiny_model_dir, tmp_path):  # noqa: F811
    port = free_port()
    server = LiveServer(write_settings_toml(tmp_path / "s.toml", tiny_model_dir, port, drain_timeout_s=60),
                        port, tmp_path / "log").start()
    headers = {"Authorization": f"Bearer {KEYS['plain']}"}
    body = {"prompt": "Keep going", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    got: dict = {"lines": []}

    def consume():
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers, timeout=120) as r:
            for line in r.iter_lines():
                got["lines"].append(line)

    reader = threading.Thread(target=consume)
    reader.start()
    while len(got["lines"]) < 3:
        time.sleep(0.02)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    try:
        ready = httpx.get(server.url + "/health/ready", timeout=5)
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, headers=headers, timeout=5)
    finally:
        reader.join(120)
    assert ready.status_code == 503 and ready.json()["status"] == "draining"
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert got["lines"][-2] == "data: [DONE]" or got["lines"][-1] == "data: [DONE]"  # finished, not cut
    assert server.proc.wait(60) == 0
    server.stop()
