"""The server's registry of evaluation keys: lifecycle, use, rotation, revocation, destruction.

Every state change is written to the audit log *before* it takes effect; if the write fails the
operation raises :class:`KeyAuditError` and nothing changes ("no unaudited key change"). Uses are
granted as :class:`KeyLease` objects: revoking, suspending or expiring a key cancels its leases at
once (their hooks run, ``lease.check()`` raises), which is how in-flight encrypted work is stopped.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from server._files import write_private
from server.audit import AuditError, AuditLog, Event, Outcome

from ._errors import (
    KeyAuditError,
    KeyCancelledError,
    KeyExistsError,
    KeyIntegrityError,
    KeyNotFoundError,
    KeyNotUsableError,
    KeyStateError,
    KeyTooLargeError,
    MalformedKeyError,
    SecretKeyUploadError,
    UploadRefusedError,
)
from ._screen import EvalKeyInfo, Inspection, screen_evaluation_key
from ._states import KeyState, can_transition
from ._storage import EvalKeyStorage

__all__ = ["KeyLease", "KeyRecord", "KeyRegistry", "RegistryConfig"]

_KEY_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_REFUSAL_REASON = {
    SecretKeyUploadError: "secret_key_present",
    KeyTooLargeError: "too_large",
    MalformedKeyError: "malformed",
}
CancelHook = Callable[["KeyRecord", str], None]


@dataclass(frozen=True)
class RegistryConfig:
    """Key registry settings.

    Attributes:
        max_upload_bytes: uploads above this are refused before parsing (a CKKS N=8192 context
            with every Galois key is ~35 MB).
        default_lifetime_s: expiry set on activation when none is given (None: no expiry).
        max_grace_s: upper bound on a rotation's grace window for the old version.
        state_path: JSON file the registry persists to (None: memory only).
    """

    max_upload_bytes: int = 128 * 2**20
    default_lifetime_s: float | None = 90 * 86400.0
    max_grace_s: float = 86400.0
    state_path: Path | None = None

    def __post_init__(self) -> None:
        if self.max_upload_bytes < 1 or self.max_grace_s < 0:
            raise ValueError("max_upload_bytes must be >= 1 and max_grace_s >= 0")
        if self.default_lifetime_s is not None and self.default_lifetime_s <= 0:
            raise ValueError("default_lifetime_s must be > 0 or None")
        if self.state_path is not None:
            object.__setattr__(self, "state_path", Path(self.state_path))


@dataclass
class KeyRecord:
    """Metadata of one registered key version (never the key material itself)."""

    tenant: str
    key_id: str
    version: int
    fingerprint: str
    params_hash: str
    size: int
    state: KeyState
    created_at: float
    state_changed_at: float
    activated_at: float | None = None
    expires_at: float | None = None
    grace_until: float | None = None
    superseded_by: int | None = None
    #: SHA-256 of the stored (canonical) bytes; None: a record from before canonical storage, whose
    #: stored bytes are the upload itself (``fingerprint``)
    stored_sha256: str | None = None
    #: the key-set fingerprint the client's ciphertexts name (None: computed from the stored bytes)
    key_set: str | None = None

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict (state as its string value)."""
        return {**asdict(self), "state": self.state.value}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> KeyRecord:
        """Inverse of :meth:`to_json`."""
        return cls(**{**obj, "state": KeyState(obj["state"])})


@dataclass(eq=False)
class KeyLease:
    """Permission to use one ACTIVE key version for a piece of work; cancelled on revocation/expiry."""

    record: KeyRecord
    _registry: KeyRegistry = field(repr=False)
    _event: threading.Event = field(default_factory=threading.Event, repr=False)
    _hooks: list[Callable[[str], None]] = field(default_factory=list, repr=False)
    reason: str | None = None

    @property
    def cancelled(self) -> bool:
        """True once the key stopped being usable."""
        return self._event.is_set()

    def on_cancel(self, hook: Callable[[str], None]) -> None:
        """Call ``hook(reason)`` when cancelled (at once if already cancelled)."""
        self._hooks.append(hook)
        if self.cancelled:
            hook(self.reason or "cancelled")

    def check(self) -> None:
        """Raise :class:`KeyCancelledError` if the key is no longer usable (expiry checked now)."""
        if not self.cancelled:
            self._registry._enforce_expiry(self.record)
        if self.cancelled:
            raise KeyCancelledError(f"key {self.record.key_id} v{self.record.version}: {self.reason}")

    def _cancel(self, reason: str) -> None:
        if self.cancelled:
            return
        self.reason = reason
        self._event.set()
        for hook in list(self._hooks):
            hook(reason)

    def release(self) -> None:
        """Work is done; the registry forgets this lease."""
        self._registry._release(self)

    def __enter__(self) -> KeyLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class KeyRegistry:
    """Registered evaluation keys per tenant, their lifecycle and their audit trail. Thread-safe.

    Args:
        config: :class:`RegistryConfig`.
        audit: the audit log every transition is written to.
        storage: where key material lives (None: metadata only).
        clock: epoch seconds (injected so expiry tests are exact).

    The registry parses no key bytes: uploads come with an :class:`Inspection` (the verdict of an
    inspector such as :func:`server.keys.inspect_upload`, run in a worker process by the service), so
    it is a pure state machine over (bytes, verdict) plus its audit trail and storage.
    """

    SOURCE = "server.keys"

    def __init__(
        self,
        config: RegistryConfig,
        audit: AuditLog,
        storage: EvalKeyStorage | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config, self._audit, self._storage, self._clock = config, audit, storage, clock
        self._lock = threading.RLock()
        self._keys: dict[tuple[str, str], dict[int, KeyRecord]] = {}
        self._leases: dict[tuple[str, str, int], set[KeyLease]] = {}
        self._hooks: list[CancelHook] = []
        self._load()

    # -- uploads -------------------------------------------------------------------------------
    def screen_upload(
        self,
        tenant: str,
        data: bytes,
        inspection: Inspection,
        *,
        actor: str | None,
        key_id: str | None = None,
        request_id: str | None = None,
    ) -> EvalKeyInfo:
        """Size-check an upload and apply its inspection's verdict; refusals are audited and re-raised.

        Raises:
            SecretKeyUploadError, KeyTooLargeError, MalformedKeyError (all :class:`UploadRefusedError`);
            KeyAuditError if the refusal itself could not be audited.
        """
        try:
            return screen_evaluation_key(data, inspection, max_bytes=self.config.max_upload_bytes)
        except UploadRefusedError as exc:
            size = len(data) if isinstance(data, (bytes, bytearray, memoryview)) else 0
            self.audit_refused_upload(tenant, exc, size, actor=actor, key_id=key_id, request_id=request_id)
            raise

    def audit_refused_upload(self, tenant: str, exc: UploadRefusedError, size: int, *, actor: str | None,
                             key_id: str | None = None, request_id: str | None = None) -> None:
        """Audit one refused upload (also those refused before their body was read: ``size`` is then the
        declared or the read size).

        Raises:
            KeyAuditError: the refusal could not be audited.
        """
        reason = next(r for cls, r in _REFUSAL_REASON.items() if isinstance(exc, cls))
        self._write_audit(
            Event.KEY_UPLOAD_REFUSED,
            outcome=Outcome.REFUSED,
            tenant=tenant,
            actor=actor,
            key_id=key_id,
            request_id=request_id,
            detail={"reason": reason, "size": size},
        )

    def register(
        self,
        tenant: str,
        key_id: str,
        data: bytes,
        inspection: Inspection,
        *,
        actor: str | None,
        request_id: str | None = None,
    ) -> KeyRecord:
        """Register version 1 of a new key id (state PRE_ACTIVE) on ``inspection``'s verdict about
        ``data``. Use :meth:`activate` next.

        Raises:
            KeyExistsError, UploadRefusedError (audited), KeyAuditError.
        """
        _check_names(tenant, key_id)
        info = self.screen_upload(tenant, data, inspection, actor=actor, key_id=key_id, request_id=request_id)
        with self._lock:
            if (tenant, key_id) in self._keys:
                raise KeyExistsError(f"key {key_id} exists; rotate it to add a version")
            return self._add_version(tenant, key_id, 1, info, actor, request_id)

    def _add_version(
        self,
        tenant: str,
        key_id: str,
        version: int,
        info: EvalKeyInfo,
        actor: str | None,
        request_id: str | None,
    ) -> KeyRecord:
        now = self._clock()
        rec = KeyRecord(
            tenant,
            key_id,
            version,
            info.fingerprint,
            info.params_hash,
            info.size,
            KeyState.PRE_ACTIVE,
            created_at=now,
            state_changed_at=now,
            stored_sha256=info.canonical_sha256,
            key_set=info.key_set,
        )
        if self._storage is not None:  # what was parsed, never the upload (server.keys._screen.Inspection)
            self._storage.store(tenant, key_id, version, info.fingerprint, info.canonical)
        try:
            self._audit_key(
                Event.KEY_REGISTERED,
                rec,
                None,
                KeyState.PRE_ACTIVE,
                actor,
                request_id,
                {"size": info.size, "params_hash": info.params_hash[:32]},
            )
        except KeyAuditError:
            if self._storage is not None:
                self._storage.delete(tenant, key_id, version)
            raise
        self._keys.setdefault((tenant, key_id), {})[version] = rec
        self._persist()
        return rec

    # -- transitions ---------------------------------------------------------------------------
    def activate(
        self,
        tenant: str,
        key_id: str,
        version: int,
        *,
        actor: str | None,
        request_id: str | None = None,
        expires_at: float | None = None,
    ) -> KeyRecord:
        """PRE_ACTIVE -> ACTIVE; expiry ``expires_at`` or now + ``default_lifetime_s``."""
        with self._lock:
            rec = self._get(tenant, key_id, version)
            now = self._clock()
            if expires_at is None and self.config.default_lifetime_s is not None:
                expires_at = now + self.config.default_lifetime_s
            if expires_at is not None and expires_at <= now:
                raise ValueError("expires_at must be in the future")
            self._transition(
                rec,
                KeyState.ACTIVE,
                Event.KEY_ACTIVATED,
                actor,
                request_id,
                {"expires_at": int(expires_at)} if expires_at is not None else {},
                allowed_from={KeyState.PRE_ACTIVE},
            )
            rec.activated_at, rec.expires_at = now, expires_at
            self._persist()
            return rec

    def suspend(
        self,
        tenant: str,
        key_id: str,
        version: int,
        *,
        actor: str | None,
        request_id: str | None = None,
        reason: str = "suspended",
    ) -> KeyRecord:
        """ACTIVE -> SUSPENDED, effective immediately (in-flight leases cancelled)."""
        return self._simple(
            tenant, key_id, version, KeyState.SUSPENDED, Event.KEY_SUSPENDED, actor, request_id, reason
        )

    def reinstate(
        self, tenant: str, key_id: str, version: int, *, actor: str | None, request_id: str | None = None
    ) -> KeyRecord:
        """SUSPENDED -> ACTIVE (the expiry still applies)."""
        return self._simple(
            tenant,
            key_id,
            version,
            KeyState.ACTIVE,
            Event.KEY_REINSTATED,
            actor,
            request_id,
            "reinstated",
            allowed_from={KeyState.SUSPENDED},
        )

    def revoke(
        self,
        tenant: str,
        key_id: str,
        version: int,
        *,
        actor: str | None,
        compromised: bool = False,
        request_id: str | None = None,
        reason: str = "revoked",
    ) -> KeyRecord:
        """Stop a key now: -> COMPROMISED if ``compromised`` else DEACTIVATED; leases cancelled at once."""
        state, event = (
            (KeyState.COMPROMISED, Event.KEY_COMPROMISED)
            if compromised
            else (KeyState.DEACTIVATED, Event.KEY_DEACTIVATED)
        )
        return self._simple(tenant, key_id, version, state, event, actor, request_id, reason)

    def destroy(
        self, tenant: str, key_id: str, version: int, *, actor: str | None, request_id: str | None = None
    ) -> KeyRecord:
        """-> DESTROYED (from PRE_ACTIVE, DEACTIVATED or COMPROMISED); deletes the stored material."""
        with self._lock:
            rec = self._simple(
                tenant,
                key_id,
                version,
                KeyState.DESTROYED,
                Event.KEY_DESTROYED,
                actor,
                request_id,
                "destroyed",
            )
            if self._storage is not None:
                self._storage.delete(tenant, key_id, version)
            return rec

    def _simple(
        self,
        tenant: str,
        key_id: str,
        version: int,
        to: KeyState,
        event: str,
        actor: str | None,
        request_id: str | None,
        reason: str,
        allowed_from: set[KeyState] | None = None,
    ) -> KeyRecord:
        with self._lock:
            rec = self._get(tenant, key_id, version)
            self._transition(rec, to, event, actor, request_id, {"reason": reason[:64]}, allowed_from)
            self._persist()
            return rec

    def _transition(
        self,
        rec: KeyRecord,
        to: KeyState,
        event: str,
        actor: str | None,
        request_id: str | None,
        detail: dict[str, Any],
        allowed_from: set[KeyState] | None = None,
    ) -> None:
        """Audit, then apply, then cancel leases if the key left ACTIVE. Disallowed: audited failure."""
        src = rec.state
        if not can_transition(src, to) or (allowed_from is not None and src not in allowed_from):
            self._audit_key(
                event,
                rec,
                src,
                to,
                actor,
                request_id,
                {"reason": "transition_not_allowed"},
                outcome=Outcome.FAILURE,
            )
            raise KeyStateError(f"key {rec.key_id} v{rec.version}: {src.value} -> {to.value} not allowed")
        self._audit_key(event, rec, src, to, actor, request_id, detail)
        rec.state, rec.state_changed_at = to, self._clock()
        if src is KeyState.ACTIVE:
            self._cancel_leases(rec, f"{to.value} ({event})")

    # -- rotation ------------------------------------------------------------------------------
    def rotate(
        self,
        tenant: str,
        key_id: str,
        data: bytes,
        inspection: Inspection,
        *,
        actor: str | None,
        grace_s: float,
        request_id: str | None = None,
        expires_at: float | None = None,
    ) -> KeyRecord:
        """Register and activate a new version; an ACTIVE old primary stays usable for ``grace_s`` s.

        A non-active old primary (e.g. compromised) is simply superseded. Each step is audited as it
        happens; if one audit write fails the steps before it stand (and are in the log).

        Raises:
            ValueError: ``grace_s`` outside ``[0, max_grace_s]``.
            KeyNotFoundError: no such key id (use :meth:`register`).
        """
        if not 0 <= grace_s <= self.config.max_grace_s:
            raise ValueError(f"grace_s must be within [0, {self.config.max_grace_s}]")
        info = self.screen_upload(tenant, data, inspection, actor=actor, key_id=key_id, request_id=request_id)
        with self._lock:
            old = self._primary(tenant, key_id)
            version = max(self._keys[(tenant, key_id)]) + 1
            new = self._add_version(tenant, key_id, version, info, actor, request_id)
            self.activate(tenant, key_id, version, actor=actor, request_id=request_id, expires_at=expires_at)
            grace_until = self._clock() + grace_s if old.state is KeyState.ACTIVE else None
            detail = {"new_version": version}
            if grace_until is not None:
                detail["grace_until"] = int(grace_until)
            self._audit_key(Event.KEY_ROTATED, old, old.state, old.state, actor, request_id, detail)
            old.grace_until, old.superseded_by = grace_until, version
            self._persist()
            return new

    # -- use -----------------------------------------------------------------------------------
    def use(
        self,
        tenant: str,
        key_id: str,
        version: int | None = None,
        *,
        actor: str | None = None,
        request_id: str | None = None,
    ) -> KeyLease:
        """A lease on an ACTIVE key (``version=None``: the primary). Refusals are audited.

        Raises:
            KeyNotFoundError, KeyNotUsableError.
        """
        with self._lock:
            rec = self._primary(tenant, key_id) if version is None else self._get(tenant, key_id, version)
            self._enforce_expiry(rec)
            if rec.state is not KeyState.ACTIVE:
                self._audit_key(
                    Event.KEY_USE_REFUSED,
                    rec,
                    rec.state,
                    rec.state,
                    actor,
                    request_id,
                    {"reason": "not_active"},
                    outcome=Outcome.REFUSED,
                )
                raise KeyNotUsableError(f"key {key_id} v{rec.version} is {rec.state.value}, not active")
            lease = KeyLease(rec, self)
            self._leases.setdefault((tenant, key_id, rec.version), set()).add(lease)
            return lease

    def load_material(self, lease: KeyLease) -> bytes:
        """The stored evaluation-key bytes for a live lease (integrity-checked; failures audited): the
        canonical re-serialization of the upload; load them with ``fingerprint=record.key_set``."""
        lease.check()
        rec = lease.record
        if self._storage is None:
            raise KeyNotFoundError("this registry stores no key material")
        try:
            return self._storage.load(rec.tenant, rec.key_id, rec.version, rec.fingerprint, sha256=rec.stored_sha256)
        except KeyIntegrityError as exc:
            self._write_audit(
                Event.KEY_INTEGRITY_FAILURE,
                outcome=Outcome.FAILURE,
                tenant=rec.tenant,
                key_id=rec.key_id,
                key_version=rec.version,
                key_fingerprint=rec.fingerprint,
                detail={"reason": "stored_material_rejected"},
            )
            raise exc

    def _enforce_expiry(self, rec: KeyRecord) -> None:
        """ACTIVE past expiry or rotation grace -> DEACTIVATED (audited as key.expired)."""
        with self._lock:
            if rec.state is not KeyState.ACTIVE:
                return
            now = self._clock()
            if rec.expires_at is not None and now >= rec.expires_at:
                why = "expired"
            elif rec.grace_until is not None and now >= rec.grace_until:
                why = "grace_ended"
            else:
                return
            self._transition(rec, KeyState.DEACTIVATED, Event.KEY_EXPIRED, None, None, {"reason": why})
            self._persist()

    def expire_due(self) -> list[KeyRecord]:
        """Deactivate every ACTIVE key past its expiry or grace window (call from a timer)."""
        with self._lock:
            due = [r for vs in self._keys.values() for r in vs.values() if r.state is KeyState.ACTIVE]
            for rec in due:
                self._enforce_expiry(rec)
            return [r for r in due if r.state is not KeyState.ACTIVE]

    def add_cancel_hook(self, hook: CancelHook) -> None:
        """``hook(record, reason)`` runs whenever a key leaves ACTIVE (e.g. to drop cached contexts)."""
        self._hooks.append(hook)

    def _cancel_leases(self, rec: KeyRecord, reason: str) -> None:
        for lease in list(self._leases.pop((rec.tenant, rec.key_id, rec.version), ())):
            lease._cancel(reason)
        for hook in self._hooks:
            hook(rec, reason)

    def _release(self, lease: KeyLease) -> None:
        with self._lock:
            self._leases.get((lease.record.tenant, lease.record.key_id, lease.record.version), set()).discard(
                lease
            )

    # -- queries -------------------------------------------------------------------------------
    def now(self) -> float:
        """The registry's clock (callers computing ``expires_at`` should use this one)."""
        return self._clock()

    def get(self, tenant: str, key_id: str, version: int | None = None) -> KeyRecord:
        """A copy of one version's metadata (``None``: the primary, i.e. newest, version)."""
        with self._lock:
            rec = self._primary(tenant, key_id) if version is None else self._get(tenant, key_id, version)
            return KeyRecord.from_json(rec.to_json())

    def list(self, tenant: str) -> list[KeyRecord]:
        """Copies of every version of every key of ``tenant``."""
        with self._lock:
            return [
                KeyRecord.from_json(r.to_json())
                for (t, _), vs in sorted(self._keys.items())
                if t == tenant
                for _, r in sorted(vs.items())
            ]

    def active_leases(self, tenant: str, key_id: str, version: int) -> int:
        """How many uncancelled leases a version has (tests, metrics)."""
        with self._lock:
            return len(self._leases.get((tenant, key_id, version), ()))

    def _versions(self, tenant: str, key_id: str) -> dict[int, KeyRecord]:
        try:
            return self._keys[(tenant, key_id)]
        except KeyError:
            raise KeyNotFoundError(f"no key {key_id!r} for this tenant") from None

    def _get(self, tenant: str, key_id: str, version: int) -> KeyRecord:
        try:
            return self._versions(tenant, key_id)[version]
        except KeyError:
            raise KeyNotFoundError(f"no version {version} of key {key_id!r}") from None

    def _primary(self, tenant: str, key_id: str) -> KeyRecord:
        """The newest version (the one new work must use)."""
        versions = self._versions(tenant, key_id)
        return versions[max(versions)]

    # -- audit & persistence -------------------------------------------------------------------
    def _audit_key(
        self,
        event: str,
        rec: KeyRecord,
        src: KeyState | None,
        dst: KeyState | None,
        actor: str | None,
        request_id: str | None,
        detail: dict[str, Any],
        outcome: str = Outcome.SUCCESS,
    ) -> None:
        self._write_audit(
            event,
            outcome=outcome,
            tenant=rec.tenant,
            actor=actor,
            key_id=rec.key_id,
            key_version=rec.version,
            key_fingerprint=rec.fingerprint,
            state_from=src.value if src else None,
            state_to=dst.value if dst else None,
            request_id=request_id,
            detail=detail,
        )

    def _write_audit(self, event: str, **fields: Any) -> None:
        """The one place audit failures are translated: no record, no operation."""
        try:
            self._audit.append(event, source=self.SOURCE, **fields)
        except AuditError as exc:
            raise KeyAuditError(f"audit write failed; {event} not performed") from exc

    def _persist(self) -> None:
        path = self.config.state_path
        if path is None:
            return
        data = json.dumps([r.to_json() for vs in self._keys.values() for r in vs.values()]).encode()
        write_private(path, data)

    def _load(self) -> None:
        path = self.config.state_path
        if path is None or not path.exists():
            return
        for obj in json.loads(path.read_bytes()):
            rec = KeyRecord.from_json(obj)
            self._keys.setdefault((rec.tenant, rec.key_id), {})[rec.version] = rec


def _check_names(tenant: str, key_id: str) -> None:
    if not isinstance(tenant, str) or not 0 < len(tenant) <= 128:
        raise ValueError("tenant must be a non-empty string of <= 128 chars")
    if not isinstance(key_id, str) or not _KEY_ID_RE.match(key_id):
        raise ValueError("key_id must match [A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
