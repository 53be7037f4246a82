"""How many CPU threads torch's intra-op (OpenMP) pool gets: the thread policy of every command.

torch's default is one OpenMP thread per logical CPU, and libgomp's threads *spin* while they wait
for work. On a machine that other processes keep busy, that is the worst case: each decode step is
a handful of small parallel regions, and every region waits for the thread the kernel has just
preempted — a 135M-parameter model then decodes ~10x slower with 2 threads than with 1 on a loaded
2-core box. The policy here:

* **threads** = the physical cores this process may use (CPU affinity, cgroup quota, SMT siblings
  counted once) minus the cores other work keeps busy right now, at least 1. "Busy" is the larger of
  the runnable-task count (``/proc/loadavg``, sampled a few times, ourselves excluded) and the
  1-minute load average;
* **OMP_WAIT_POLICY=PASSIVE** (unless already set): idle OpenMP threads sleep instead of spinning,
  so a wrong guess costs a context switch, not a time slice. libgomp reads it once, when torch
  loads it, so :func:`configure` must run before ``import torch``;
* an explicit choice wins: ``--threads N`` on the command line, else ``$CIPHERLM_THREADS``, else
  ``$OMP_NUM_THREADS``.

The choice is made once, when a command (``generate``, ``serve``, ``demo``) starts.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import sys
import time
from pathlib import Path

ENV_THREADS = "CIPHERLM_THREADS"
_SAMPLES = 5          # /proc/loadavg runnable-count samples
_SAMPLE_GAP_S = 0.01  # between samples: 40 ms in all


@dataclasses.dataclass(frozen=True)
class ThreadChoice:
    """The thread count picked and why (printed by the commands, so a user can override it)."""

    threads: int
    reason: str


def parse_threads(value: str) -> int | None:
    """``--threads`` values: ``auto`` (or 0) -> None, else a positive int (ValueError otherwise)."""
    if value.strip().lower() in ("auto", "0", ""):
        return None
    n = int(value)
    if n < 1:
        raise ValueError(f"threads must be a positive integer or 'auto', got {value!r}")
    return n


def usable_cpus() -> int:
    """Logical CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_quota()
    return max(1, min(cpus, quota) if quota else cpus)


def _cgroup_quota() -> int | None:
    try:
        limit, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if limit == "max":
        return None
    return max(1, math.ceil(int(limit) / int(period)))


def smt_siblings() -> int:
    """Hardware threads per physical core (1 when the topology cannot be read)."""
    path = Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list")
    try:
        return max(1, len(_cpu_list(path.read_text())))
    except (OSError, ValueError):
        return 1


def _cpu_list(text: str) -> list[int]:
    """Parse a kernel CPU list such as ``0-3,8``."""
    out: list[int] = []
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def physical_cores() -> int:
    """Physical cores this process may use (SMT siblings counted once), at least 1."""
    return max(1, usable_cpus() // smt_siblings())


def other_load() -> float:
    """How many CPUs other work keeps busy now: max(runnable tasks except us, 1-minute load average)."""
    running = []
    for i in range(_SAMPLES):
        try:
            fields = Path("/proc/loadavg").read_text().split()
        except OSError:
            return 0.0
        running.append(int(fields[3].split("/")[0]) - 1)  # this process is running while it reads
        if i + 1 < _SAMPLES:
            time.sleep(_SAMPLE_GAP_S)
    return max(0.0, float(statistics.median(running)), float(fields[0]))


def pick_threads(cores: int, load: float) -> int:
    """Cores left free by ``load`` busy CPUs (rounded), between 1 and ``cores``."""
    return max(1, min(cores, cores - int(load + 0.5)))


def choose_threads(requested: int | None = None) -> ThreadChoice:
    """The thread count for this process: explicit choice, else the policy of this module's docstring."""
    if requested is not None:
        return ThreadChoice(requested, "--threads")
    for var in (ENV_THREADS, "OMP_NUM_THREADS"):
        value = os.environ.get(var, "").strip()
        if value:
            try:
                n = parse_threads(value)
            except ValueError:
                continue
            if n is not None:
                return ThreadChoice(n, f"${var}")
    cores, load = physical_cores(), other_load()
    return ThreadChoice(pick_threads(cores, load), f"auto: {cores} physical core(s), {load:.1f} busy")


def configure(requested: int | None = None, verbose: bool = False) -> ThreadChoice:
    """Apply the thread policy to this process (and, through the environment, to its children).

    Sets ``OMP_WAIT_POLICY=PASSIVE`` and ``OMP_NUM_THREADS`` unless already set (they only take
    effect when torch has not been imported yet), then ``torch.set_num_threads``.

    Args:
        requested: ``--threads``; None = decide (environment, then load).
        verbose: print the choice to stderr.

    Returns:
        The choice made.
    """
    choice = choose_threads(requested)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if requested is not None or "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(choice.threads)
    import torch

    torch.set_num_threads(choice.threads)
    if verbose:
        print(f"[cipherlm] {choice.threads} CPU thread(s) ({choice.reason}; --threads to override)",
              file=sys.stderr, flush=True)
    return choice
