"""The thread policy (engine.threads): explicit choices win, load reduces the count, OpenMP waits passively."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine import threads


@pytest.mark.parametrize(("cores", "load", "expected"), [
    (2, 0.0, 2), (2, 0.4, 2), (2, 0.6, 1), (2, 2.0, 1), (2, 9.0, 1), (8, 3.0, 5), (1, 0.0, 1),
])
def test_pick_threads_leaves_busy_cores_alone(cores, load, expected):
    assert threads.pick_threads(cores, load) == expected


def test_parse_threads():
    assert threads.parse_threads("auto") is None and threads.parse_threads("0") is None
    assert threads.parse_threads("3") == 3
    for bad in ("-1", "two"):
        with pytest.raises(ValueError):
            threads.parse_threads(bad)


def test_explicit_choice_wins(monkeypatch):
    monkeypatch.setenv("CIPHERLM_THREADS", "3")
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert threads.choose_threads(2) == threads.ThreadChoice(2, "--threads")
    assert threads.choose_threads().threads == 3
    monkeypatch.delenv("CIPHERLM_THREADS")
    assert threads.choose_threads().threads == 5


def test_loaded_machine_gets_fewer_threads(monkeypatch):
    """A 2-core machine with both cores busy gets 1 thread (torch's default would be 2 spinning ones)."""
    for var in ("CIPHERLM_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(threads, "physical_cores", lambda: 2)
    monkeypatch.setattr(threads, "other_load", lambda: 2.0)
    assert threads.choose_threads().threads == 1
    monkeypatch.setattr(threads, "other_load", lambda: 0.0)
    assert threads.choose_threads().threads == 2


def test_other_load_sees_busy_processes():
    """Two spinning processes are visible in the runnable count at once (no waiting for loadavg)."""
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        assert threads.other_load() >= 1.0
    finally:
        for p in spin:
            p.kill()
            p.wait()


def test_physical_cores_within_affinity():
    assert 1 <= threads.physical_cores() <= len(os.sched_getaffinity(0))


def test_configure_before_torch_sets_openmp_environment():
    """In a fresh process (torch not yet imported) the policy reaches OpenMP and torch."""
    code = ("import json, os; from engine.threads import configure; c = configure(1); import torch; "
            "print(json.dumps([c.threads, torch.get_num_threads(), os.environ['OMP_WAIT_POLICY'], "
            "os.environ['OMP_NUM_THREADS']]))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert json.loads(out.stdout) == [1, 1, "PASSIVE", "1"]
