"""The SEAL backend's wire format: CKKS ciphertexts and public keys in a small versioned blob envelope.

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
from dataclasses import dataclass

from fhe.backends.seal import hazmat as seal
from fhe.backends.seal.keys import CKKSClient, ServerKeys
from fhe.errors import (
    KeyMismatchError,
    KeyRefusedError,
    SecretKeyRefusedError,
    ShapeError,
    SizeLimitError,
    WireError,
)
from fhe.fingerprint import PUBLIC_BLOBS, key_fingerprint, level_blob_name, params_hash, split_blob_name
from fhe.params import CKKSParams, KeyLevels

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
    return _head(kind, params, fingerprint, len(payload)) + payload


def _head(kind: str, params: CKKSParams, fingerprint: str | None, length: int) -> bytes:
    fp = bytes.fromhex(fingerprint) if fingerprint else bytes(32)
    return _HEAD.pack(MAGIC, WIRE_VERSION, KINDS[kind], bytes.fromhex(params_hash(params)), fp, length)


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
        # a plan change (e.g. the default plan's ring or prime chain) makes old key sets useless: say so
        raise KeyMismatchError(f"{kind} was made for other CKKS parameters than this plan's (N = "
                               f"{params.poly_modulus_degree}, {len(params.coeff_mod_bit_sizes)} primes, "
                               f"params {params_hash(params)[:16]}...): make keys for the current manifest")
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


def pack_ciphertext(payload: bytes, params: CKKSParams, fingerprint: str) -> bytes:
    """A ciphertext the server serialized itself in SEAL's format (the gpu backend's uncompressed
    ``serialize``) in the wire envelope, as :func:`dump_ciphertext` would put it: SEAL loads either form,
    and this one skips a SEAL load and a zstd pass (a level-1 result does not compress anyway)."""
    return _pack("ciphertext", params, fingerprint, payload)


def encrypt_to_wire(client: CKKSClient, values, *, seeded: bool = True, zero=None) -> bytes:
    """Client: encrypt and serialize in SEAL's seeded form (about half the bytes of a full ciphertext).

    ``seeded=False``: the full ciphertext (c1 expanded, SEAL's zstd serialization, ~2x the bytes), for a
    server that asks for it (manifest ``offload.mlp.upload = "full"``, the offload plan's linear steps on gpu
    workers; ``upload = "full"``, attention steps on CUDA workers until their seeded expansion is checked on a
    card: docs/protocol.md "upload").

    ``zero``: an unused encryption of zero of this key set made ahead, whose randomness the ciphertext takes
    (the object is consumed): :meth:`CKKSClient.encrypt_zero_seeded` for the seeded form
    (:meth:`CKKSClient.encrypt_onto_seeded`), :meth:`CKKSClient.encrypt_zero` for the full one
    (:meth:`CKKSClient.encrypt_onto`).
    """
    if zero is not None:
        if seeded:
            return _pack("ciphertext", client.params, client.fingerprint, client.encrypt_onto_seeded(values, zero))
        return _pack("ciphertext", client.params, client.fingerprint,
                     seal.to_bytes(client.encrypt_onto(values, zero)))
    if seeded:
        return _pack("ciphertext", client.params, client.fingerprint, client.encrypt_bytes(values))
    return _pack("ciphertext", client.params, client.fingerprint, seal.to_bytes(client.encrypt(values)))


def ciphertext_payload(data: bytes, params: CKKSParams, fingerprint: str, *, limit: int | None = None) -> bytes:
    """The envelope checks of :func:`load_ciphertext` (size, magic, version, kind, length, parameter hash, key
    fingerprint, SEAL's header) without SEAL's load: the SEAL payload, for a backend that parses it itself
    (the gpu backend's :meth:`~fhe.backends.gpu.evaluator.GpuEvaluator.deserialize_fresh`)."""
    return _unpack(data, "ciphertext", params, fingerprint, limit)


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
    return {name: _pack(_kind(name), client.params, None, blob) for name, blob in client.public_blobs.items()}


def unpack_public_keys(blobs: Mapping[str, bytes], params: CKKSParams) -> dict[str, bytes]:
    """Inverse of :func:`dump_public_keys` (envelopes checked): the raw SEAL blobs by name."""
    return {name: _unpack(data, _kind(name), params, None, None) for name, data in blobs.items()}


def public_key_sizes(blobs: Mapping[str, bytes]) -> dict[str, int]:
    """Bytes per public blob (what the benchmark reports)."""
    return {k: len(v) for k, v in blobs.items()}


def expected_blobs(levels: KeyLevels | None) -> tuple[str, ...]:
    """The blob names an upload must hold: :data:`PUBLIC_BLOBS` without levels, else the public key,
    ``relin_keys@<relin level>`` and one ``galois_keys@L`` per level the plan makes keys at."""
    if levels is None:
        return PUBLIC_BLOBS
    return ("public_key", level_blob_name("relin_keys", levels.relin),
            *(level_blob_name("galois_keys", lv) for lv in levels.levels()))


def _kind(name: str) -> str:
    parsed = split_blob_name(name)
    if parsed is None:
        raise KeyRefusedError(f"not a public evaluation key: {name[:32]!r}")
    return parsed[0]


def _levels_of(rotation_steps: Iterable[int] | KeyLevels) -> KeyLevels | None:
    return rotation_steps if isinstance(rotation_steps, KeyLevels) else None


@dataclass(frozen=True)
class ParsedKeys:
    """A key upload that passed the allow-list: the loaded keys and their canonical serialization.

    ``canonical`` holds each blob re-serialized from the parsed SEAL object (in its envelope): the only
    bytes a server stores. SEAL ignores bytes after the object it reads (a zstd skippable frame, or plain
    trailing bytes inside the declared size), so the uploaded bytes themselves are never kept.
    """

    keys: ServerKeys
    canonical: dict[str, bytes]


def parse_server_keys(blobs: Mapping[str, bytes], params: CKKSParams, rotation_steps: Iterable[int] | KeyLevels,
                      *, limits: Mapping[str, int] | None = None, fingerprint: str | None = None,
                      canonical: bool = True) -> ParsedKeys:
    """Server: parse an untrusted key upload against an allow-list.

    Exactly the blobs :func:`expected_blobs` names, each in an envelope of its own kind, made for
    ``params``, that SEAL loads as that type at the key level of its chain (the full chain, or for
    ``galois_keys@L``/``relin_keys@L`` the chain that stops at level L); relinearization keys for the
    square only; Galois keys for exactly the plan's rotations at each level. Anything else is refused.

    Args:
        rotation_steps: the plan's :class:`fhe.params.KeyLevels` (a level-aware upload is required), or
            plain steps (one top-level ``relin_keys``/``galois_keys`` pair: tests and tools).
        limits: bytes per blob kind (``galois_keys`` bounds each level's blob).
        fingerprint: the key set's fingerprint when ``blobs`` are a canonical re-serialization (it names
            the client's original bytes); None: computed from ``blobs``.
        canonical: also re-serialize the parsed objects (what a registry stores).

    Raises:
        SecretKeyRefusedError: a secret-key blob (by name or kind). KeyRefusedError: any other blob outside
        the allow-list (a key at a level the plan does not use among them). KeyMismatchError: other
        parameters, or an upload without level-aware keys for a plan that needs them. WireError: a blob
        missing or malformed.
    """
    levels = _levels_of(rotation_steps)
    _check_names(blobs, levels)
    limits = dict(limits or {})
    payloads = {name: _unpack(blobs[name], _kind(name), params, None, limits.get(_kind(name)))
                for name in expected_blobs(levels)}
    keys = keys_from_payloads(payloads, seal.Kit(params), rotation_steps, fingerprint=fingerprint)
    canon = {name: b"".join(parts) for name, parts in canonical_parts(keys).items()} if canonical else {}
    return ParsedKeys(keys, canon)


def canonical_parts(keys: ServerKeys) -> dict[str, tuple[bytes, bytes]]:
    """Each loaded key object re-serialized by SEAL, as (envelope head, SEAL payload) by upload name: the
    canonical blobs of :class:`ParsedKeys` in two pieces, so that a whole upload body is written with one
    copy of the (hundreds of MB of) payloads (:func:`fhe.envelope.pack_key_upload` takes pieces)."""
    out = {}
    for name, obj in _objects(keys).items():
        payload = seal.to_bytes(obj)
        out[name] = (_head(_kind(name), keys.params, None, len(payload)), payload)
    return out


def _objects(keys: ServerKeys) -> dict[str, object]:
    """The loaded key objects by upload name (the inverse of the naming in :func:`expected_blobs`)."""
    if not keys.leveled:
        return {"public_key": keys.public, "relin_keys": keys.relin, "galois_keys": keys.galois}
    return {"public_key": keys.public, level_blob_name("relin_keys", keys.levels.relin): keys.relin,
            **{level_blob_name("galois_keys", lv): gk for lv, gk in keys.galois_levels.items()}}


def keys_from_payloads(payloads: Mapping[str, bytes], kit: seal.Kit, rotation_steps: Iterable[int] | KeyLevels, *,
                       fingerprint: str | None = None) -> ServerKeys:
    """SEAL payloads (no blob envelope) -> ServerKeys, through the same allow-list as
    :func:`parse_server_keys` (what :meth:`fhe.backends.seal.SealEvaluator.load_keys` calls)."""
    params = kit.params
    levels = _levels_of(rotation_steps)
    _check_names(payloads, levels, enveloped=False)
    objs = {name: _load_key_object(name, kit, payloads[name]) for name in expected_blobs(levels)}
    if levels is None:
        levels = KeyLevels.full(params, rotation_steps)
        galois = {kit.top: objs["galois_keys"]}
        relin = objs["relin_keys"]
    else:
        galois = {lv: objs[level_blob_name("galois_keys", lv)] for lv in levels.levels()}
        relin = objs[level_blob_name("relin_keys", levels.relin)]
    _check_key_counts(relin, galois, levels, params)
    return ServerKeys(kit, objs["public_key"], relin, galois, levels,
                      fingerprint or key_fingerprint(params, payloads), leveled=_levels_of(rotation_steps) is not None)


def load_server_keys(blobs: Mapping[str, bytes], params: CKKSParams, rotation_steps: Iterable[int] | KeyLevels,
                     *, limits: Mapping[str, int] | None = None, fingerprint: str | None = None) -> ServerKeys:
    """:func:`parse_server_keys` without the re-serialization: the keys only.

    Returns ServerKeys whose fingerprint is ``fingerprint`` or else computed from the SEAL bytes received
    (what the client and the audit log compute too).
    """
    return parse_server_keys(blobs, params, rotation_steps, limits=limits, fingerprint=fingerprint,
                             canonical=False).keys


def _check_names(blobs: Mapping[str, bytes], levels: KeyLevels | None, *, enveloped: bool = True) -> None:
    """Exactly the expected blob names; a secret key named anything, or carried under any name, refused;
    an upload of the other layout (with or without levels) refused with a message that says so."""
    for name, data in blobs.items():
        if name == "secret_key" or (enveloped and _kind_code(data) == KINDS["secret_key"]):
            raise SecretKeyRefusedError(f"the upload contains a secret key (blob {str(name)[:32]!r})")
    expected = set(expected_blobs(levels))
    extra, missing = set(blobs) - expected, expected - set(blobs)
    if extra or missing:
        _refuse_layout(extra, missing, levels)
    if enveloped:
        for name, data in blobs.items():
            code = _kind_code(data)
            if code is not None and code != KINDS[_kind(name)]:
                raise KeyRefusedError(f"{name} blob declares kind {_KIND_NAMES.get(code, code)!r}")


def _refuse_layout(extra: set[str], missing: set[str], levels: KeyLevels | None) -> None:
    foreign = sorted(str(n)[:32] for n in extra if split_blob_name(n) is None)
    if foreign:
        raise KeyRefusedError(f"the upload holds blobs that are not public evaluation keys: {foreign[:8]}")
    if levels is not None and extra & {"relin_keys", "galois_keys"}:
        raise KeyMismatchError("key upload without level-aware keys (one relin_keys/galois_keys pair at the key "
                               f"level): this plan's parameters need {sorted(missing)}; generate the keys again "
                               "with a current SDK")
    if levels is None and extra:
        raise KeyMismatchError(f"level-aware key upload {sorted(extra)[:8]}: these parameters take one "
                               "relin_keys/galois_keys pair")
    if extra:
        raise KeyRefusedError(f"keys at levels the plan does not use: {sorted(extra)[:8]} (expected "
                              f"{sorted(missing) or 'nothing more'})")
    raise WireError(f"key upload lacks {sorted(missing)}")


def _kind_code(data: bytes) -> int | None:
    if isinstance(data, (bytes, bytearray, memoryview)) and len(data) >= _HEAD.size:
        return _HEAD.unpack_from(data)[2]
    return None


def _load_key_object(name: str, kit: seal.Kit, payload: bytes):
    """The blob as exactly its named SEAL type at the key level of its chain; anything else is refused."""
    kind, level = split_blob_name(name)
    kc = kit.key_context(kit.top if level is None else level)
    try:
        obj = seal.from_bytes_in(kind, kc.context, payload)
    except WireError as exc:
        raise KeyRefusedError(f"{name} blob is not a valid {kind} for these parameters") from exc
    if list(obj.parms_id()) != kc.key_parms_id:
        raise KeyRefusedError(f"{name} is not at the key level of its parameter chain")
    return obj


def _check_key_counts(relin, galois: Mapping[int, object], levels: KeyLevels, params: CKKSParams) -> None:
    """Relin keys for the square only; Galois keys for exactly the plan's rotations (no more, no less) at
    each level."""
    if relin.size() != 1:
        raise KeyRefusedError(f"relin_keys holds {relin.size()} keys, expected 1")
    for level, gk in galois.items():
        elements = seal.galois_elements(levels.steps_at(level), params.slots)
        for elt in elements:
            if not gk.has_key(elt):
                raise KeyMismatchError(f"Galois key for element {elt} missing (level {level})")
        if gk.size() != len(elements):
            raise KeyRefusedError(f"galois keys at level {level} hold {gk.size()} keys; the plan uses "
                                  f"{len(elements)} there")


def refuse_private_tenseal_context(data: bytes) -> None:
    """For TenSEAL-format uploads: raise SecretKeyRefusedError if the context carries a secret key."""
    import tenseal as ts

    try:
        ctx = ts.context_from(data)
    except Exception as exc:  # TenSEAL raises bare Exceptions on bad protobufs
        raise WireError(f"not a TenSEAL context: {exc}") from exc
    if ctx.is_private():
        raise SecretKeyRefusedError("the TenSEAL context carries a secret key")
