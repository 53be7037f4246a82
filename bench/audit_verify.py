"""Benchmark: offline verification time of the audit log (``cipherlm audit verify``) by log size.

Builds logs of realistic key-event records (all AU-3 fields set, pseudonymized tenant/actor/request),
signed checkpoints every 1000 records, then times :func:`server.audit.verify_log` (median of
``--repeat`` runs). For scale it also times the floor any verifier pays: reading the file and
SHA-256 over every line. Also reports the writer's append latency with fsync on.

    python bench/audit_verify.py --sizes 10000 100000 --repeat 3
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from server.audit import AuditConfig, AuditLog, CheckpointSigner, Event, Pseudonymizer, verify_log


def build(path: Path, n: int, signer: CheckpointSigner, fsync: bool = False) -> float:
    """Write an ``n``-record log; returns seconds per append."""
    log = AuditLog.open(
        AuditConfig(path, checkpoint_every=1000, fsync=fsync), signer, Pseudonymizer(os.urandom(32))
    )
    events = [Event.KEY_REGISTERED, Event.KEY_ACTIVATED, Event.SESSION_OPENED, Event.SESSION_CLOSED]
    start = time.perf_counter()
    for i in range(n - 1):
        log.append(
            events[i % 4],
            source="server.keys",
            tenant=f"tenant-{i % 17}",
            actor=f"user-{i % 101}",
            key_id=f"k_{i % 97:016x}",
            key_version=1 + i % 3,
            key_fingerprint=hashlib.sha256(b"%d" % i).hexdigest(),
            state_from="pre_active",
            state_to="active",
            request_id=f"req-{i}",
            detail={"reason": "bench"},
        )
    elapsed = time.perf_counter() - start
    log.close()
    return elapsed / max(1, n - 1)


def floor(path: Path) -> None:
    for line in path.read_bytes().split(b"\n"):
        hashlib.sha256(b"\x00" + line).digest()


def timed(fn, repeat: int) -> float:
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--fsync-appends", type=int, default=500, help="records for the fsync append timing")
    args = parser.parse_args()
    signer = CheckpointSigner.generate()
    keys = {signer.key_id: signer.public_key}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            path = Path(tmp) / f"audit-{n}.log"
            build(path, n, signer)
            result = verify_log(path, keys)
            assert result.ok and result.records == n, result
            t_verify = timed(lambda p=path: verify_log(p, keys), args.repeat)
            t_floor = timed(lambda p=path: floor(p), args.repeat)
            rows.append((n, path.stat().st_size, result.checkpoints, t_verify, t_floor))
        per_append = build(Path(tmp) / "fsync.log", args.fsync_appends, signer, fsync=True)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"### Audit log verification ({stamp})\n")
    print(
        f"`python bench/audit_verify.py --sizes {' '.join(map(str, args.sizes))} --repeat {args.repeat}` "
        f"on {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}; median of {args.repeat} runs.\n"
    )
    print("| records | log size | checkpoints | `verify_log` | per record "
          "| floor: read + SHA-256 per line | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n, size, cps, t, f in rows:
        print(f"| {n:,} | {size / 2**20:.1f} MiB | {cps} | {t:.2f} s | {t / n * 1e6:.0f} µs "
              f"| {f:.3f} s | {t / f:.0f}x |")
    print(
        f"\nAppend with fsync (the server's setting): {per_append * 1e3:.2f} ms per record "
        f"({args.fsync_appends} records, checkpoint every 1000)."
    )


if __name__ == "__main__":
    main()
