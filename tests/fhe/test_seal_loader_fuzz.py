"""Hypothesis fuzz of the SEAL loaders: mutated ciphertext and key blobs are typed errors, never crashes.

The ciphertext loader (``wire.load_ciphertext``) and the key-upload parser (``wire.parse_server_keys``)
are what a hostile client reaches first. Mutations of valid blobs (bit flips anywhere, truncation,
spliced bytes, a zeroed window) must either load (CKKS has no integrity check: a flipped coefficient is
a valid ciphertext) or raise :class:`fhe.errors.FHEError`; any other exception — or a crash of the test
process, since these run in-process — fails the test. Derandomized and bounded, so CI's run is the same
every time (issue 12, must show).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fhe.backends.seal import wire
from fhe.backends.seal.keys import CKKSClient
from fhe.errors import FHEError
from fhe.params import CKKSParams

P = CKKSParams(8192, (60, 40, 40, 60), 40)
STEPS = (1, 2)
FUZZ = settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def material():
    client = CKKSClient(P, STEPS)
    server = wire.load_server_keys(wire.dump_public_keys(client), P, STEPS)
    return client, server, wire.encrypt_to_wire(client, np.ones(8)), wire.dump_public_keys(client)


def _mutate(blob: bytes, data: st.DataObject) -> bytes:
    """One of: flip bits at a few offsets, truncate, splice random bytes in, zero a window."""
    out = bytearray(blob)
    how = data.draw(st.sampled_from(["flip", "truncate", "splice", "zero"]))
    if how == "flip":
        for at in data.draw(st.lists(st.integers(0, len(out) - 1), min_size=1, max_size=4)):
            out[at] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "truncate":
        del out[data.draw(st.integers(0, len(out) - 1)):]
    elif how == "splice":
        at = data.draw(st.integers(0, len(out)))
        out[at:at] = data.draw(st.binary(min_size=1, max_size=64))
    else:
        at = data.draw(st.integers(0, len(out) - 1))
        out[at:at + data.draw(st.integers(1, 4096))] = bytes(min(4096, len(out) - at))
    return bytes(out)


@FUZZ
@given(data=st.data())
def test_mutated_ciphertext_is_loaded_or_a_typed_error(material, data):
    client, server, blob, _ = material
    try:
        wire.load_ciphertext(_mutate(blob, data), server.kit, client.fingerprint)
    except FHEError:
        pass


@FUZZ
@given(data=st.data())
def test_mutated_key_upload_is_parsed_or_a_typed_error(material, data):
    _, _, _, blobs = material
    name = data.draw(st.sampled_from(sorted(blobs)))
    mutated = dict(blobs) | {name: _mutate(blobs[name], data)}
    try:
        wire.parse_server_keys(mutated, P, STEPS)
    except FHEError:
        pass
