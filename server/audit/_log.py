"""The append-only audit log writer.

File format: ``<log>`` holds one RFC 8785 canonical JSON record per line, each with the RFC 6962 tree
head (``root``) over all records up to and including itself; ``<log>.checkpoints`` holds signed tree
heads (``{v, log_id, size, root, time, key_id, sig}``), written every ``checkpoint_every`` records,
every ``checkpoint_interval_s`` seconds (checked on append and by :meth:`AuditLog.checkpoint_if_due`,
which a server calls from a timer) and on :meth:`AuditLog.close`. Every append is one ``write`` plus
``fsync`` before it returns; if that fails the log refuses further writes and the caller's operation
fails (:class:`AuditWriteError`). One writer per log, enforced with an exclusive ``flock``.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._errors import AuditFormatError, AuditWriteError, SigningKeyError
from ._merkle import MerkleFrontier, leaf_hash
from ._record import Event, Outcome, Pseudonymizer, canonical, format_time, validate_body
from ._signing import CheckpointSigner, parse_signed_line
from ._verify import RecordChecker, _Failure, checkpoints_path_for, read_log_lines

__all__ = ["AuditConfig", "AuditLog"]


@dataclass(frozen=True)
class AuditConfig:
    """Settings of one audit log.

    Attributes:
        path: the log file (checkpoints go to ``<path>.checkpoints``).
        checkpoint_every: sign a checkpoint after this many new records.
        checkpoint_interval_s: ... or when this many seconds passed since the last one.
        fsync: fsync every record (turn off only in benchmarks that say so).
    """

    path: Path
    checkpoint_every: int = 1000
    checkpoint_interval_s: float = 300.0
    fsync: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        if self.checkpoint_every < 1:
            raise ValueError("checkpoint_every must be >= 1")
        if not self.checkpoint_interval_s > 0:
            raise ValueError("checkpoint_interval_s must be > 0")


class AuditLog:
    """Append-only, Merkle-committed, checkpoint-signed audit log. Thread-safe.

    Use :meth:`open`; then :meth:`append` for each event and :meth:`close` on shutdown.
    """

    def __init__(
        self,
        config: AuditConfig,
        signer: CheckpointSigner,
        pseudonymizer: Pseudonymizer,
        clock: Callable[[], float],
    ) -> None:
        self.config, self._signer, self._pseudo, self._clock = config, signer, pseudonymizer, clock
        self._lock = threading.Lock()
        self._frontier = MerkleFrontier()
        self._log_id = ""
        self._last_time = ""
        self._cp_size, self._cp_time = 0, clock()
        self._broken: str | None = None
        self._fd = self._cp_fd = self._lock_fd = -1

    # -- opening -------------------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        config: AuditConfig,
        signer: CheckpointSigner,
        pseudonymizer: Pseudonymizer,
        *,
        clock: Callable[[], float] = time.time,
        rng: Callable[[int], bytes] = secrets.token_bytes,
    ) -> AuditLog:
        """Open (or create) a log for appending; checks what is there before writing to it.

        Raises:
            AuditWriteError: another process holds the log, or it cannot be created.
            AuditFormatError: the existing log is inconsistent (do not append to a tampered log).
            SigningKeyError: ``signer`` is not the key that signed the log's last checkpoint.
        """
        log = cls(config, signer, pseudonymizer, clock)
        try:
            log._lock_and_open()
            existed = log._replay()
            if existed:
                log._append_locked(Event.LOG_OPENED, source="audit", detail={"signing_key_id": signer.key_id})
            else:
                log._log_id = rng(16).hex()
                log._append_locked(
                    Event.LOG_CREATED,
                    source="audit",
                    detail={"log_id": log._log_id, "signing_key_id": signer.key_id},
                )
        except BaseException:
            log._release()
            raise
        return log

    def _lock_and_open(self) -> None:
        path = self.config.path
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._lock_fd = os.open(str(path) + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            raise AuditWriteError(f"cannot lock {path} (is another process writing it?): {exc}") from exc
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
        try:
            self._fd = os.open(path, flags, 0o640)
            self._cp_fd = os.open(checkpoints_path_for(path), flags, 0o640)
        except OSError as exc:
            raise AuditWriteError(f"cannot open {path}: {exc}") from exc

    def _replay(self) -> bool:
        """Rebuild the tree from the existing file; True if it had records."""
        lines, torn = read_log_lines(self.config.path)
        last_cp = self._last_checkpoint()
        checker = self._check_existing(lines, last_cp)
        self._frontier, self._log_id = checker.frontier, checker.log_id or ""
        self._last_time = checker.last_time
        self._check_signer(checker)
        self._cp_size = last_cp["size"] if last_cp else 0
        if torn:  # a write that never returned: not acknowledged, never covered by a checkpoint
            os.truncate(self.config.path, sum(len(x) + 1 for x in lines))
            self._append_locked(Event.TORN_WRITE_DISCARDED, source="audit", outcome=Outcome.FAILURE)
        return bool(lines)

    def _check_existing(self, lines: list[bytes], last_cp: dict[str, Any] | None) -> RecordChecker:
        """Never append to a log that is inconsistent or shorter than its last signed checkpoint."""
        checker = RecordChecker()
        try:
            for line in lines:
                checker.feed(line)
                size = checker.frontier.size
                if last_cp and size == last_cp["size"] and checker.frontier.root().hex() != last_cp["root"]:
                    raise _Failure(size - 1, "records differ from the last signed checkpoint")
        except _Failure as failure:
            raise AuditFormatError(f"{self.config.path}: record {failure.index}: {failure.reason}") from None
        if last_cp and last_cp["size"] > len(lines):
            raise AuditFormatError(
                f"{self.config.path}: {len(lines)} records but the last checkpoint signed {last_cp['size']}"
            )
        return checker

    def _last_checkpoint(self) -> dict[str, Any] | None:
        """The newest complete checkpoint; a torn final line (crash mid-write) is cut off first."""
        path = checkpoints_path_for(self.config.path)
        lines, torn = read_log_lines(path)
        if torn:
            os.truncate(path, sum(len(x) + 1 for x in lines))
        return parse_signed_line(lines[-1])[0] if lines else None

    def _check_signer(self, checker: RecordChecker) -> None:
        if self._frontier.size:
            expected = checker.key_for_record(self._frontier.size)
            if expected != self._signer.key_id:
                raise SigningKeyError(
                    f"log is signed with key {expected}, not {self._signer.key_id}; "
                    "rotate keys with `cipherlm audit rotate-key --log`"
                )

    # -- appending -----------------------------------------------------------------------------
    def append(
        self,
        event: str,
        *,
        source: str,
        outcome: str = Outcome.SUCCESS,
        tenant: str | None = None,
        actor: str | None = None,
        key_id: str | None = None,
        key_version: int | None = None,
        key_fingerprint: str | None = None,
        state_from: str | None = None,
        state_to: str | None = None,
        request_id: str | None = None,
        detail: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Write one record durably and return it (as stored, with pseudonyms and ``root``).

        ``tenant``, ``actor`` and ``request_id`` are given in clear and stored as HMAC pseudonyms.

        Raises:
            AuditWriteError: the record is not durable; the caller must fail its operation.
            AuditFormatError: a field is malformed (e.g. a payload in ``detail``); nothing written.
        """
        with self._lock:
            return self._append_locked(
                event,
                source=source,
                outcome=outcome,
                tenant=self._pseudo.label("tenant", tenant),
                actor=self._pseudo.label("actor", actor),
                key_id=key_id,
                key_version=key_version,
                key_fingerprint=key_fingerprint,
                state_from=state_from,
                state_to=state_to,
                request_id=self._pseudo.label("request", request_id),
                detail=detail,
            )

    def _append_locked(
        self,
        event: str,
        *,
        source: str,
        outcome: str = Outcome.SUCCESS,
        detail: dict[str, Any] | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        if self._broken:
            raise AuditWriteError(f"audit log unusable after an earlier failure: {self._broken}")
        body = self._body(event, source, outcome, detail or {}, fields)
        body_bytes = canonical(body)
        frontier = self._frontier.copy()
        frontier.append(leaf_hash(body_bytes))
        record = {**body, "root": frontier.root().hex()}
        self._write(self._fd, canonical(record) + b"\n")
        self._frontier, self._last_time = frontier, body["time"]
        self._checkpoint_if_due_locked(raise_errors=False)
        return record

    def _body(
        self, event: str, source: str, outcome: str, detail: dict[str, Any], fields: dict[str, Any]
    ) -> dict[str, Any]:
        stamp = max(format_time(self._clock()), self._last_time)  # never backwards, even if the clock is
        body = {
            "v": 1,
            "seq": self._frontier.size,
            "time": stamp,
            "event": event,
            "outcome": outcome,
            "source": source,
            "detail": dict(detail),
        }
        for name in (
            "tenant",
            "actor",
            "key_id",
            "key_version",
            "key_fingerprint",
            "state_from",
            "state_to",
            "request_id",
        ):
            body[name] = fields.get(name)
        validate_body(body)
        return body

    def _write(self, fd: int, data: bytes) -> None:
        """One write + fsync; any failure breaks the log (a torn line may be on disk)."""
        try:
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(f"short write ({written} of {len(data)} bytes)")
            if self.config.fsync:
                os.fsync(fd)
        except OSError as exc:
            self._broken = str(exc)
            raise AuditWriteError(f"audit write failed: {exc}") from exc

    # -- checkpoints ---------------------------------------------------------------------------
    def checkpoint(self) -> dict[str, Any] | None:
        """Sign and write a checkpoint of the current tree now (None if nothing new since the last)."""
        with self._lock:
            return self._checkpoint_locked()

    def checkpoint_if_due(self) -> dict[str, Any] | None:
        """Checkpoint if ``checkpoint_every`` records or ``checkpoint_interval_s`` seconds have passed."""
        with self._lock:
            return self._checkpoint_if_due_locked(raise_errors=True)

    def _checkpoint_if_due_locked(self, raise_errors: bool) -> dict[str, Any] | None:
        pending = self._frontier.size - self._cp_size
        due = pending >= self.config.checkpoint_every or (
            pending > 0 and self._clock() - self._cp_time >= self.config.checkpoint_interval_s
        )
        if not due:
            return None
        try:
            return self._checkpoint_locked()
        except AuditWriteError:
            if raise_errors:
                raise
            return None  # the record itself is durable; the broken flag fails the next append

    def _checkpoint_locked(self) -> dict[str, Any] | None:
        if self._frontier.size == self._cp_size:
            return None
        if self._broken:
            raise AuditWriteError(f"audit log unusable after an earlier failure: {self._broken}")
        now = self._clock()
        body = {
            "v": 1,
            "log_id": self._log_id,
            "size": self._frontier.size,
            "root": self._frontier.root().hex(),
            "time": max(format_time(now), self._last_time),
            "key_id": self._signer.key_id,
        }
        signed = {**body, "sig": self._signer.sign(body)}
        self._write(self._cp_fd, canonical(signed) + b"\n")
        self._cp_size, self._cp_time = body["size"], now
        return signed

    def rotate_signing_key(self, new_signer: CheckpointSigner, *, actor: str | None = None) -> None:
        """Hand over to ``new_signer``: the old key signs a checkpoint that announces the new one."""
        with self._lock:
            old = self._signer
            self._append_locked(
                Event.SIGNING_KEY_ROTATED,
                source="audit",
                actor=self._pseudo.label("actor", actor),
                detail={"old_key_id": old.key_id, "new_key_id": new_signer.key_id},
            )
            self._checkpoint_locked()
            self._signer = new_signer

    # -- state ---------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Records in the log."""
        return self._frontier.size

    @property
    def log_id(self) -> str:
        """The log's random id (in its first record and in every checkpoint)."""
        return self._log_id

    @property
    def signing_key_id(self) -> str:
        """Id of the key that signs the next checkpoint."""
        return self._signer.key_id

    def close(self) -> None:
        """Write a final checkpoint (if anything is unsigned) and release the log."""
        with self._lock:
            try:
                if self._fd >= 0 and not self._broken:
                    self._checkpoint_locked()
            finally:
                self._release()

    def _release(self) -> None:
        for name in ("_fd", "_cp_fd", "_lock_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)
        self._broken = self._broken or "closed"

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
