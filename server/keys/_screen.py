"""Screening of uploaded evaluation keys: size first, then parse, then refuse any secret key.

The server must never hold a client's secret key (DESIGN.md section 5). The upload endpoint calls
:func:`screen_evaluation_key` before anything else touches the bytes. Parsing untrusted bytes runs
native code: pass ``inspect=`` a function that runs :func:`tenseal_inspect` in a worker process to
keep a crash out of the server (the default runs in-process).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import rfc8785

from ._errors import KeyTooLargeError, MalformedKeyError, SecretKeyUploadError

__all__ = ["EvalKeyInfo", "Inspection", "screen_evaluation_key", "tenseal_inspect"]


@dataclass(frozen=True)
class Inspection:
    """What an inspector learned from a parsed key: does it hold a secret, and its parameters hash."""

    has_secret_key: bool
    params_hash: str


@dataclass(frozen=True)
class EvalKeyInfo:
    """An accepted upload: SHA-256 of its exact bytes, parameters hash, size."""

    fingerprint: str
    params_hash: str
    size: int


def tenseal_inspect(data: bytes) -> Inspection:
    """Parse a serialized TenSEAL context and report ``is_private()`` and a parameters hash.

    Raises:
        MalformedKeyError: the bytes are not a TenSEAL context.
    """
    import tenseal as ts

    try:
        ctx = ts.context_from(data)
        private = bool(ctx.is_private()) or bool(ctx.has_secret_key())
        seal = ctx.seal_context().data
        parms = seal.key_context_data().parms()
        params = {
            "backend": "tenseal",
            "scheme": str(parms.scheme()),
            "n": int(parms.poly_modulus_degree()),
            "parms_id": [f"{int(x):016x}" for x in seal.key_parms_id()],
        }
    except Exception as exc:  # native parser: any failure means "not a key we accept"
        raise MalformedKeyError("not a serialized TenSEAL context") from exc
    finally:
        ctx = None  # drop the native object (and any secret in it) now
    return Inspection(private, hashlib.sha256(rfc8785.dumps(params)).hexdigest())


def screen_evaluation_key(
    data: bytes, *, max_bytes: int, inspect: Callable[[bytes], Inspection] = tenseal_inspect
) -> EvalKeyInfo:
    """Accept public evaluation-key bytes or raise an :class:`UploadRefusedError`.

    Args:
        data: the exact uploaded bytes.
        max_bytes: size limit, enforced before parsing.
        inspect: parser; must raise :class:`MalformedKeyError` for garbage.

    Raises:
        KeyTooLargeError, MalformedKeyError, SecretKeyUploadError.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedKeyError(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise KeyTooLargeError(f"{len(data)} bytes exceeds the {max_bytes}-byte limit")
    if len(data) == 0:
        raise MalformedKeyError("empty upload")
    data = bytes(data)
    result = inspect(data)
    if not isinstance(result, Inspection):
        raise MalformedKeyError("inspector returned no result")
    if result.has_secret_key:
        raise SecretKeyUploadError(
            "the upload contains a secret key; only public evaluation keys are accepted"
        )
    return EvalKeyInfo(hashlib.sha256(data).hexdigest(), result.params_hash, len(data))
