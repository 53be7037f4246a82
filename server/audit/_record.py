"""Audit record schema (after NIST SP 800-53 AU-3), canonical encoding (RFC 8785), pseudonyms.

A record answers AU-3's questions: *what* (``event``), *when* (``time``, UTC, microseconds),
*where* (``source``: the component), *outcome* (``outcome``), *who* (``tenant``, ``actor``), and
*which key* (``key_id``, ``key_version``, ``key_fingerprint``, ``state_from`` → ``state_to``), plus
the ``request_id`` that ties it to an API call. Tenant, actor and request id are stored as keyed
HMACs (:class:`Pseudonymizer`): an auditor can check "is this tenant X?" with the pseudonym key,
a reader of a leaked log cannot enumerate customers.

``detail`` holds a few short scalar values (reason codes, sizes, a new key id) and nothing else:
the schema refuses bytes, long strings and nested objects, so a prompt, a ciphertext or a key cannot
be logged by mistake.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from datetime import datetime, timezone
from typing import Any

import rfc8785

from ._errors import AuditFormatError

__all__ = [
    "Event",
    "Outcome",
    "Pseudonymizer",
    "RECORD_FIELDS",
    "canonical",
    "fast_canonical",
    "format_time",
    "parse_time",
    "validate_body",
]

FORMAT_VERSION = 1
MAX_DETAIL_ITEMS = 16
MAX_DETAIL_STR = 128

# Field name -> allowed JSON types (None allowed where listed).
RECORD_FIELDS: dict[str, tuple[type, ...]] = {
    "v": (int,),
    "seq": (int,),
    "time": (str,),
    "event": (str,),
    "outcome": (str,),
    "source": (str,),
    "tenant": (str, type(None)),
    "actor": (str, type(None)),
    "key_id": (str, type(None)),
    "key_version": (int, type(None)),
    "key_fingerprint": (str, type(None)),
    "state_from": (str, type(None)),
    "state_to": (str, type(None)),
    "request_id": (str, type(None)),
    "detail": (dict,),
}
_FINGERPRINT_RE = re.compile(r"^[0-9a-f]{64}$")
_NAME_RE = re.compile(r"^[a-z][a-z0-9_.]{0,63}$")


class Event:
    """Event names (``area.what``). Other components log their events with these constants."""

    LOG_CREATED = "audit.log_created"
    LOG_OPENED = "audit.log_opened"
    TORN_WRITE_DISCARDED = "audit.torn_write_discarded"
    SIGNING_KEY_ROTATED = "audit.signing_key_rotated"
    KEY_REGISTERED = "key.registered"
    KEY_ACTIVATED = "key.activated"
    KEY_SUSPENDED = "key.suspended"
    KEY_REINSTATED = "key.reinstated"
    KEY_DEACTIVATED = "key.deactivated"
    KEY_EXPIRED = "key.expired"
    KEY_COMPROMISED = "key.compromised"
    KEY_DESTROYED = "key.destroyed"
    KEY_ROTATED = "key.rotated"
    KEY_USE_REFUSED = "key.use_refused"
    KEY_UPLOAD_REFUSED = "key.upload_refused"
    KEY_INTEGRITY_FAILURE = "key.integrity_failure"
    SESSION_OPENED = "session.opened"
    SESSION_CLOSED = "session.closed"
    PRIVACY_MODE_CHANGED = "tenant.privacy_mode_changed"
    PLAINTEXT_FALLBACK = "request.plaintext_fallback"


class Outcome:
    """Values of the ``outcome`` field."""

    SUCCESS = "success"
    FAILURE = "failure"
    REFUSED = "refused"
    ALL = frozenset({SUCCESS, FAILURE, REFUSED})


def canonical(obj: Any) -> bytes:
    """RFC 8785 (JCS) canonical JSON bytes of ``obj``."""
    return rfc8785.dumps(obj)


def fast_canonical(obj: Any) -> bytes:
    """RFC 8785 bytes for the record schema, ~10x faster than :func:`canonical` (verifier hot path).

    For objects whose keys are ASCII and whose numbers are integers within I-JSON range (what
    :func:`validate_body` allows), sorted-key compact ``json.dumps`` without ASCII escaping produces
    exactly the JCS bytes: same escapes (short forms, lowercase ``\\u00xx``), same key order. A
    property test pins this equality; anything else (e.g. floats) must use :func:`canonical`.
    """
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def format_time(epoch: float) -> str:
    """RFC 3339 UTC with microseconds, e.g. ``2026-11-29T09:00:00.000000Z``."""
    return datetime.fromtimestamp(epoch, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str) -> float:
    """Inverse of :func:`format_time`; also accepts a date or an ISO time with offset."""
    try:
        stamp = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise AuditFormatError(f"not an ISO 8601 time: {text!r}") from exc
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=timezone.utc)
    return stamp.timestamp()


class Pseudonymizer:
    """Keyed HMAC-SHA256 pseudonyms for identifiers that could be sensitive.

    Args:
        key: at least 16 secret bytes, held by the operator apart from the log.
    """

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("pseudonym key must be at least 16 bytes")
        self._key = bytes(key)

    def __repr__(self) -> str:
        return "Pseudonymizer(<key hidden>)"

    def label(self, kind: str, value: str | None) -> str | None:
        """``"h:" + 32 hex`` (128-bit HMAC) of ``value`` in namespace ``kind``; None stays None."""
        if value is None:
            return None
        mac = hmac.new(self._key, f"{kind}\x00{value}".encode(), hashlib.sha256)
        return "h:" + mac.hexdigest()[:32]


def _check_detail(detail: dict[str, Any]) -> None:
    """Only a few short scalars: anything that could carry a payload is refused."""
    if len(detail) > MAX_DETAIL_ITEMS:
        raise AuditFormatError("detail has too many items")
    for name, value in detail.items():
        if not _NAME_RE.match(name):
            raise AuditFormatError(f"detail key {name!r} is not a short lowercase name")
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int):
            if abs(value) >= 2**53:  # I-JSON range (RFC 8785 needs exact integers)
                raise AuditFormatError(f"detail {name!r} out of range")
            continue
        if isinstance(value, str) and len(value) <= MAX_DETAIL_STR:
            continue
        raise AuditFormatError(f"detail {name!r} must be a bool, int or string of <= {MAX_DETAIL_STR} chars")


def validate_body(body: dict[str, Any]) -> None:
    """Raise :class:`AuditFormatError` unless ``body`` is a well-formed record (without ``root``)."""
    if set(body) != set(RECORD_FIELDS):
        raise AuditFormatError(f"fields {sorted(set(body) ^ set(RECORD_FIELDS))} missing or unexpected")
    for name, kinds in RECORD_FIELDS.items():
        value = body[name]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise AuditFormatError(f"field {name!r} has type {type(value).__name__}")
    if body["v"] != FORMAT_VERSION:
        raise AuditFormatError(f"unknown record version {body['v']}")
    if body["outcome"] not in Outcome.ALL:
        raise AuditFormatError(f"unknown outcome {body['outcome']!r}")
    if not _NAME_RE.match(body["event"]) or not _NAME_RE.match(body["source"]):
        raise AuditFormatError("event and source must be short lowercase names")
    fpr = body["key_fingerprint"]
    if fpr is not None and not _FINGERPRINT_RE.match(fpr):
        raise AuditFormatError("key_fingerprint must be 64 lowercase hex digits")
    for name in ("tenant", "actor", "request_id", "key_id", "state_from", "state_to"):
        if body[name] is not None and len(body[name]) > MAX_DETAIL_STR:
            raise AuditFormatError(f"field {name!r} too long")
    _check_detail(body["detail"])
