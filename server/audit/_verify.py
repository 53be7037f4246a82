"""Offline verification of an audit log: needs the log, its checkpoints and the public keys only.

The verifier streams the records once, rebuilding the RFC 6962 tree, and stops at the first
inconsistency. Each record stores the tree head *including itself* (``root``), so an edited record is
caught at its own index; ``seq`` catches deletion, insertion and reordering; a signed checkpoint
larger than the log catches a truncated tail; a checkpoint whose signature, key or tree head is wrong
makes every record after the previous good checkpoint unvouched-for, and that is the index reported.
Records after the last checkpoint verify structurally but are reported as not yet signed.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from ._errors import AuditFormatError
from ._merkle import MerkleFrontier, leaf_hash
from ._record import Event, canonical, fast_canonical, validate_body
from ._signing import parse_signed_line, verify_checkpoint_signature

__all__ = ["VerifyResult", "checkpoints_path_for", "read_log_lines", "verify_log"]

_TIME_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")
_CHECKPOINT_FIELDS = {"v", "log_id", "size", "root", "time", "key_id"}


def checkpoints_path_for(log_path: str | os.PathLike[str]) -> Path:
    """Where the checkpoints of ``log_path`` live: ``<log>.checkpoints`` beside it."""
    path = Path(log_path)
    return path.with_name(path.name + ".checkpoints")


def read_log_lines(path: str | os.PathLike[str]) -> tuple[list[bytes], bool]:
    """The complete lines of a log and whether a torn (newline-less) final line followed them."""
    data = Path(path).read_bytes()
    lines = data.split(b"\n")
    torn = lines.pop() != b""  # a complete file ends with "\n", leaving an empty last piece
    return lines, torn


@dataclass
class VerifyResult:
    """Outcome of :func:`verify_log`.

    Attributes:
        ok: no inconsistency found.
        records: records in the log.
        checkpoints: checkpoints read (valid or not).
        covered: records vouched for by the last valid checkpoint.
        first_bad: index of the first record that cannot be trusted, or None.
        reason: why, in words.
        warnings: non-fatal findings (e.g. records not yet covered by a checkpoint).
        log_id: the log's random id from its first record.
    """

    ok: bool
    records: int
    checkpoints: int
    covered: int = 0
    first_bad: int | None = None
    reason: str | None = None
    warnings: list[str] = field(default_factory=list)
    log_id: str | None = None


class _Failure(Exception):
    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index, self.reason = index, reason


@dataclass
class _Checkpoint:
    number: int
    body: dict[str, Any]


class RecordChecker:
    """Streaming per-record checks (shared by the verifier and by :class:`AuditLog` on open)."""

    def __init__(self) -> None:
        self.frontier = MerkleFrontier()
        self._before_last = MerkleFrontier()  # tree before the latest leaf: to diagnose an insertion
        self.last_time = ""
        self.log_id: str | None = None
        self.key_changes: list[tuple[int, str, str]] = []  # (seq, old key id, new key id)
        self.first_key_id: str | None = None

    def feed(self, line: bytes) -> dict[str, Any]:
        """Check the record at position ``self.frontier.size``; raises :class:`_Failure`."""
        p = self.frontier.size
        obj = self._parse(p, line)
        root = obj.pop("root")
        # The line is canonical, so dropping its (only) "root" member leaves the canonical body: a
        # raw `,"root":"` cannot occur inside a JSON string, where quotes are escaped.
        body_bytes = line.replace(b',"root":"' + root.encode() + b'"', b"", 1)
        if obj["seq"] != p:
            raise self._misplaced(p, obj, body_bytes, root)
        if obj["time"] < self.last_time:
            raise _Failure(p, f"time {obj['time']} is earlier than the previous record's")
        self._before_last = self.frontier.copy()
        self.frontier.append(leaf_hash(body_bytes))
        if self.frontier.root().hex() != root:
            raise _Failure(p, "record does not match the tree head it committed to (altered)")
        self.last_time = obj["time"]
        self._track_keys(p, obj)
        return obj

    def _parse(self, p: int, line: bytes) -> dict[str, Any]:
        try:
            obj = json.loads(line)
        except ValueError:
            raise _Failure(p, "not valid JSON") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("root"), str):
            raise _Failure(p, "not a record (no tree head)")
        try:
            same = fast_canonical(obj) == line or canonical(obj) == line
        except (UnicodeEncodeError, ValueError, TypeError):
            same = False
        if not same:
            raise _Failure(p, "not in canonical form (RFC 8785): bytes were edited")
        body = {k: v for k, v in obj.items() if k != "root"}
        try:
            validate_body(body)
        except AuditFormatError as exc:
            raise _Failure(p, f"malformed record: {exc}") from None
        if not _TIME_RE.match(obj["time"]):
            raise _Failure(p, "malformed time")
        return obj

    def _misplaced(self, p: int, obj: dict[str, Any], body_bytes: bytes, root: str) -> _Failure:
        """Seq out of place: a record was deleted, inserted or moved. Name the first wrong one."""
        if p > 0 and obj["seq"] == p - 1:
            trial = self._before_last.copy()
            trial.append(leaf_hash(body_bytes))
            if trial.root().hex() == root:  # record p is the true successor of records [0, p-1)
                return _Failure(
                    p - 1, f"record {p - 1} was inserted: record {p} continues the log without it"
                )
        return _Failure(p, f"record carries seq {obj['seq']} at position {p} (deleted, inserted or moved)")

    def _track_keys(self, p: int, obj: dict[str, Any]) -> None:
        detail = obj["detail"]
        if p == 0:
            if obj["event"] != Event.LOG_CREATED or not isinstance(detail.get("log_id"), str):
                raise _Failure(0, "first record is not the log's creation record")
            self.log_id, self.first_key_id = detail["log_id"], detail.get("signing_key_id")
        elif obj["event"] == Event.SIGNING_KEY_ROTATED:
            self.key_changes.append((p, str(detail.get("old_key_id")), str(detail.get("new_key_id"))))

    def key_for_record(self, index: int) -> str | None:
        """The signing key in charge of records up to ``index`` (rotation records stay with the old key)."""
        key = self.first_key_id
        for seq, _old, new in self.key_changes:
            if index > seq:
                key = new
        return key


def _load_checkpoints(
    path: Path, keys: dict[str, Ed25519PublicKey]
) -> tuple[list[_Checkpoint], _Failure | None, int]:
    """Valid checkpoints in file order up to the first bad one, that failure (if any), and the count."""
    if not path.exists():
        return [], None, 0
    lines, torn = read_log_lines(path)
    good: list[_Checkpoint] = []
    for number, line in enumerate(lines):
        start = good[-1].body["size"] if good else 0
        try:
            body, sig = parse_signed_line(line)
        except AuditFormatError as exc:
            return good, _Failure(start, f"checkpoint #{number}: {exc}"), len(lines)
        problem = _checkpoint_problem(body, sig, keys, good[-1].body if good else None)
        if problem:
            return good, _Failure(start, f"checkpoint #{number} {problem}"), len(lines)
        good.append(_Checkpoint(number, body))
    failure = None
    if torn:
        failure = _Failure(good[-1].body["size"] if good else 0, "checkpoint file ends in a partial line")
    return good, failure, len(lines) + int(torn)


def _checkpoint_problem(
    body: dict[str, Any], sig: str, keys: dict[str, Ed25519PublicKey], prev: dict[str, Any] | None
) -> str | None:
    if set(body) != _CHECKPOINT_FIELDS or not isinstance(body["size"], int) or body["size"] < 1:
        return "is malformed"
    problem = verify_checkpoint_signature(body, sig, keys)
    if problem:
        return problem
    if prev is not None:
        if body["size"] < prev["size"] or body["time"] < prev["time"]:
            return "goes back in size or time"
        if body["log_id"] != prev["log_id"]:
            return "belongs to another log"
    return None


def _check_checkpoint(cp: _Checkpoint, checker: RecordChecker, start: int) -> None:
    """Compare a signed tree head with the tree rebuilt from the records."""
    body, size = cp.body, cp.body["size"]
    if body["log_id"] != checker.log_id:
        raise _Failure(start, f"checkpoint #{cp.number} belongs to another log")
    expected = checker.key_for_record(size - 1)
    if body["key_id"] != expected:
        raise _Failure(
            start,
            f"checkpoint #{cp.number} is signed by key {body['key_id']} but the log "
            f"announced key {expected} for records up to {size - 1} (unannounced key swap)",
        )
    if body["root"] != checker.frontier.root().hex():
        raise _Failure(
            start,
            f"records {start}..{size - 1} differ from the tree head signed in "
            f"checkpoint #{cp.number} (rewritten)",
        )


def verify_log(
    log_path: str | os.PathLike[str],
    public_keys: dict[str, Ed25519PublicKey],
    *,
    checkpoints_path: str | os.PathLike[str] | None = None,
) -> VerifyResult:
    """Verify a log file against its signed checkpoints and the operator's public keys.

    Args:
        log_path: the audit log (one canonical JSON record per line).
        public_keys: keyring ``{key_id: Ed25519PublicKey}`` (:func:`load_public_keys`).
        checkpoints_path: default ``<log>.checkpoints``.

    Returns:
        A :class:`VerifyResult`; ``first_bad`` is the smallest index that cannot be trusted.
    """
    cps, cp_failure, n_cps = _load_checkpoints(
        Path(checkpoints_path or checkpoints_path_for(log_path)), public_keys
    )
    lines, torn = read_log_lines(log_path)
    checker, covered = RecordChecker(), 0
    by_size: dict[int, list[_Checkpoint]] = {}
    for cp in cps:
        by_size.setdefault(cp.body["size"], []).append(cp)
    failure = _stream(lines, checker, by_size)
    if failure is None and torn:
        failure = _Failure(len(lines), "log ends in a partial line (torn or truncated write)")
    if failure is None and cps and cps[-1].body["size"] > len(lines):
        big = next(cp for cp in cps if cp.body["size"] > len(lines))
        failure = _Failure(
            len(lines),
            f"log ends after {len(lines)} records but checkpoint #{big.number} "
            f"signed a tree of {big.body['size']} (tail deleted)",
        )
    if cp_failure is not None and (failure is None or cp_failure.index < failure.index):
        failure = cp_failure
    covered = max((cp.body["size"] for cp in cps if cp.body["size"] <= len(lines)), default=0)
    if failure is not None:
        covered = min(covered, failure.index)
    return _result(lines, n_cps, covered, failure, checker)


def _stream(
    lines: list[bytes], checker: RecordChecker, by_size: dict[int, list[_Checkpoint]]
) -> _Failure | None:
    start = 0  # first record not yet vouched for by a checkpoint
    for line in lines:
        try:
            checker.feed(line)
            for cp in by_size.get(checker.frontier.size, ()):
                _check_checkpoint(cp, checker, start)
                start = checker.frontier.size
        except _Failure as failure:
            return failure
    return None


def _result(
    lines: list[bytes], n_cps: int, covered: int, failure: _Failure | None, checker: RecordChecker
) -> VerifyResult:
    result = VerifyResult(
        ok=failure is None, records=len(lines), checkpoints=n_cps, covered=covered, log_id=checker.log_id
    )
    if failure is not None:
        result.first_bad, result.reason = failure.index, failure.reason
    elif covered < len(lines):
        result.warnings.append(
            f"records {covered}..{len(lines) - 1} are not yet covered by a signed "
            "checkpoint (consistent, but unsigned)"
        )
    return result
