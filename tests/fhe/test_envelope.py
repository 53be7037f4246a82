"""The private-protocol envelope: round trip and every malformed-input path."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fhe import envelope
from fhe.envelope import MAGIC, Envelope, EnvelopeError, parse

LIMITS = dict(max_blob_bytes=1 << 20, max_total_bytes=4 << 20)


def make(blobs=(b"abc", b"")) -> Envelope:
    return Envelope("sess-1", "ab" * 32, 3, "decode", (17, 1), tuple(blobs))


def test_round_trip():
    env = make()
    data = env.to_bytes()
    assert parse(data, **LIMITS) == env
    assert env.nbytes == len(data)


@given(st.binary(max_size=300))
def test_garbage_is_a_typed_error(data):
    try:
        parse(data, **LIMITS)
    except EnvelopeError:
        pass


@given(st.integers(min_value=0, max_value=200), st.binary(min_size=1, max_size=8))
def test_any_corruption_is_a_typed_error_or_a_valid_envelope(i, junk):
    data = bytearray(make().to_bytes())
    data[i % len(data):i % len(data) + len(junk)] = junk
    try:
        env = parse(bytes(data), **LIMITS)
    except EnvelopeError:
        return
    assert isinstance(env, Envelope)


def test_limits_checked_before_reading_blobs():
    big = make((b"x" * 2000,)).to_bytes()
    with pytest.raises(EnvelopeError, match="exceeds") as e:
        parse(big, max_blob_bytes=1000, max_total_bytes=1 << 20)
    assert e.value.too_large
    with pytest.raises(EnvelopeError, match="body of"):
        parse(big, max_blob_bytes=1 << 20, max_total_bytes=100)


@pytest.mark.parametrize("mutate, match", [
    (lambda d: b"XXXX" + d[4:], "magic"),
    (lambda d: d[:4] + b"\x09" + d[5:], "version"),
    (lambda d: d[:5] + struct.pack("<I", 10**6) + d[9:], "header length"),
    (lambda d: d + b"extra", "add up"),
    (lambda d: d[:-1], "add up"),
])
def test_malformed(mutate, match):
    with pytest.raises(EnvelopeError, match=match):
        parse(mutate(make().to_bytes()), **LIMITS)


def test_header_field_types():
    head = b'{"v":1,"session":"s","key_fingerprint":"f","layer":"3","kind":"decode","positions":[0,1],"sizes":[]}'
    body = MAGIC + bytes([1]) + struct.pack("<I", len(head)) + head
    with pytest.raises(EnvelopeError, match="layer"):
        parse(body, **LIMITS)


def test_backend_and_parameters_travel_and_default_to_seal():
    env = Envelope("s", "ab" * 32, 3, "decode", (1, 1), (b"x",), "gpu", "cd" * 32)
    assert parse(env.to_bytes(), **LIMITS) == env
    old = make()                                  # an envelope that states neither
    head = old.header()
    del head["backend"], head["params"]
    import rfc8785

    raw = rfc8785.dumps(head)
    body = struct.pack("<4sBI", MAGIC, 1, len(raw)) + raw + b"".join(old.blobs)
    got = parse(body, **LIMITS)
    assert (got.backend, got.params) == ("seal", "")


@pytest.mark.parametrize("backend,params", [("", ""), ("x" * 33, ""), (3, ""), ("seal", "zz" * 32),
                                            ("seal", "ab")])
def test_bad_backend_fields_are_refused(backend, params):
    env = Envelope("s", "ab" * 32, 3, "decode", (1, 1), (b"x",), backend, params)
    with pytest.raises(EnvelopeError):
        parse(env.to_bytes(), **LIMITS)


def test_a_backend_or_parameter_mismatch_is_a_typed_error():
    from fhe.backends import check_backend, describe
    from fhe.errors import BackendMismatchError
    from fhe.params import CKKSParams

    params, other = CKKSParams(8192, (60, 40, 40, 60), 40), CKKSParams(16384, (60, 40, 40, 60), 40)
    desc = describe(params)
    check_backend("seal", desc["params_hash"], name="seal", params=params)
    check_backend("seal", "", name="seal", params=params)            # not stated: not checked
    with pytest.raises(BackendMismatchError):
        check_backend("gpu", desc["params_hash"], name="seal", params=params)
    with pytest.raises(BackendMismatchError, match="N = 16384"):
        check_backend("seal", desc["params_hash"], name="seal", params=other)


def test_a_reader_may_take_more_blobs_and_the_header_bound_grows_with_them():
    """A server whose largest step carries more than MAX_BLOBS ciphertexts (an offload chunk step, a large
    ``max_step_tokens``) passes its bound; the default still refuses such a message, and the header may
    grow only by the sizes' share."""
    n = 1000
    body = Envelope("s", "fp", 0, "prefill", (0, n), tuple(bytes([i % 251]) * 10000 for i in range(n))).to_bytes()
    head_len = int.from_bytes(body[5:9], "little")
    assert head_len > envelope.MAX_HEADER_BYTES   # the sizes alone outgrow the default header bound
    with pytest.raises(EnvelopeError, match="header length"):
        parse(body, 1 << 20, 1 << 30)
    with pytest.raises(EnvelopeError, match=f"at most {n - 1} ints"):
        parse(body, 1 << 20, 1 << 30, max_blobs=n - 1)
    env = parse(body, 1 << 20, 1 << 30, max_blobs=n)
    assert len(env.blobs) == n and env.blobs[n - 1] == bytes([(n - 1) % 251]) * 10000
    padded = _with_header_len(body, envelope.header_limit(n) + 1)
    with pytest.raises(EnvelopeError, match="header length"):
        parse(padded, 1 << 20, 1 << 30, max_blobs=n)


def _with_header_len(body: bytes, head_len: int) -> bytes:
    """``body`` with its header padded by JSON whitespace to ``head_len`` bytes."""
    old = int.from_bytes(body[5:9], "little")
    head = body[9:9 + old] + b" " * (head_len - old)
    return body[:5] + head_len.to_bytes(4, "little") + head + body[9 + old:]
