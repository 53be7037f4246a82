"""The binary envelope of the private-session protocol (``docs/protocol.md``).

Layout of one message (request or response body)::

    magic  b"CLMF"            4 bytes
    version                   u8      (ENVELOPE_VERSION)
    header length             u32 LE  (<= header_limit(max_blobs))
    header                    canonical JSON (RFC 8785): session, key fingerprint, layer, kind,
                              positions [start, count], sizes [n_0, n_1, ...] of the blobs, and the
                              evaluator backend and parameter hash the blobs are made for (``backend``,
                              ``params``; optional on input: absent means ``seal`` and unchecked),
                              and for an offload plan's steps the layer ``part`` (absent means
                              ``attention``: envelopes of older SDKs parse unchanged)
    blobs                     concatenated; their lengths are the header's ``sizes``

Everything is checked before any blob reaches a deserializer: the magic, the version, the header
length, the header's fields and types, every blob size against its limit, and that the sizes add up
to exactly the body length. No blob content is interpreted here.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Mapping, Sequence

import rfc8785

from fhe.fingerprint import blob_order

MAGIC = b"CLMF"
ENVELOPE_VERSION = 1
MAX_HEADER_BYTES = 4096
#: Blobs a message may carry unless the reader allows more (``parse(max_blobs=...)``): a server allows what
#: its largest legal step carries (``max_step_tokens`` ciphertexts, or an offload step's chunk tiles).
MAX_BLOBS = 64
#: Header bytes each blob beyond MAX_BLOBS may add (its size as a JSON int and a comma).
_BYTES_PER_SIZE = 16
_PREFIX = struct.Struct("<4sBI")
#: ``verify``: a speculative step (one ciphertext per position, the cache may be rolled back within it);
#: ``rollback``: no blobs, positions ``[keep, dropped]``: the layer's cache back to ``keep`` positions.
KINDS = ("prefill", "decode", "packed", "result", "verify", "rollback")
#: Which part of a layer a step runs (docs/protocol.md, "Offload steps"); ``attention`` is the default and
#: is left out of the header, so an attention step's bytes are what they were before parts existed.
ATTENTION = "attention"
#: after it: the offload plan's linear steps, the last two those of a fused plan (:mod:`fhe.offload_fused`)
PARTS = (ATTENTION, "attn_qkv", "attn_o", "mlp_up", "mlp_down", "o_up", "down_qkv")


class EnvelopeError(ValueError):
    """A message is malformed or over a size limit (maps to HTTP 400/413)."""

    def __init__(self, message: str, too_large: bool = False) -> None:
        super().__init__(message)
        self.too_large = too_large


@dataclasses.dataclass(frozen=True)
class Envelope:
    """One protocol message: routing header + opaque blobs (serialized ciphertexts)."""

    session: str
    key_fingerprint: str
    layer: int
    kind: str
    positions: tuple[int, int]  # (first position, token count)
    blobs: tuple[bytes, ...]
    #: Backend whose ciphertext format the blobs are in (``fhe.backends``), and the SHA-256 of the CKKS
    #: parameter set (``fhe.fingerprint.params_hash``; "" = not stated). A mismatch is BackendMismatchError.
    backend: str = "seal"
    params: str = ""
    #: The part of the layer (:data:`PARTS`): the attention block, or an MLP half of an offload plan.
    part: str = ATTENTION

    def header(self) -> dict:
        head = {"v": ENVELOPE_VERSION, "session": self.session, "key_fingerprint": self.key_fingerprint,
                "layer": self.layer, "kind": self.kind, "positions": list(self.positions),
                "sizes": [len(b) for b in self.blobs], "backend": self.backend, "params": self.params}
        if self.part != ATTENTION:
            head["part"] = self.part
        return head

    def to_bytes(self) -> bytes:
        """Serialize (canonical header, so equal envelopes give equal bytes)."""
        head = rfc8785.dumps(self.header())
        return _PREFIX.pack(MAGIC, ENVELOPE_VERSION, len(head)) + head + b"".join(self.blobs)

    @property
    def nbytes(self) -> int:
        return _PREFIX.size + len(rfc8785.dumps(self.header())) + sum(len(b) for b in self.blobs)


def header_limit(max_blobs: int = MAX_BLOBS) -> int:
    """Header bytes allowed for a message of at most ``max_blobs`` blobs (MAX_HEADER_BYTES up to MAX_BLOBS)."""
    return MAX_HEADER_BYTES + _BYTES_PER_SIZE * max(0, max_blobs - MAX_BLOBS)


def parse(body: bytes, max_blob_bytes: int, max_total_bytes: int, *, views: bool = False,
          max_blobs: int = MAX_BLOBS) -> Envelope:
    """Parse and bound-check a message; raises EnvelopeError before touching any blob.

    ``max_blobs``: the most blobs the reader takes (the header's bound grows with it, :func:`header_limit`).
    ``views``: the blobs as read-only memoryviews of ``body`` instead of copies (the server's way: a prefill
    step's ~7 MB then reaches its worker without a copy here; ``body`` must then stay unchanged)."""
    if len(body) > max_total_bytes:
        raise EnvelopeError(f"body of {len(body)} bytes exceeds the limit of {max_total_bytes}", too_large=True)
    if len(body) < _PREFIX.size:
        raise EnvelopeError("body too short for an envelope")
    magic, version, head_len = _PREFIX.unpack_from(body)
    if magic != MAGIC:
        raise EnvelopeError("not a cipherlm envelope (bad magic)")
    if version != ENVELOPE_VERSION:
        raise EnvelopeError(f"envelope version {version} not supported (expected {ENVELOPE_VERSION})")
    if head_len > header_limit(max_blobs) or _PREFIX.size + head_len > len(body):
        raise EnvelopeError(f"bad header length {head_len}")
    head = _load_header(body[_PREFIX.size:_PREFIX.size + head_len], "header is not valid JSON")
    sizes = _check_header(head, max_blob_bytes, max_blobs)
    offset = _PREFIX.size + head_len
    if offset + sum(sizes) != len(body):
        raise EnvelopeError(f"blob sizes {sizes} do not add up to the body length {len(body)}")
    blobs, source = [], memoryview(body).toreadonly() if views else body
    for n in sizes:
        blobs.append(source[offset:offset + n])
        offset += n
    return Envelope(head["session"], head["key_fingerprint"], head["layer"], head["kind"],
                    tuple(head["positions"]), tuple(blobs), head.get("backend", "seal"), head.get("params", ""),
                    head.get("part", ATTENTION))


def _load_header(raw: bytes, message: str) -> object:
    """JSON of a header; every failure (bad UTF-8, bad JSON, nesting too deep for the parser) is an
    EnvelopeError. The header is bounded (:func:`header_limit`), but ``[`` x 4000 still exhausts Python's
    recursion limit inside ``json.loads``, hence the RecursionError."""
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise EnvelopeError(message) from exc


def _check_header(head: object, max_blob_bytes: int, max_blobs: int) -> list[int]:
    if not isinstance(head, dict):
        raise EnvelopeError("header must be a JSON object")
    types = {"v": int, "session": str, "key_fingerprint": str, "layer": int, "kind": str,
             "positions": list, "sizes": list}
    for name, typ in types.items():
        if not isinstance(head.get(name), typ) or isinstance(head.get(name), bool):
            raise EnvelopeError(f"header field {name!r} missing or not a {typ.__name__}")
    if head["v"] != ENVELOPE_VERSION:
        raise EnvelopeError(f"header version {head['v']} not supported (expected {ENVELOPE_VERSION})")
    _check_backend_fields(head)
    if head["kind"] not in KINDS:
        raise EnvelopeError(f"kind must be one of {KINDS}")
    if head.get("part", ATTENTION) not in PARTS:
        raise EnvelopeError(f"part must be one of {PARTS}")
    pos, sizes = head["positions"], head["sizes"]
    if len(pos) != 2 or not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in pos):
        raise EnvelopeError("positions must be [start, count] of non-negative ints")
    if len(sizes) > max_blobs or not all(isinstance(n, int) and not isinstance(n, bool) for n in sizes):
        raise EnvelopeError(f"sizes must be at most {max_blobs} ints")
    for n in sizes:
        if n < 0:
            raise EnvelopeError("blob sizes must be non-negative")
        if n > max_blob_bytes:
            raise EnvelopeError(f"blob of {n} bytes exceeds the limit of {max_blob_bytes}", too_large=True)
    return sizes


def _check_backend_fields(head: dict) -> None:
    backend, params = head.get("backend", "seal"), head.get("params", "")
    if not isinstance(backend, str) or not 0 < len(backend) <= 32:
        raise EnvelopeError("header field 'backend' must be a short string")
    if not isinstance(params, str) or (params and (len(params) != 64 or params.strip("0123456789abcdef"))):
        raise EnvelopeError("header field 'params' must be '' or a SHA-256 hex digest")


# --- key uploads ------------------------------------------------------------------------------------
KEY_MAGIC = b"CLMK"
KEY_NAMES = ("public_key", "relin_keys", "galois_keys")


def _check_key_header(head: object) -> tuple[list[str], list[int]]:
    """``names`` (distinct strings) and ``sizes`` (non-negative ints, one per name) of a key upload."""
    if not isinstance(head, dict) or head.get("v") != ENVELOPE_VERSION or isinstance(head.get("v"), bool):
        raise EnvelopeError("bad key-upload header (not a version-1 JSON object)")
    names, sizes = head.get("names"), head.get("sizes")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise EnvelopeError("bad key-upload header: names must be distinct strings")
    if (not isinstance(sizes, list) or len(sizes) != len(names)
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes)):
        raise EnvelopeError("bad key-upload header: sizes must be one non-negative int per name")
    return names, sizes


def pack_key_upload(blobs: Mapping[str, bytes | Sequence[bytes]]) -> bytes:
    """One upload body from the public key blobs (``fhe.backends.seal.wire.dump_public_keys``), in
    :func:`fhe.fingerprint.blob_order` (level-aware names such as ``galois_keys@12`` included).

    A blob may come as a sequence of pieces (``fhe.backends.seal.wire.canonical_parts``: envelope head,
    payload), concatenated in the body's one copy."""
    names = blob_order(blobs)
    parts = [(b,) if isinstance(b, (bytes, bytearray, memoryview)) else tuple(b) for b in (blobs[n] for n in names)]
    head = rfc8785.dumps({"v": ENVELOPE_VERSION, "names": names,
                          "sizes": [sum(len(p) for p in blob) for blob in parts]})
    return b"".join([_PREFIX.pack(KEY_MAGIC, ENVELOPE_VERSION, len(head)), head, *(p for blob in parts for p in blob)])


def parse_key_upload(body: bytes, max_total_bytes: int) -> dict[str, bytes]:
    """Split an upload into named blobs (bounds and names checked; blob contents untouched).

    Any name other than the public ones (:func:`fhe.fingerprint.split_blob_name`) — a ``secret_key``
    above all — is kept, so the caller can refuse it explicitly.
    """
    if len(body) > max_total_bytes:
        raise EnvelopeError(f"key upload of {len(body)} bytes exceeds {max_total_bytes}", too_large=True)
    if len(body) < _PREFIX.size:
        raise EnvelopeError("key upload too short")
    magic, version, head_len = _PREFIX.unpack_from(body)
    if magic != KEY_MAGIC or version != ENVELOPE_VERSION or head_len > MAX_HEADER_BYTES:
        raise EnvelopeError("not a cipherlm key upload")
    head = _load_header(body[_PREFIX.size:_PREFIX.size + head_len], "bad key-upload header")
    names, sizes = _check_key_header(head)
    offset = _PREFIX.size + head_len
    if offset + sum(sizes) != len(body):
        raise EnvelopeError("key-upload sizes do not add up to the body length")
    out = {}
    for name, n in zip(names, sizes, strict=True):
        out[str(name)] = body[offset:offset + n]
        offset += n
    return out
