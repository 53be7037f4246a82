"""Client key store: encryption at rest, one opaque error, moved/edited files, rotation grace,
destruction, the local event log, no accidental serialization of secrets."""

from __future__ import annotations

import base64
import json
import os
import pickle
import shutil

import pytest
import rfc8785
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from client_sdk.keystore import (
    InvalidKeyStoreAccess,
    KdfParams,
    KeyMaterial,
    KeyStore,
    KeyStoreConfig,
    KeyStorePermissionError,
    KeyUnusableError,
)

FAST = KeyStoreConfig(kdf=KdfParams(name="scrypt", n=2**10), max_grace_s=3600)
SECRET1, PUBLIC1 = b"SECRET-ONE-" * 20, b"public-one"
SECRET2, PUBLIC2 = b"SECRET-TWO-" * 20, b"public-two"


class Clock:
    def __init__(self) -> None:
        self.t = 1767225600.0

    def __call__(self) -> float:
        return self.t


class CountingRng:
    """Deterministic 'randomness' so file bytes are reproducible (known-answer test)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, size: int) -> bytes:
        self.n += 1
        return bytes([self.n]) * size


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def store(tmp_path, clock):
    return KeyStore.create(tmp_path / "ks", "correct horse", config=FAST, clock=clock, rng=CountingRng())


def gen(secret, public):
    return lambda: KeyMaterial(secret, public)


def test_round_trip_and_secret_is_encrypted_at_rest(tmp_path, store, clock):
    handle = store.generate(gen(SECRET1, PUBLIC1), key_id="main")
    again = KeyStore.open(tmp_path / "ks", "correct horse", clock=clock)
    assert again.key("main").secret_material() == SECRET1
    assert again.key("main").public_material() == PUBLIC1
    for path in (tmp_path / "ks").rglob("*"):
        if path.is_file():
            assert b"SECRET-ONE" not in path.read_bytes(), path
            assert oct(path.stat().st_mode & 0o777) == "0o600", path
        else:
            assert oct(path.stat().st_mode & 0o777) == "0o700", path
    assert oct((tmp_path / "ks").stat().st_mode & 0o777) == "0o700"
    assert "SECRET" not in repr(handle) + repr(store)


def test_known_answer_decrypt_with_an_independent_derivation(tmp_path, store):
    """Re-derive the file key with pyca primitives directly and open the file by hand."""
    store.generate(gen(SECRET1, PUBLIC1), key_id="main")
    index = json.loads((tmp_path / "ks" / "keystore.json").read_bytes())
    salt = base64.b64decode(index["kdf"]["salt"])
    assert salt == b"\x01" * 16  # first rng draw
    master = Scrypt(salt=salt, length=32, n=2**10, r=8, p=1).derive(b"correct horse")
    file_key = HKDF(hashes.SHA256(), 32, salt=None, info=b"cipherlm-keystore/file").derive(master)
    blob = (tmp_path / "ks" / "keys" / "main" / "v1.secret").read_bytes()
    magic, nonce, sealed = blob[:7], blob[7:19], blob[19:]
    assert magic == b"CLMKS1\n" and nonce == b"\x02" * 12  # second rng draw (the key id was given)
    import hashlib

    aad = rfc8785.dumps(
        {
            "format": "cipherlm-keystore/1",
            "key_id": "main",
            "version": 1,
            "public_fingerprint": hashlib.sha256(PUBLIC1).hexdigest(),
        }
    )
    assert AESGCM(file_key).decrypt(nonce, sealed, aad) == SECRET1


def _opaque(fn):
    with pytest.raises(InvalidKeyStoreAccess) as info:
        fn()
    return str(info.value)


def test_wrong_passphrase_and_every_edit_give_one_opaque_error(tmp_path, store, clock):
    store.generate(gen(SECRET1, PUBLIC1), key_id="main")
    store.generate(gen(SECRET2, PUBLIC2), key_id="other")
    ks = tmp_path / "ks"
    pristine = tmp_path / "pristine"
    shutil.copytree(ks, pristine)

    def reset():
        shutil.rmtree(ks)
        shutil.copytree(pristine, ks)

    def load_main():
        return KeyStore.open(ks, "correct horse", clock=clock).key("main").secret_material()

    messages = {"wrong passphrase": _opaque(lambda: KeyStore.open(ks, "wrong horse", clock=clock))}
    edits = {
        "secret file bit flip": lambda: _flip(ks / "keys" / "main" / "v1.secret"),
        "secret file moved to another key": lambda: shutil.copyfile(
            ks / "keys" / "other" / "v1.secret", ks / "keys" / "main" / "v1.secret"
        ),
        "secret file deleted": lambda: os.remove(ks / "keys" / "main" / "v1.secret"),
        "index edited (grace extended)": lambda: _edit_json(
            ks / "keystore.json", lambda o: o["index"]["keys"]["main"].update(primary=7)
        ),
        "index: kdf weakened": lambda: _edit_json(ks / "keystore.json", lambda o: o["kdf"].update(n=2)),
        "event log line dropped": lambda: _drop_line(ks / "events.log", 1),
        "event log truncated": lambda: _truncate_lines(ks / "events.log", 2),
        "public file swapped": lambda: shutil.copyfile(
            ks / "keys" / "other" / "v1.public", ks / "keys" / "main" / "v1.public"
        ),
    }
    for name, edit in edits.items():
        reset()
        edit()
        if name == "public file swapped":
            messages[name] = _opaque(
                lambda: KeyStore.open(ks, "correct horse", clock=clock).key("main").public_material()
            )
        else:
            messages[name] = _opaque(load_main)
    assert len(set(messages.values())) == 1, messages
    reset()
    assert load_main() == SECRET1  # the pristine copy still opens: the edits, not the harness, failed


def test_file_from_another_store_with_same_passphrase_is_refused(tmp_path, clock):
    a = KeyStore.create(tmp_path / "a", "pw", config=FAST, clock=clock)
    b = KeyStore.create(tmp_path / "b", "pw", config=FAST, clock=clock)
    a.generate(gen(SECRET1, PUBLIC1), key_id="main")
    b.generate(gen(SECRET2, PUBLIC1), key_id="main")
    shutil.copyfile(
        tmp_path / "a" / "keys" / "main" / "v1.secret", tmp_path / "b" / "keys" / "main" / "v1.secret"
    )
    _opaque(lambda: KeyStore.open(tmp_path / "b", "pw", clock=clock).key("main").secret_material())


def test_loose_permissions_are_refused(tmp_path, store, clock):
    store.generate(gen(SECRET1, PUBLIC1), key_id="main")
    os.chmod(tmp_path / "ks" / "keys" / "main" / "v1.secret", 0o644)
    with pytest.raises(KeyStorePermissionError):
        KeyStore.open(tmp_path / "ks", "correct horse", clock=clock).key("main").secret_material()
    os.chmod(tmp_path / "ks", 0o755)
    with pytest.raises(KeyStorePermissionError):
        KeyStore.open(tmp_path / "ks", "correct horse", clock=clock)


def test_rotation_keeps_old_sessions_until_grace_ends(store, clock):
    old = store.generate(gen(SECRET1, PUBLIC1), key_id="main")
    session = store.key("main")  # a session opened on v1
    with pytest.raises(ValueError):
        store.rotate("main", gen(SECRET2, PUBLIC2), grace_s=3601)  # bounded by max_grace_s
    new = store.rotate("main", gen(SECRET2, PUBLIC2), grace_s=600)
    assert store.key("main").version == new.version == 2
    assert store.key("main").secret_material() == SECRET2
    clock.t += 599.999
    assert session.secret_material() == SECRET1 and old.public_material() == PUBLIC1
    clock.t += 0.001
    with pytest.raises(KeyUnusableError):
        session.secret_material()
    with pytest.raises(KeyUnusableError):
        store.key("main", 1)
    assert store.key("main", 2).secret_material() == SECRET2


def test_destroy_removes_files_and_refuses_use(tmp_path, store, clock):
    handle = store.generate(gen(SECRET1, PUBLIC1), key_id="main")
    store.destroy("main")
    assert not list((tmp_path / "ks" / "keys" / "main").iterdir())
    with pytest.raises(KeyUnusableError):
        handle.secret_material()
    reopened = KeyStore.open(tmp_path / "ks", "correct horse", clock=clock)
    with pytest.raises(KeyUnusableError):
        reopened.key("main")
    assert [e["event"] for e in reopened.events()] == ["store.created", "key.created", "key.destroyed"]


def test_local_event_log(store, clock):
    store.generate(gen(SECRET1, PUBLIC1), key_id="main")
    clock.t += 5
    store.rotate("main", gen(SECRET2, PUBLIC2), grace_s=60)
    events = store.events()
    assert [(e["event"], e["key_id"], e["version"]) for e in events] == [
        ("store.created", None, None),
        ("key.created", "main", 1),
        ("key.rotated", "main", 2),
    ]
    assert events[2]["time"] == clock.t and events[2]["detail"] == {"rotated_from": 1, "grace_s": 60}
    assert all(b"SECRET" not in json.dumps(e).encode() for e in events)


def test_nothing_secret_is_serialized_unless_asked(store):
    store.generate(gen(SECRET1, PUBLIC1), key_id="main")
    bundle = json.loads(store.export("main"))
    assert "secret" not in bundle and base64.b64decode(bundle["public"]) == PUBLIC1
    with pytest.raises(TypeError):
        store.export("main", None, True)  # the unsafe option is keyword-only
    unsafe = json.loads(store.export("main", unsafe_include_secret=True))
    assert base64.b64decode(unsafe["secret"]) == SECRET1
    assert store.events()[-1]["event"] == "key.secret_exported"
    for obj in (store, store.key("main")):
        with pytest.raises(TypeError):
            pickle.dumps(obj)


def test_real_tenseal_context_round_trip(tmp_path, clock):
    ts = pytest.importorskip("tenseal")

    def tenseal_generator():
        ctx = ts.context(ts.SCHEME_TYPE.CKKS, 4096, coeff_mod_bit_sizes=[40, 21, 40])
        ctx.global_scale = 2**21
        secret = ctx.serialize(save_secret_key=True)
        ctx.make_context_public()
        return KeyMaterial(secret, ctx.serialize())

    store = KeyStore.create(tmp_path / "ks", "pw", config=FAST, clock=clock)
    handle = store.generate(tenseal_generator)
    ctx = ts.context_from(
        KeyStore.open(tmp_path / "ks", "pw", clock=clock).key(handle.key_id).secret_material()
    )
    public = ts.context_from(handle.public_material())
    assert ctx.is_private() and not public.is_private()
    vec = ts.ckks_vector(public, [1.0, 2.0, 3.0])
    vec.link_context(ctx)
    assert [round(x, 2) for x in vec.decrypt()] == [1.0, 2.0, 3.0]


def test_default_kdf_is_memory_hard():
    params = KdfParams()
    assert params.name in ("argon2id", "scrypt")
    assert (params.memory_kib >= 65536) if params.name == "argon2id" else (params.n >= 2**17)


def _flip(path):
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))


def _edit_json(path, change):
    obj = json.loads(path.read_bytes())
    change(obj)
    path.write_bytes(json.dumps(obj).encode())


def _drop_line(path, index):
    lines = path.read_bytes().split(b"\n")
    del lines[index]
    path.write_bytes(b"\n".join(lines))


def _truncate_lines(path, keep):
    lines = path.read_bytes().split(b"\n")[:keep]
    path.write_bytes(b"\n".join(lines) + b"\n")


def test_failing_generator_leaves_the_store_untouched(tmp_path, store, clock):
    store.generate(gen(SECRET1, PUBLIC1), key_id="main")

    def broken():
        raise RuntimeError("no entropy")

    for call in (
        lambda: store.generate(broken, key_id="other"),
        lambda: store.rotate("main", broken, grace_s=60),
    ):
        with pytest.raises(RuntimeError):
            call()
    assert list(store.keys()) == ["main"] and store.key("main").version == 1
    assert store.keys()["main"]["versions"]["1"]["state"] == "active"


def test_torn_event_log_line_is_cut_on_open(tmp_path, store, clock):
    store.generate(gen(SECRET1, PUBLIC1), key_id="main")
    with open(tmp_path / "ks" / "events.log", "ab") as f:
        f.write(b'{"detail":{},"ev')  # crash mid-append, before the index pinned it
    again = KeyStore.open(tmp_path / "ks", "correct horse", clock=clock)
    again.rotate("main", gen(SECRET2, PUBLIC2), grace_s=10)
    assert len(KeyStore.open(tmp_path / "ks", "correct horse", clock=clock).events()) == 3


def test_exported_members_and_errors():
    import client_sdk.keystore as ks
    from client_sdk._exceptions import CipherlmError

    assert set(ks.__all__) == {
        "InvalidKeyStoreAccess",
        "KdfParams",
        "KeyHandle",
        "KeyMaterial",
        "KeyStore",
        "KeyStoreConfig",
        "KeyStoreError",
        "KeyStoreNotFoundError",
        "KeyStorePermissionError",
        "KeyUnusableError",
    }
    for name in ks.__all__:
        if name.endswith(("Error", "Access")):
            assert issubclass(getattr(ks, name), ks.KeyStoreError)
    assert issubclass(ks.KeyStoreError, CipherlmError)
