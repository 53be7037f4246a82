"""Fuzzing the two binary parsers a client can reach: ``fhe.envelope.parse`` (encrypted steps) and
``fhe.envelope.parse_key_upload`` (key uploads). Any input gives a parsed value or an ``EnvelopeError``
— never another exception (issue 12: a header of ``[`` x 2000 escaped as RecursionError, a 500).

Time-bounded for 2 shared cores: each property runs a fixed number of examples (derandomized, so CI
is repeatable) and the whole module takes a few seconds.
"""

from __future__ import annotations

import json
import struct

import pytest
import rfc8785
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fhe.envelope import (
    ENVELOPE_VERSION,
    KEY_MAGIC,
    MAGIC,
    MAX_HEADER_BYTES,
    Envelope,
    EnvelopeError,
    pack_key_upload,
    parse,
    parse_key_upload,
)

LIMITS = dict(max_blob_bytes=1 << 16, max_total_bytes=1 << 18)
FUZZ = settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
_PREFIX = struct.Struct("<4sBI")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20)


def _frame(magic: bytes, head: bytes, tail: bytes = b"", version: int = ENVELOPE_VERSION) -> bytes:
    return _PREFIX.pack(magic, version, len(head)) + head + tail


def _valid_header() -> dict:
    return {"v": ENVELOPE_VERSION, "session": "s", "key_fingerprint": "f" * 64, "layer": 2, "kind": "decode",
            "positions": [0, 1], "sizes": [3]}


def _parse_or_typed_error(fn, *args):
    try:
        return fn(*args)
    except EnvelopeError:
        return None


@FUZZ
@given(st.binary(max_size=600))
def test_envelope_bytes(data):
    _parse_or_typed_error(parse, MAGIC + data[4:] if len(data) > 8 else data, *LIMITS.values())


@FUZZ
@given(st.sampled_from(list(_valid_header())), json_values, st.binary(max_size=64))
def test_envelope_header_field(field, value, blobs):
    head = _valid_header() | {field: value}
    raw = json.dumps(head).encode()
    if len(raw) <= MAX_HEADER_BYTES:
        env = _parse_or_typed_error(parse, _frame(MAGIC, raw, blobs), *LIMITS.values())
        assert env is None or isinstance(env, Envelope)


@FUZZ
@given(json_values, st.binary(max_size=64))
def test_envelope_any_json_header(head, blobs):
    raw = json.dumps(head).encode()[:MAX_HEADER_BYTES]
    _parse_or_typed_error(parse, _frame(MAGIC, raw, blobs), *LIMITS.values())


@FUZZ
@given(st.binary(max_size=600))
def test_key_upload_bytes(data):
    _parse_or_typed_error(parse_key_upload, KEY_MAGIC + data[4:] if len(data) > 8 else data, 1 << 18)


@FUZZ
@given(json_values, json_values, json_values, st.binary(max_size=64))
def test_key_upload_header(v, names, sizes, blobs):
    raw = json.dumps({"v": v, "names": names, "sizes": sizes}).encode()[:MAX_HEADER_BYTES]
    out = _parse_or_typed_error(parse_key_upload, _frame(KEY_MAGIC, raw, blobs), 1 << 18)
    assert out is None or all(isinstance(k, str) and isinstance(b, bytes) for k, b in out.items())


@pytest.mark.parametrize("depth", [100, 2000, MAX_HEADER_BYTES])
@pytest.mark.parametrize("kind", ["envelope", "key upload"])
def test_deeply_nested_header_is_a_typed_error(depth, kind):
    head = b"[" * depth
    with pytest.raises(EnvelopeError):
        if kind == "envelope":
            parse(_frame(MAGIC, head), *LIMITS.values())
        else:
            parse_key_upload(_frame(KEY_MAGIC, head), 1 << 18)


def test_header_version_is_checked():
    body = Envelope("s", "f" * 64, 2, "decode", (0, 1), (b"abc",)).to_bytes()
    assert parse(body, **LIMITS).blobs == (b"abc",)
    head = rfc8785.dumps(_valid_header() | {"v": 2})
    with pytest.raises(EnvelopeError, match="version"):
        parse(_frame(MAGIC, head, b"abc"), **LIMITS)
    upload = pack_key_upload({"public_key": b"pk"})
    assert parse_key_upload(upload, 1 << 18) == {"public_key": b"pk"}
    for v in (2, True, "1", None):
        head = rfc8785.dumps({"v": v, "names": ["public_key"], "sizes": [2]})
        with pytest.raises(EnvelopeError):
            parse_key_upload(_frame(KEY_MAGIC, head, b"pk"), 1 << 18)


@pytest.mark.parametrize("head", [
    {"v": 1, "names": ["a", "a"], "sizes": [1, 1]}, {"v": 1, "names": [["a"]], "sizes": [1]},
    {"v": 1, "names": ["a"], "sizes": [1e400]}, {"v": 1, "names": ["a"], "sizes": [True]},
    {"v": 1, "names": "ab", "sizes": [1, 1]}, {"v": 1, "names": ["a"], "sizes": [-1]},
])
def test_key_upload_header_shapes(head):
    raw = json.dumps(head).encode()
    with pytest.raises(EnvelopeError):
        parse_key_upload(_frame(KEY_MAGIC, raw, b"xx"), 1 << 18)
