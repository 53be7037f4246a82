"""Auditor views of a log: per-tenant/per-key lifecycle report, and export of a time range.

Both read records as stored (pseudonymous tenant/actor); run :func:`verify_log` first, the CLI does
when given ``--pubkey``. Nothing here needs a secret.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ._record import Event, Outcome, format_time
from ._verify import read_log_lines

__all__ = ["build_report", "export_records", "iter_records", "render_report"]

_COUNTED = {
    "refused_secret_key_uploads": lambda r: (
        r["event"] == Event.KEY_UPLOAD_REFUSED and r["detail"].get("reason") == "secret_key_present"
    ),
    "refused_other_uploads": lambda r: (
        r["event"] == Event.KEY_UPLOAD_REFUSED and r["detail"].get("reason") != "secret_key_present"
    ),
    "plaintext_fallbacks": lambda r: r["event"] == Event.PLAINTEXT_FALLBACK,
    "refused_key_uses": lambda r: r["event"] == Event.KEY_USE_REFUSED,
    "key_integrity_failures": lambda r: r["event"] == Event.KEY_INTEGRITY_FAILURE,
    "sessions_opened": lambda r: r["event"] == Event.SESSION_OPENED,
    "privacy_mode_changes": lambda r: r["event"] == Event.PRIVACY_MODE_CHANGED,
}


def iter_records(log_path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Records of a log file, parsed (a torn last line is skipped)."""
    lines, _torn = read_log_lines(Path(log_path))
    for line in lines:
        yield json.loads(line)


def _lifecycle_entry(r: dict[str, Any]) -> dict[str, Any]:
    return {
        "seq": r["seq"],
        "time": r["time"],
        "event": r["event"],
        "outcome": r["outcome"],
        "version": r["key_version"],
        "from": r["state_from"],
        "to": r["state_to"],
        "actor": r["actor"],
        "request_id": r["request_id"],
        "fingerprint": r["key_fingerprint"],
        "detail": r["detail"],
    }


def build_report(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Per tenant: counts of notable events and, per key id, its full lifecycle in order.

    Returns:
        ``{"tenants": {tenant: {"counts": {...}, "actors": {actor: n}, "keys": {key_id: {
        "versions": {version: {"fingerprint", "state", "events": [...]}}}}}}, "records": n,
        "first_time", "last_time"}``.
    """
    tenants: dict[str, dict[str, Any]] = {}
    n, first, last = 0, None, None
    for r in records:
        n, first, last = n + 1, first or r["time"], r["time"]
        if r["tenant"] is None and r["key_id"] is None:
            continue  # log housekeeping (creation, open, signing key rotation)
        t = tenants.setdefault(r["tenant"] or "-", {"counts": Counter(), "actors": Counter(), "keys": {}})
        for name, match in _COUNTED.items():
            t["counts"][name] += int(bool(match(r)))
        if r["actor"]:
            t["actors"][r["actor"]] += 1
        if r["key_id"] is not None:
            _add_key_event(t["keys"].setdefault(r["key_id"], {"versions": {}}), r)
    for t in tenants.values():
        t["counts"], t["actors"] = dict(t["counts"]), dict(t["actors"])
    return {"records": n, "first_time": first, "last_time": last, "tenants": tenants}


def _add_key_event(key: dict[str, Any], r: dict[str, Any]) -> None:
    version = str(r["key_version"]) if r["key_version"] is not None else "-"
    v = key["versions"].setdefault(version, {"fingerprint": None, "state": None, "events": []})
    v["events"].append(_lifecycle_entry(r))
    v["fingerprint"] = v["fingerprint"] or r["key_fingerprint"]
    if r["state_to"] is not None and r["outcome"] == Outcome.SUCCESS:
        v["state"] = r["state_to"]


def render_report(report: dict[str, Any]) -> str:
    """Markdown rendering of :func:`build_report` for a human auditor."""
    out = [
        f"# Audit report: {report['records']} records, {report['first_time']} .. {report['last_time']}",
        "",
    ]
    for tenant, t in sorted(report["tenants"].items()):
        out.append(f"## tenant {tenant}")
        out.append(", ".join(f"{k}={v}" for k, v in sorted(t["counts"].items())))
        out.append("actors: " + ", ".join(f"{a} ({n})" for a, n in sorted(t["actors"].items())))
        for key_id, key in sorted(t["keys"].items()):
            for version, v in sorted(key["versions"].items()):
                out.append(f"### key {key_id} v{version} — now {v['state']} — fingerprint {v['fingerprint']}")
                out.append("| seq | time | event | outcome | from → to | actor | request |")
                out.append("|---|---|---|---|---|---|---|")
                for e in v["events"]:
                    out.append(
                        f"| {e['seq']} | {e['time']} | {e['event']} | {e['outcome']} | "
                        f"{e['from'] or ''} → {e['to'] or ''} | {e['actor'] or ''} | "
                        f"{e['request_id'] or ''} |"
                    )
        out.append("")
    return "\n".join(out)


def export_records(
    log_path: str | os.PathLike[str], since: float | None = None, until: float | None = None
) -> Iterator[bytes]:
    """The stored lines (byte-exact, so each still hashes to its leaf) with ``since <= time < until``."""
    lo = format_time(since) if since is not None else ""
    hi = format_time(until) if until is not None else "~"
    lines, _torn = read_log_lines(Path(log_path))
    for line in lines:
        stamp = json.loads(line)["time"]
        if lo <= stamp < hi:
            yield line
