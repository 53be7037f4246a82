"""Benchmark: resident memory of an idle ``cipherlm serve`` with the demo settings, per process and summed
over the process tree (psutil), for two source trees in one run — by default the commit before the
on-demand workers (``--before-ref``) and this checkout.

Each server runs as a new user's would: a fresh ``$CIPHERLM_HOME`` (so ``serve`` writes the demo settings:
one plaintext and one encrypted tenant, hence encrypted sessions on the shipped N = 32768 plan), the cached
default model passed with ``--model`` (no second pull). After ``/health/ready`` the script waits
``--settle`` seconds, samples the tree ``--samples`` times one second apart and reports the median.

    python bench/idle_memory.py --before-ref f074207~2
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def extract(ref: str, into: Path) -> Path:
    """The tree of ``ref`` (``git archive``: no worktree, nothing in the repository changes)."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def tree_rss(pid: int) -> dict[str, int]:
    """RSS in bytes of the server and each descendant, by role."""
    main = psutil.Process(pid)
    out = {"main": main.memory_info().rss}
    for i, child in enumerate(main.children(recursive=True)):
        cmd = " ".join(child.cmdline())
        role = "resource tracker" if "resource_tracker" in cmd else "worker" if "spawn_main" in cmd else "other"
        out[f"{role} {i}"] = child.memory_info().rss
    return out


def measure(tree: Path, model: Path, settle: float, samples: int, log: Path) -> dict[str, int]:
    """Start ``cipherlm serve`` from ``tree``, wait until ready and idle, return median RSS by process."""
    from server.local_server import exit_with_parent, free_port, wait_ready

    home = Path(tempfile.mkdtemp(prefix="cipherlm-idle-"))
    port = free_port()
    env = dict(os.environ, CIPHERLM_HOME=str(home), PYTHONUNBUFFERED="1", PYTHONPATH=str(tree))
    env.pop("CIPHERLM_CONFIG", None)
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--model", str(model),
                                 "--port", str(port), "--log-level", "warning"], cwd=tree, env=env,
                                stdout=fh, stderr=subprocess.STDOUT, preexec_fn=exit_with_parent)
        try:
            wait_ready(proc, f"http://127.0.0.1:{port}", 900, log, poll_s=1.0)
            time.sleep(settle)
            runs = []
            for _ in range(samples):
                runs.append(tree_rss(proc.pid))
                time.sleep(1.0)
        finally:
            proc.terminate()
            proc.wait(120)
    return {k: int(statistics.median(r.get(k, 0) for r in runs)) for k in runs[-1]}


def report(name: str, rss: dict[str, int]) -> str:
    parts = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in rss.items())
    return f"| {name} | {sum(rss.values()) / 1e9:.2f} | {parts} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before-ref", required=True, help="git ref of the 'before' tree")
    ap.add_argument("--settle", type=float, default=20.0, help="seconds idle after ready before sampling")
    ap.add_argument("--samples", type=int, default=5)
    args = ap.parse_args()
    from engine.default_model import default_model_dir

    model = default_model_dir()
    scratch = Path(tempfile.mkdtemp(prefix="cipherlm-idle-trees-"))
    trees = {f"before ({args.before_ref})": extract(args.before_ref, scratch / "before"), "after (this tree)": ROOT}
    print(f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} CPUs, "
          f"{psutil.virtual_memory().total / 2**30:.0f} GiB; idle `cipherlm serve`, demo settings, "
          f"settle {args.settle:.0f} s, median of {args.samples} samples (GB = 1e9 bytes)")
    print("| tree | RSS sum (GB) | by process (GB) |\n|---|---|---|")
    for name, tree in trees.items():
        print(report(name, measure(tree, model, args.settle, args.samples, scratch / f"{tree.name}.log")),
              flush=True)


if __name__ == "__main__":
    main()
