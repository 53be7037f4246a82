"""Bad input on the wire: every case is a typed error and the process survives."""

import struct

import numpy as np
import pytest

from fhe.backends.seal import hazmat as seal
from fhe.backends.seal import wire
from fhe.backends.seal.keys import CKKSClient
from fhe.errors import (
    FHEError,
    KeyMismatchError,
    KeyRefusedError,
    SecretKeyRefusedError,
    ShapeError,
    SizeLimitError,
    WireError,
)
from fhe.fingerprint import key_fingerprint
from fhe.params import CKKSParams

P = CKKSParams(8192, (60, 40, 40, 60), 40)
P2 = CKKSParams(8192, (60, 40, 40, 60), 39)


@pytest.fixture(scope="module")
def client():
    return CKKSClient(P, (1, 2))


@pytest.fixture(scope="module")
def other_client():
    return CKKSClient(P, (1, 2))


@pytest.fixture(scope="module")
def server(client):
    return wire.load_server_keys(wire.dump_public_keys(client), P, (1, 2))


def test_round_trip_and_fingerprint(client, server):
    assert server.fingerprint == client.fingerprint
    blob = wire.encrypt_to_wire(client, np.arange(5.0))
    ct = wire.load_ciphertext(blob, server.kit, client.fingerprint, level=server.kit.top)
    assert np.allclose(client.decrypt(ct)[:5], np.arange(5.0), atol=1e-6)
    blob2 = wire.dump_ciphertext(ct, P, client.fingerprint)
    again = wire.load_ciphertext(blob2, server.kit, client.fingerprint)
    assert np.allclose(client.decrypt(again)[:5], np.arange(5.0), atol=1e-6)


def test_fingerprint_is_fixed_at_key_creation(client, monkeypatch):
    """The fingerprint hashes every public blob (~700 MB at N = 32768) and every ciphertext sent or
    received names it: computed once per key set, never per message, and over bytes that cannot change."""
    import fhe.backends.seal.keys

    secret = client.unsafe_export_secret()
    restored = CKKSClient.restore(P, (1, 2), secret, dict(client.public_blobs))
    assert restored.fingerprint == client.fingerprint == key_fingerprint(P, client.public_blobs)

    def no_rehash(*_):
        raise AssertionError("fingerprint recomputed per message")

    monkeypatch.setattr(fhe.backends.seal.keys, "key_fingerprint", no_rehash)
    blob = wire.encrypt_to_wire(restored, np.arange(3.0))
    ct = wire.load_ciphertext(blob, client.kit, restored.fingerprint)
    assert np.allclose(client.decrypt(ct)[:3], np.arange(3.0), atol=1e-6)
    with pytest.raises(TypeError):
        client.public_blobs["galois_keys"] = b"other bytes"


def test_seeded_upload_is_smaller(client):
    ct = client.encrypt(np.ones(10))
    full = wire.dump_ciphertext(ct, P, client.fingerprint)
    assert len(wire.encrypt_to_wire(client, np.ones(10))) < 0.6 * len(full)


@pytest.mark.parametrize("data", [b"", b"garbage" * 100, bytes(200), b"CLMC" + bytes(100)])
def test_garbage_bytes(server, client, data):
    with pytest.raises(WireError):
        wire.load_ciphertext(data, server.kit, client.fingerprint)


def test_truncated_and_bit_flipped_payload(server, client):
    blob = wire.encrypt_to_wire(client, np.ones(3))
    with pytest.raises(WireError):
        wire.load_ciphertext(blob[:-100], server.kit, client.fingerprint)
    flipped = bytearray(blob)
    flipped[-5000:] = bytes(5000)            # zero the tail of SEAL's compressed payload
    with pytest.raises(FHEError):
        wire.load_ciphertext(bytes(flipped), server.kit, client.fingerprint)


def test_size_limit_checked_before_parsing(server, client):
    blob = wire.encrypt_to_wire(client, np.ones(3))
    with pytest.raises(SizeLimitError):
        wire.load_ciphertext(blob, server.kit, client.fingerprint, limit=len(blob) - 1)


def test_ciphertext_of_another_key_or_context(server, client, other_client):
    with pytest.raises(KeyMismatchError):
        wire.load_ciphertext(wire.encrypt_to_wire(other_client, np.ones(3)), server.kit, client.fingerprint)
    c2 = CKKSClient(P2, (1,))
    with pytest.raises(KeyMismatchError):
        wire.load_ciphertext(wire.encrypt_to_wire(c2, np.ones(3)), server.kit, client.fingerprint)


def test_wrong_level_or_kind(server, client):
    ct = client.kit.drop_to(client.encrypt(np.ones(3)), 2)
    blob = wire.dump_ciphertext(ct, P, client.fingerprint)
    with pytest.raises(ShapeError):
        wire.load_ciphertext(blob, server.kit, client.fingerprint, level=server.kit.top)
    keys = wire.dump_public_keys(client)
    with pytest.raises(WireError):
        wire.load_ciphertext(keys["public_key"], server.kit, client.fingerprint)


def test_secret_key_refused(client):
    secret_blob = wire._pack("secret_key", P, None, seal.to_bytes(client.keys.secret))
    with pytest.raises(SecretKeyRefusedError):
        wire.load_server_keys({**wire.dump_public_keys(client), "secret_key": secret_blob}, P, (1, 2))
    with pytest.raises(SecretKeyRefusedError):
        wire._unpack(secret_blob, "public_key", P, None, None)
    disguised = wire._pack("public_key", P, None, seal.to_bytes(client.keys.secret))
    with pytest.raises(KeyRefusedError):            # a secret key posing as a public key: refused as such
        wire.load_server_keys({**wire.dump_public_keys(client), "public_key": disguised}, P, (1, 2))


def test_private_tenseal_context_refused():
    import tenseal as ts

    ctx = ts.context(ts.SCHEME_TYPE.CKKS, 8192, coeff_mod_bit_sizes=[60, 40, 40, 60])
    with pytest.raises(SecretKeyRefusedError):
        wire.refuse_private_tenseal_context(ctx.serialize(save_secret_key=True))
    ctx.make_context_public()
    wire.refuse_private_tenseal_context(ctx.serialize())
    with pytest.raises(WireError):
        wire.refuse_private_tenseal_context(b"not a context")


def test_missing_galois_key_and_params_mismatch(client):
    with pytest.raises(KeyMismatchError):
        wire.load_server_keys(wire.dump_public_keys(client), P, (1, 2, 3))
    with pytest.raises(KeyMismatchError):
        wire.load_server_keys(wire.dump_public_keys(client), P2, (1, 2))
    with pytest.raises(KeyRefusedError):            # Galois keys the plan does not use
        wire.load_server_keys(wire.dump_public_keys(client), P, (1,))


# --- the upload allow-list (issue 12 item 1) ------------------------------------------------------
SEAL_HEAD = wire._SEAL_HEAD


def _smuggle(payload: bytes, hidden: bytes, skippable: bool) -> bytes:
    """``payload`` with ``hidden`` appended inside SEAL's declared size (SEAL ignores it when loading)."""
    tail = (struct.pack("<II", 0x184D2A50, len(hidden)) if skippable else b"") + hidden
    magic, head, major, minor, mode, res, _ = SEAL_HEAD.unpack_from(payload)
    body = payload[SEAL_HEAD.size:] + tail
    return SEAL_HEAD.pack(magic, head, major, minor, mode, res, SEAL_HEAD.size + len(body)) + body


def test_allow_list_every_name_and_kind(client):
    """Each blob name the upload format can carry x each kind code x secret content: only the three public
    names, each of its own kind and type, pass; everything else is refused (a secret-ish refusal)."""
    good = wire.dump_public_keys(client)
    secret_payload = seal.to_bytes(client.keys.secret)
    names = ["public_key", "relin_keys", "galois_keys", "secret_key", "sk", "Secret_Key", "", "publickey",
             "public_key ", "ciphertext", "ключ", "x" * 300]
    for name in names:
        for code in [*wire.KINDS.values(), 99]:
            for payload in (secret_payload, wire._unpack(good["public_key"], "public_key", P, None, None)):
                blob = bytearray(wire._pack("public_key", P, None, payload))
                blob[5] = code
                upload = {**good, name: bytes(blob)}
                legit = name in good and code == wire.KINDS[name] and payload is not secret_payload \
                    and name == "public_key"
                if legit:
                    assert wire.load_server_keys(upload, P, (1, 2)).fingerprint
                    continue
                with pytest.raises(SecretKeyRefusedError):
                    wire.load_server_keys(upload, P, (1, 2))


def test_secret_hidden_inside_valid_blobs_is_not_kept(client):
    """SEAL loads a blob with trailing bytes (a zstd skippable frame or plain bytes) inside its declared
    size: such an upload parses, but the canonical form — what a server stores — holds none of it."""
    secret_payload = seal.to_bytes(client.keys.secret)
    good = wire.dump_public_keys(client)
    for name in ("public_key", "relin_keys", "galois_keys"):
        for skippable in (True, False):
            payload = _smuggle(wire._unpack(good[name], name, P, None, None), secret_payload, skippable)
            parsed = wire.parse_server_keys({**good, name: wire._pack(name, P, None, payload)}, P, (1, 2))
            stored = b"".join(parsed.canonical.values())
            assert secret_payload[-4000:-3000] not in stored and secret_payload[100:1100] not in stored
            again = wire.load_server_keys(parsed.canonical, P, (1, 2), fingerprint=parsed.keys.fingerprint)
            assert again.fingerprint == parsed.keys.fingerprint


def test_canonical_keys_evaluate_like_the_upload(client):
    parsed = wire.parse_server_keys(wire.dump_public_keys(client), P, (1, 2))
    keys = wire.load_server_keys(parsed.canonical, P, (1, 2), fingerprint=client.fingerprint)
    ct = keys.kit.rotate(client.encrypt(np.arange(8.0)), 1, keys.galois)
    assert np.allclose(client.decrypt(ct)[:7], np.arange(1.0, 8.0), atol=1e-5)


def test_keys_for_other_parameters_or_levels_refused(client):
    other = CKKSClient(P2, (1, 2))
    mixed = {**wire.dump_public_keys(client), "relin_keys": wire.dump_public_keys(other)["relin_keys"]}
    with pytest.raises(KeyMismatchError):
        wire.load_server_keys(mixed, P, (1, 2))
    # the envelope claims our parameters, the SEAL object is for another chain
    foreign = wire._unpack(wire.dump_public_keys(CKKSClient(CKKSParams(8192, (60, 40, 60), 40), (1, 2)))
                           ["relin_keys"], "relin_keys", CKKSParams(8192, (60, 40, 60), 40), None, None)
    with pytest.raises(KeyRefusedError):
        wire.load_server_keys({**wire.dump_public_keys(client),
                               "relin_keys": wire._pack("relin_keys", P, None, foreign)}, P, (1, 2))


def test_seal_serialization_never_touches_disk(client, monkeypatch, tmp_path):
    """Secret keys and ciphertexts go through memory only (issue 12 item 10): no temporary file is made,
    and SEAL is handed an in-memory file descriptor."""
    import tempfile

    def no_temp_files(*_a, **_k):
        raise AssertionError("a temporary file was created")

    for name in ("mkstemp", "NamedTemporaryFile", "TemporaryFile", "mkdtemp"):
        monkeypatch.setattr(tempfile, name, no_temp_files)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    secret = client.unsafe_export_secret()
    assert seal.to_bytes(seal.from_bytes("secret_key", client.kit, secret)) == secret
    blob = wire.encrypt_to_wire(client, np.ones(4))
    wire.load_ciphertext(blob, client.kit, client.fingerprint)
    assert list(tmp_path.iterdir()) == []
