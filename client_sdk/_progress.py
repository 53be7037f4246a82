"""A tqdm-style progress printer for the private runtime's one-time setup (off unless passed in)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from client_sdk._protocol import Progress


class ProgressPrinter:
    """Callable for ``Client(progress=...)``: one self-overwriting line per stage on ``stream``.

    Byte stages show MB done / total, percent and rate; step stages (key generation) show elapsed time.
    Updates are throttled to ``every_s`` seconds; a stage's last update ends its line.
    """

    def __init__(self, stream: TextIO | None = None, every_s: float = 0.5,
                 clock=time.monotonic) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.every_s, self.clock = every_s, clock
        self._started: dict[str, float] = {}
        self._last = 0.0

    def __call__(self, p: Progress) -> None:
        now = self.clock()
        start = self._started.setdefault(p.stage, now)
        if not p.finished and now - self._last < self.every_s and p.done:
            return
        self._last = now
        elapsed = now - start
        if p.unit == "B":
            total = f" / {p.total / 1e6:.1f} MB" if p.total else " MB"
            pct = f" {100 * p.done / p.total:5.1f}%" if p.total else ""
            rate = f"  {p.done / 1e6 / elapsed:.1f} MB/s" if elapsed > 0 else ""
            line = f"{p.stage}: {p.done / 1e6:.1f}{total}{pct}{rate}  {elapsed:.0f} s"
        else:
            line = f"{p.stage}: {'done' if p.finished else 'running'}  {elapsed:.0f} s"
        self.stream.write("\r" + line.ljust(72) + ("\n" if p.finished else ""))
        self.stream.flush()
        if p.finished:
            self._started.pop(p.stage, None)


def print_progress(p: Progress) -> None:
    """Print setup progress to stderr (``Client(progress=print_progress)``)."""
    _DEFAULT(p)


_DEFAULT = ProgressPrinter()
