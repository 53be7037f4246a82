"""Binary serialization of CKKS ciphertexts and public keys, in a small versioned blob envelope.

One blob (the unit ``fhe.envelope`` carries; the protocol message wraps several)::

    magic        b"CLMC"            4 bytes
    version      u8                 (WIRE_VERSION)
    kind         u8                 1 ciphertext, 2 public key, 3 relin keys, 4 Galois keys (5: secret key,
                                    always refused)
    params hash  32 bytes           sha256 of the canonical CKKS parameter JSON (fhe.fingerprint)
    key fp       32 bytes           fingerprint of the key set the ciphertext belongs to (zeros for keys)
    length       u64 LE             payload bytes
    payload                         SEAL's own serialization (zstd; seeded for client ciphertexts)

Checks happen in this order, all before SEAL sees a byte: total size against the kind's limit
(:class:`SizeLimitError`), magic/version/kind/length (:class:`WireError`), parameter hash and key
fingerprint (:class:`KeyMismatchError`), SEAL's 16-byte header (declared size == payload length).
Then SEAL loads and validates the object against the context; its exceptions become WireError.
A ciphertext made under another key *with the same fingerprint forged* cannot be detected by any
format check: it decrypts to noise on the client (documented in docs/fhe.md).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping

from fhe.ckks import CKKSClient, ServerKeys
from fhe.errors import KeyMismatchError, SecretKeyRefusedError, ShapeError, SizeLimitError, WireError
from fhe.fingerprint import key_fingerprint, params_hash
from fhe.hazmat import seal
from fhe.params import CKKSParams

MAGIC = b"CLMC"
WIRE_VERSION = 1
KINDS = {"ciphertext": 1, "public_key": 2, "relin_keys": 3, "galois_keys": 4, "secret_key": 5}
_KIND_NAMES = {v: k for k, v in KINDS.items()}
_HEAD = struct.Struct("<4sBB32s32sQ")
_SEAL_HEAD = struct.Struct("<HBBBBHQ")   # magic 0xA15E, header size, major, minor, compr mode, reserved, size
SEAL_MAGIC = 0xA15E
#: Default limits per kind (bytes, whole blob). A top-level ciphertext at N=32768 is ~3.5 MB.
DEFAULT_LIMITS = {"ciphertext": 16 << 20, "public_key": 16 << 20, "relin_keys": 256 << 20,
                  "galois_keys": 1 << 30}


def _pack(kind: str, params: CKKSParams, fingerprint: str | None, payload: bytes) -> bytes:
    fp = bytes.fromhex(fingerprint) if fingerprint else bytes(32)
    return _HEAD.pack(MAGIC, WIRE_VERSION, KINDS[kind], bytes.fromhex(params_hash(params)), fp,
                      len(payload)) + payload


def _unpack(data: bytes, kind: str, params: CKKSParams, fingerprint: str | None,
            limit: int | None) -> bytes:
    """Validate the envelope of ``data`` for ``kind``; return the SEAL payload (not yet parsed)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"expected bytes, got {type(data).__name__}")
    cap = DEFAULT_LIMITS[kind] if limit is None else limit
    if len(data) > cap:
        raise SizeLimitError(f"{kind} blob of {len(data)} bytes exceeds the limit of {cap}")
    if len(data) < _HEAD.size + _SEAL_HEAD.size:
        raise WireError(f"blob of {len(data)} bytes is too short")
    magic, version, code, p_hash, fp, length = _HEAD.unpack_from(data)
    if magic != MAGIC or version != WIRE_VERSION:
        raise WireError("not a cipherlm CKKS blob (bad magic or version)")
    if code == KINDS["secret_key"]:
        raise SecretKeyRefusedError("refusing a secret-key blob")
    if _KIND_NAMES.get(code) != kind:
        raise WireError(f"expected a {kind} blob, got kind {_KIND_NAMES.get(code, code)!r}")
    if length != len(data) - _HEAD.size:
        raise WireError(f"declared payload length {length} != {len(data) - _HEAD.size}")
    if p_hash.hex() != params_hash(params):
        raise KeyMismatchError(f"{kind} was made for other CKKS parameters")
    if fingerprint is not None and fp.hex() != fingerprint:
        raise KeyMismatchError(f"{kind} belongs to another key set")
    payload = bytes(data[_HEAD.size:])
    _check_seal_header(payload)
    return payload


def _check_seal_header(payload: bytes) -> None:
    magic, head_size, _major, _minor, _mode, _res, size = _SEAL_HEAD.unpack_from(payload)
    if magic != SEAL_MAGIC or head_size != _SEAL_HEAD.size or size != len(payload):
        raise WireError("payload is not one well-formed SEAL object")


# --- ciphertexts -------------------------------------------------------------------------------
def dump_ciphertext(ct: seal.Ciphertext, params: CKKSParams, fingerprint: str) -> bytes:
    """Serialize a ciphertext (server results, or client inputs made with :meth:`CKKSClient.encrypt`)."""
    return _pack("ciphertext", params, fingerprint, seal.to_bytes(ct))


def encrypt_to_wire(client: CKKSClient, values) -> bytes:
    """Client: encrypt and serialize in SEAL's seeded form (about half the bytes of a full ciphertext)."""
    return _pack("ciphertext", client.params, client.fingerprint, client.encrypt_bytes(values))


def load_ciphertext(data: bytes, kit: seal.Kit, fingerprint: str, *, limit: int | None = None,
                    level: int | None = None) -> seal.Ciphertext:
    """Parse an untrusted ciphertext blob for ``kit`` and key set ``fingerprint``.

    Args:
        level: if given, the ciphertext must have exactly this many data primes (e.g. ``kit.top`` for
            a client input), else :class:`ShapeError`.
    """
    payload = _unpack(data, "ciphertext", kit.params, fingerprint, limit)
    ct = seal.from_bytes("ciphertext", kit, payload)
    if ct.size() != 2:
        raise ShapeError(f"ciphertext of size {ct.size()} (expected 2)")
    if level is not None and ct.coeff_modulus_size() != level:
        raise ShapeError(f"ciphertext at level {ct.coeff_modulus_size()}, expected {level}")
    return ct


# --- public keys --------------------------------------------------------------------------------
def dump_public_keys(client: CKKSClient) -> dict[str, bytes]:
    """The client's upload: public, relin and Galois keys, each in its envelope. Never the secret key."""
    return {name: _pack(name, client.params, None, blob) for name, blob in client.public_blobs.items()}


def unpack_public_keys(blobs: Mapping[str, bytes], params: CKKSParams) -> dict[str, bytes]:
    """Inverse of :func:`dump_public_keys` (envelopes checked): the raw SEAL blobs by name."""
    return {name: _unpack(data, name, params, None, None) for name, data in blobs.items()}


def public_key_sizes(blobs: Mapping[str, bytes]) -> dict[str, int]:
    """Bytes per public blob (what the benchmark reports)."""
    return {k: len(v) for k, v in blobs.items()}


def load_server_keys(blobs: Mapping[str, bytes], params: CKKSParams, rotation_steps: Iterable[int],
                     *, limits: Mapping[str, int] | None = None) -> ServerKeys:
    """Server: parse an untrusted key upload, refusing secret keys and missing Galois keys.

    Returns ServerKeys whose fingerprint is computed from the SEAL bytes received (what the client and
    the audit log compute too).
    """
    limits = dict(limits or {})
    if "secret_key" in blobs:
        raise SecretKeyRefusedError("the upload contains a secret key")
    missing = {"public_key", "relin_keys", "galois_keys"} - set(blobs)
    if missing:
        raise WireError(f"key upload lacks {sorted(missing)}")
    kit = seal.Kit(params)
    payloads = {name: _unpack(blobs[name], name, params, None, limits.get(name))
                for name in ("public_key", "relin_keys", "galois_keys")}
    objs = {name: seal.from_bytes(name, kit, p) for name, p in payloads.items()}
    steps = tuple(sorted({int(s) % params.slots for s in rotation_steps} - {0}))
    for elt in seal.galois_elements(steps, params.slots):
        if not objs["galois_keys"].has_key(elt):
            raise KeyMismatchError(f"Galois key for element {elt} missing")
    return ServerKeys(kit, objs["public_key"], objs["relin_keys"], objs["galois_keys"], steps,
                      key_fingerprint(params, payloads))


def refuse_private_tenseal_context(data: bytes) -> None:
    """For TenSEAL-format uploads: raise SecretKeyRefusedError if the context carries a secret key."""
    import tenseal as ts

    try:
        ctx = ts.context_from(data)
    except Exception as exc:  # TenSEAL raises bare Exceptions on bad protobufs
        raise WireError(f"not a TenSEAL context: {exc}") from exc
    if ctx.is_private():
        raise SecretKeyRefusedError("the TenSEAL context carries a secret key")
