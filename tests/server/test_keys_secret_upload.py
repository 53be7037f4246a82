"""Uploads that carry a secret key are refused on every path, audited, and leave no trace.

Real TenSEAL contexts serialized with ``save_secret_key=True``. After all attempts, no file under
the server's directories (stored keys, registry state, audit log and checkpoints), no exception
text and no registry entry contains any piece of the secret-key bytes.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import tenseal as ts

from server.audit import (
    AuditConfig,
    AuditLog,
    CheckpointSigner,
    Event,
    Pseudonymizer,
    iter_records,
    verify_log,
)
from server.keys import (
    EvalKeyStorage,
    KeyRegistry,
    RegistryConfig,
    SecretKeyUploadError,
    UploadRefusedError,
    screen_evaluation_key,
)


def _ckks(n: int, galois: bool) -> ts.Context:
    ctx = ts.context(
        ts.SCHEME_TYPE.CKKS, n, coeff_mod_bit_sizes=[40, 21, 40] if n == 4096 else [60, 40, 40, 60]
    )
    ctx.global_scale = 2**21 if n == 4096 else 2**40
    if galois:
        ctx.generate_galois_keys()
    return ctx


def _secret_key_bytes(ctx: ts.Context) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "sk"
        ctx.secret_key().data.save(str(path))
        return path.read_bytes()


@pytest.fixture(scope="module")
def secrets_and_public():
    contexts = {
        "ckks-4096": _ckks(4096, False),
        "ckks-8192+galois": _ckks(8192, True),
        "bfv-4096": ts.context(ts.SCHEME_TYPE.BFV, 4096, plain_modulus=1032193),
    }
    blobs = {name: ctx.serialize(save_secret_key=True) for name, ctx in contexts.items()}
    blobs["ckks-4096 without public/relin keys"] = contexts["ckks-4096"].serialize(
        save_public_key=False, save_secret_key=True, save_galois_keys=False, save_relin_keys=False
    )
    raw = [_secret_key_bytes(ctx) for ctx in contexts.values()]
    legit = ts.context(ts.SCHEME_TYPE.BFV, 4096, plain_modulus=786433)
    legit.make_context_public()
    return blobs, raw, legit.serialize()


def _windows(data: bytes, width: int = 32) -> list[bytes]:
    """Overlapping-enough 32-byte windows: every 100-byte stretch of ``data`` contains one."""
    return [data[i : i + width] for i in range(0, len(data) - width, 64)]


def test_secret_key_uploads_refused_on_every_path_and_leave_no_trace(tmp_path, secrets_and_public):
    blobs, raw_secret_keys, legit = secrets_and_public
    signer = CheckpointSigner.generate()
    log = AuditLog.open(AuditConfig(tmp_path / "audit" / "audit.log"), signer, Pseudonymizer(b"p" * 32))
    storage = EvalKeyStorage(tmp_path / "evk", b"s" * 32)
    reg = KeyRegistry(RegistryConfig(state_path=tmp_path / "registry.json"), log, storage)
    reg.register("acme", "main", legit, actor="alice")  # a rotation path needs an existing key
    reg.activate("acme", "main", 1, actor="alice")

    paths = {
        "screen_evaluation_key": lambda b: screen_evaluation_key(b, max_bytes=reg.config.max_upload_bytes),
        "KeyRegistry.screen_upload": lambda b: reg.screen_upload("acme", b, actor="alice"),
        "KeyRegistry.register": lambda b: reg.register("acme", "new", b, actor="alice"),
        "KeyRegistry.rotate": lambda b: reg.rotate("acme", "main", b, actor="alice", grace_s=60),
    }
    wrappers = {"bytes": bytes, "bytearray": bytearray, "memoryview": memoryview}
    attempts, messages = 0, []
    for upload in paths.values():
        for blob in blobs.values():
            for wrap in wrappers.values():
                attempts += 1
                with pytest.raises(SecretKeyUploadError) as info:
                    upload(wrap(blob))
                assert isinstance(info.value, UploadRefusedError)
                messages.append(str(info.value) + repr(info.value))
    assert attempts == 4 * 4 * 3

    # Registry: nothing new (only the legitimate key, still one version, still active).
    assert [(r.key_id, r.version, r.state.value) for r in reg.list("acme")] == [("main", 1, "active")]
    # Audit: one refusal per attempt through the registry paths, with the reason, and nothing else new.
    log.close()
    assert verify_log(tmp_path / "audit" / "audit.log", {signer.key_id: signer.public_key}).ok
    refusals = [
        r for r in iter_records(tmp_path / "audit" / "audit.log") if r["event"] == Event.KEY_UPLOAD_REFUSED
    ]
    assert len(refusals) == 3 * 4 * 3
    assert all(r["detail"]["reason"] == "secret_key_present" and r["outcome"] == "refused" for r in refusals)
    # Disk: only the legit key's file was ever stored.
    assert [p.name for p in (tmp_path / "evk").rglob("*") if p.is_file()] == ["main.v1.evk"]
    # No piece of any secret blob or raw secret key anywhere on disk or in the error texts.
    needles = [w for blob in list(blobs.values()) + raw_secret_keys for w in _windows(blob)]
    haystacks = {str(p): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    haystacks["exception texts"] = "\n".join(messages).encode("utf-8", "backslashreplace")
    for name, hay in haystacks.items():
        assert not _hits(needles, hay), f"secret bytes found in {name}"
    # The scanner itself works: a planted fragment of a raw secret key (or its hex) is found.
    assert _hits(needles, b"prefix" + raw_secret_keys[1][1000:1100] + b"suffix")
    assert _hits(needles, raw_secret_keys[0][:200].hex().encode())


def _hits(needles: list[bytes], hay: bytes) -> list[bytes]:
    return [n for n in needles if n in hay or n.hex().encode() in hay]


def test_public_context_of_the_same_keys_is_accepted(secrets_and_public):
    """The check is about the secret key, not the scheme: the public half of a context passes."""
    ctx = ts.context(ts.SCHEME_TYPE.CKKS, 4096, coeff_mod_bit_sizes=[40, 21, 40])
    secret = ctx.serialize(save_secret_key=True)
    ctx.make_context_public()
    public = ctx.serialize()
    with pytest.raises(SecretKeyUploadError):
        screen_evaluation_key(secret, max_bytes=10**9)
    assert screen_evaluation_key(public, max_bytes=10**9).size == len(public)
