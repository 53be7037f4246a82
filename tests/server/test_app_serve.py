"""`cipherlm serve` as a process: zero-config first run (demo settings, keys shown once) and SIGTERM draining."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx

from server.local_server import exit_with_parent
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
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            preexec_fn=exit_with_parent)
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
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            preexec_fn=exit_with_parent)
    try:
        first = proc.stdout.readline()
        while first.startswith("[cipherlm]"):  # the thread-count notice (engine.threads) may come first
            first = proc.stdout.readline()
        assert "settings" in first and "wrote demo" not in first and "clm-" not in first
    finally:
        proc.kill()
        proc.wait()


def test_sigterm_drains_in_flight_requests(tiny_model_dir, tmp_path):  # noqa: F811
    port = free_port()
    server = LiveServer(write_settings_toml(tmp_path / "s.toml", tiny_model_dir, port, drain_timeout_s=60),
                        port, tmp_path / "log").start()
    headers = {"Authorization": f"Bearer {KEYS['plain']}"}
    got, reader = _stream_started(server.url, 1500, headers)
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


def test_sigterm_cuts_a_long_stream_with_an_error_and_exits_inside_the_window(tiny_model_dir, tmp_path):  # noqa: F811
    """The documented grace period holds: new encrypted sessions are refused while draining, a stream still
    running at the end of ``drain_timeout_s`` ends with an error event, and the process has exited — its
    final signed audit checkpoint written — within the window plus a small slack."""
    from server.cli import main as cli_main
    from tests.server.private_helpers import tiny_plan

    drain, slack = 2.0, 4.0
    plan = tiny_plan(tiny_model_dir, tmp_path / "tiny.plan.json")
    state = tmp_path / "state"
    extra = f'[private]\nenabled = true\nplan = "{plan}"\nstate_dir = "{state}"\naudit_checkpoint_every = 1000\n'
    port = free_port()
    server = LiveServer(write_settings_toml(tmp_path / "s.toml", tiny_model_dir, port, drain_timeout_s=drain,
                                            extra=extra), port, tmp_path / "log").start()
    enc = {"Authorization": f"Bearer {KEYS['enc']}"}
    assert httpx.get(server.url + "/v1/private/manifest", headers=enc).status_code == 200
    got, reader = _stream_started(server.url, 4000, {"Authorization": f"Bearer {KEYS['plain']}"})
    whole, waiter = _full_started(server.url, 4000, {"Authorization": f"Bearer {KEYS['plain']}"})
    sent = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    try:
        opened = httpx.post(server.url + "/v1/private/sessions", headers=enc, timeout=5,
                            json={"key_id": "k1", "plan_hash": "0" * 64})
    finally:
        reader.join(60)
        waiter.join(60)
    code = server.proc.wait(drain + slack + 30)
    elapsed = time.monotonic() - sent
    assert opened.status_code == 503 and opened.json()["error"]["code"] == "server_draining"
    assert opened.headers["Retry-After"] == "1"
    events = [x for x in got["lines"] if x.startswith("data: ")]
    assert "data: [DONE]" not in events and "server_shutdown" in events[-1], events[-3:]
    cut = whole["response"]  # a non-streamed request cut at the window's end gets a 503 with a body too
    assert cut.status_code == 503 and cut.json()["error"]["code"] == "server_shutdown", cut.text[:300]
    assert code == 0 and elapsed <= drain + slack, f"exited {elapsed:.1f} s after SIGTERM (window {drain} s)"
    log = state / "audit" / "audit.log"
    records = len(log.read_bytes().splitlines())
    last = json.loads((log.parent / "audit.log.checkpoints").read_bytes().splitlines()[-1])
    assert last["size"] == records >= 1, (last, records)   # the final checkpoint covers every record
    assert cli_main(["audit", "verify", str(log), "--pubkey", str(state / "audit-signing" / "public")]) == 0
    server.stop()


def _full_started(url: str, max_tokens: int, headers: dict) -> tuple[dict, threading.Thread]:
    """A long non-streamed completion on a thread; returns once the server counts it in flight."""
    got: dict = {}
    body = {"prompt": "Keep going", "max_tokens": max_tokens, "ignore_eos": True}

    def call():
        got["response"] = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)

    waiter = threading.Thread(target=call)
    waiter.start()
    time.sleep(0.5)
    return got, waiter


def _stream_started(url: str, max_tokens: int, headers: dict) -> tuple[dict, threading.Thread]:
    """A long streamed completion read on a thread; returns once its first lines have arrived."""
    got: dict = {"lines": []}
    body = {"prompt": "Keep going", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}

    def consume():
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=120) as r:
            for line in r.iter_lines():
                got["lines"].append(line)

    reader = threading.Thread(target=consume)
    reader.start()
    while len(got["lines"]) < 3:
        time.sleep(0.02)
    return got, reader
