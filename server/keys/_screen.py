"""Screening of uploaded evaluation keys: an inspector parses, the registry decides on its verdict.

The server must never hold a client's secret key (DESIGN.md section 5). Screening is split in two:

* an **inspector** parses the untrusted bytes and returns an :class:`Inspection` — data, never a
  callback. The production inspector is :func:`inspect_upload`: the SEAL wire format's allow-list
  (``fhe.backends.seal.wire``) for the server's CKKS parameters and rotations. It runs native code, so
  the service runs it in a worker process (``server.private.compute``);
* :func:`screen_evaluation_key` (and the registry, which calls it) is pure: it checks the size and
  turns the verdict into an accepted :class:`EvalKeyInfo` or a typed refusal.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ._errors import KeyTooLargeError, MalformedKeyError, SecretKeyUploadError

__all__ = ["EvalKeyInfo", "Inspection", "Verdict", "inspect_upload", "inspect_upload_keys", "screen_evaluation_key"]


class Verdict(str, enum.Enum):
    """What an inspector concluded about one upload."""

    PUBLIC = "public"           # exactly the public evaluation keys the server's parameters need
    SECRET_KEY = "secret_key"   # carries a secret key, or a blob outside the allow-list (which could)
    MALFORMED = "malformed"     # does not parse, or was made for other parameters or rotations


@dataclass(frozen=True)
class Inspection:
    """An inspector's result: the verdict, what an accepted upload parsed to, a safe reason.

    Attributes:
        verdict: the :class:`Verdict`.
        params_hash: SHA-256 of the CKKS parameters the keys were made for (``PUBLIC`` only).
        canonical: ``PUBLIC`` only: the parsed keys re-serialized (a ``CLMK`` upload of the same blobs,
            written from the loaded SEAL objects). The registry stores these bytes, never the upload:
            SEAL ignores bytes after the object it reads, so an upload can smuggle anything there.
        key_set: ``PUBLIC`` only: the key-set fingerprint of the upload as sent
            (:func:`fhe.fingerprint.key_fingerprint`, what the client's ciphertexts name); loading
            ``canonical`` keeps it.
        reason: why the upload was refused, safe to show its sender (never key bytes).
    """

    verdict: Verdict
    params_hash: str = ""
    reason: str = ""
    canonical: bytes = field(default=b"", repr=False)
    key_set: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "verdict", Verdict(self.verdict))
        if self.verdict is Verdict.PUBLIC and not (self.params_hash and self.canonical and self.key_set):
            raise ValueError("a PUBLIC inspection names the parameters hash, the canonical bytes and the "
                             "key-set fingerprint of the keys")


@dataclass(frozen=True)
class EvalKeyInfo:
    """An accepted upload: SHA-256 of its exact bytes, parameters hash, size, and what is stored: the
    inspection's canonical bytes (with their SHA-256) and the key-set fingerprint."""

    fingerprint: str
    params_hash: str
    size: int
    canonical: bytes = field(default=b"", repr=False)
    canonical_sha256: str = ""
    key_set: str = ""


def inspect_upload(data: bytes, params: Any, rotation_steps: Iterable[int], *, max_bytes: int) -> Inspection:
    """The production inspector: parse a ``CLMK`` key upload through the SEAL wire allow-list.

    Exactly ``public_key``, ``relin_keys`` and ``galois_keys`` for ``params`` and exactly the plan's
    ``rotation_steps`` are ``PUBLIC`` (with the keys re-serialized from the parsed objects: what is
    stored); a secret-key blob (by name or kind), any other blob, or a TenSEAL
    context with a secret key are ``SECRET_KEY``; anything else is ``MALFORMED``. Never raises for bad
    bytes. Runs SEAL's parser: call it in a worker process.

    Args:
        data: the exact uploaded bytes.
        params: the server's :class:`fhe.params.CKKSParams`.
        rotation_steps: the Galois rotations the server's plan uses.
        max_bytes: size limit of the whole upload.
    """
    return inspect_upload_keys(data, params, rotation_steps, max_bytes=max_bytes)[0]


def inspect_upload_keys(data: bytes, params: Any, rotation_steps: Iterable[int], *,
                        max_bytes: int) -> tuple[Inspection, Any]:
    """:func:`inspect_upload`, and the parsed :class:`fhe.backends.seal.keys.ServerKeys` of a ``PUBLIC``
    verdict (None otherwise): the objects ``canonical`` was written from, so the worker that screened an
    upload can keep them when the registry's record of those bytes is loaded there, instead of parsing its
    own serialization again (``server.private.compute.PrivateCompute.load_screened_key``)."""
    from fhe.backends.seal import wire
    from fhe.envelope import EnvelopeError, pack_key_upload, parse_key_upload
    from fhe.errors import FHEError, KeyMismatchError, SecretKeyRefusedError
    from fhe.fingerprint import params_hash

    try:
        blobs = parse_key_upload(data, max_bytes)
    except EnvelopeError as exc:
        return _not_an_upload(data, exc), None
    try:
        keys = wire.parse_server_keys(blobs, params, rotation_steps, canonical=False).keys
    except SecretKeyRefusedError as exc:  # KeyRefusedError too: a blob outside the allow-list
        return Inspection(Verdict.SECRET_KEY, reason=str(exc)[:200]), None
    except KeyMismatchError as exc:
        return Inspection(Verdict.MALFORMED, reason=f"key does not fit the plan: {exc}"[:200]), None
    except FHEError as exc:
        return Inspection(Verdict.MALFORMED, reason=f"not a public-key upload: {exc}"[:200]), None
    # canonical: re-serialized from the parsed objects, written into the body in one copy
    return Inspection(Verdict.PUBLIC, params_hash(params), canonical=pack_key_upload(wire.canonical_parts(keys)),
                      key_set=keys.fingerprint), keys


def _not_an_upload(data: bytes, exc: Exception) -> Inspection:
    """Bytes without the upload framing: a TenSEAL context with a secret key is refused as such."""
    from fhe.backends.seal import wire
    from fhe.errors import FHEError, SecretKeyRefusedError

    try:
        wire.refuse_private_tenseal_context(data)
    except SecretKeyRefusedError:
        return Inspection(Verdict.SECRET_KEY, reason="a TenSEAL context carrying a secret key")
    except FHEError:
        pass
    return Inspection(Verdict.MALFORMED, reason=f"not a cipherlm public-key upload: {exc}"[:200])


def screen_evaluation_key(data: bytes, inspection: Inspection, *, max_bytes: int) -> EvalKeyInfo:
    """Accept public evaluation-key bytes on an inspector's verdict, or raise an UploadRefusedError.

    Args:
        data: the exact uploaded bytes (the fingerprint is their SHA-256).
        inspection: what the inspector concluded about exactly these bytes.
        max_bytes: size limit, checked first.

    Raises:
        KeyTooLargeError, MalformedKeyError, SecretKeyUploadError.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedKeyError(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise KeyTooLargeError(f"{len(data)} bytes exceeds the {max_bytes}-byte limit")
    if len(data) == 0:
        raise MalformedKeyError("empty upload")
    if not isinstance(inspection, Inspection):
        raise TypeError(f"expected an Inspection, got {type(inspection).__name__}")
    if inspection.verdict is Verdict.SECRET_KEY:
        raise SecretKeyUploadError(
            "the upload contains a secret key; only public evaluation keys are accepted"
        )
    if inspection.verdict is Verdict.MALFORMED:
        raise MalformedKeyError(inspection.reason or "not a parsable evaluation key")
    return EvalKeyInfo(hashlib.sha256(bytes(data)).hexdigest(), inspection.params_hash, len(data),
                       inspection.canonical, hashlib.sha256(inspection.canonical).hexdigest(), inspection.key_set)
