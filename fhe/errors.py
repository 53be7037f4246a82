"""Exceptions of the encrypted computation core (``fhe`` CKKS backend, linear algebra, wire).

Hierarchy::

    FHEError                      base of everything raised here
    ├── ParameterError            a CKKS parameter set is invalid or not 128-bit secure
    ├── KeyMismatchError          material made under another key or context (fingerprint/parms mismatch)
    ├── SecretKeyRefusedError     a blob that would give the server a secret key
    │   └── KeyRefusedError       an upload blob outside the allow-list (name, kind, type, parameters)
    ├── ShapeError                wrong sizes: vector length, token count, slots, positions
    │   └── RollbackError         a KV-cache rollback beyond the cache or into committed positions
    ├── LevelError                a ciphertext is at the wrong level/scale for the operation
    ├── WireError                 bytes that do not parse (garbage, truncated, wrong kind/version)
    │   └── SizeLimitError        a blob over its size limit (checked before deserializing)
    ├── PlanMismatchError         a plan whose content hash does not match what the block was built for
    ├── BackendMismatchError      material or a request made for another evaluator backend or parameter set
    └── OutputRangeError          a decrypted block output that cannot be (overflow or tampering)

Foreign errors (SEAL's C++ exceptions surfacing as RuntimeError/ValueError through pybind11) are
translated to these in one place, :func:`fhe.backends.seal.hazmat.translate`.
"""

from __future__ import annotations


class FHEError(Exception):
    """Base class of the encrypted path's errors."""


class ParameterError(FHEError, ValueError):
    """A CKKS parameter set is invalid, or not secure at 128 bits."""


class KeyMismatchError(FHEError):
    """A ciphertext or key belongs to another key pair or another CKKS context."""


class SecretKeyRefusedError(FHEError):
    """Someone tried to hand secret-key material to the server side."""


class KeyRefusedError(SecretKeyRefusedError):
    """A key-upload blob outside the allow-list: an unexpected name or kind, bytes that do not parse as
    the named SEAL type, other parameters, Galois keys the plan does not use. Refused like a secret key,
    since it could carry one."""


class ShapeError(FHEError, ValueError):
    """Wrong sizes: vector length, number of tokens, positions out of range, cache full."""


class LevelError(FHEError):
    """A ciphertext is at the wrong level or scale (e.g. not a fresh input)."""


class WireError(FHEError, ValueError):
    """Bytes that do not deserialize: garbage, truncated, wrong kind or version."""


class SizeLimitError(WireError):
    """A blob exceeds its size limit; raised before any deserialization."""


class PlanMismatchError(FHEError):
    """A plan (or request) names a content hash other than the one the block was built from."""


class BackendMismatchError(FHEError):
    """Ciphertexts, keys or a request name another evaluator backend (``seal``, ``gpu``, ...) or another
    CKKS parameter set than the one serving them (a client error: HTTP 400/409, never a 500)."""


class OutputRangeError(FHEError):
    """A decrypted block output is impossible (a denominator <= 0 or not finite): the values overflowed
    the last prime or the ciphertext was tampered with."""


class RollbackError(ShapeError):
    """A rollback of an encrypted KV cache to a length it cannot return to: beyond the cache, or into
    positions committed before the last speculative (verify) step."""
