"""Uploads that carry a secret key are refused on every path, audited, and leave no trace.

Each upload goes through the production inspector (``inspect_upload``: the SEAL wire allow-list, as a
worker runs it) and then the registry's paths with that verdict. The uploads: real TenSEAL contexts
serialized with ``save_secret_key=True``, and real ``CLMK`` uploads of the server's format carrying the
client's SEAL secret key beside the three public blobs (as ``secret_key`` and as ``sk``). After all
attempts, no file under the server's directories (stored keys, registry state, audit log and
checkpoints), no exception text and no registry entry contains any piece of the secret-key bytes.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import tenseal as ts

from fhe.backends.seal import hazmat as seal
from fhe.backends.seal import wire
from fhe.backends.seal.keys import CKKSClient
from fhe.envelope import pack_key_upload
from fhe.params import CKKSParams
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
    Verdict,
    inspect_upload,
    screen_evaluation_key,
)
from tests.leaks import found

# the smallest parameters SEAL takes (a 0.4 MB public upload): the scan of every file below stays fast
P = CKKSParams(4096, (40, 20, 40), 20)
STEPS = (1,)


def inspect(data) -> object:
    """The production inspector, as the worker runs it for the server's parameters."""
    return _inspect(bytes(data))


@functools.cache
def _inspect(data: bytes) -> object:
    return inspect_upload(data, P, STEPS, max_bytes=10**9)  # real parse, once per distinct upload


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
    client = CKKSClient(P, STEPS)
    public = wire.dump_public_keys(client)
    secret = seal.to_bytes(client.keys.secret)
    for name in ("secret_key", "sk"):
        blobs[f"CLMK + {name}"] = _pack_any({**public, name: secret})
    raw.append(secret)
    return blobs, raw, pack_key_upload(public)


def _pack_any(blobs: dict[str, bytes]) -> bytes:
    """A key upload with any blob names (``pack_key_upload`` writes only the public ones, as the SDK must)."""
    import rfc8785

    from fhe import envelope

    head = rfc8785.dumps({"v": envelope.ENVELOPE_VERSION, "names": list(blobs),
                          "sizes": [len(b) for b in blobs.values()]})
    prefix = envelope._PREFIX.pack(envelope.KEY_MAGIC, envelope.ENVELOPE_VERSION, len(head))
    return prefix + head + b"".join(blobs.values())


def _windows(data: bytes, width: int = 32, step: int = 64) -> list[bytes]:
    """32-byte windows every ``step`` bytes (64: every 100-byte stretch of ``data`` contains one)."""
    return [data[i : i + width] for i in range(0, len(data) - width, step)]


def test_secret_key_uploads_refused_on_every_path_and_leave_no_trace(tmp_path, secrets_and_public):
    blobs, raw_secret_keys, legit = secrets_and_public
    signer = CheckpointSigner.generate()
    log = AuditLog.open(AuditConfig(tmp_path / "audit" / "audit.log"), signer, Pseudonymizer(b"p" * 32))
    storage = EvalKeyStorage(tmp_path / "evk", b"s" * 32)
    reg = KeyRegistry(RegistryConfig(state_path=tmp_path / "registry.json"), log, storage)
    reg.register("acme", "main", legit, inspect(legit), actor="alice")  # a rotation path needs a key
    reg.activate("acme", "main", 1, actor="alice")

    paths = {
        "screen_evaluation_key": lambda b: screen_evaluation_key(b, inspect(b), max_bytes=reg.config.max_upload_bytes),
        "KeyRegistry.screen_upload": lambda b: reg.screen_upload("acme", b, inspect(b), actor="alice"),
        "KeyRegistry.register": lambda b: reg.register("acme", "new", b, inspect(b), actor="alice"),
        "KeyRegistry.rotate": lambda b: reg.rotate("acme", "main", b, inspect(b), actor="alice", grace_s=60),
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
    assert attempts == 4 * 6 * 3

    # Registry: nothing new (only the legitimate key, still one version, still active).
    assert [(r.key_id, r.version, r.state.value) for r in reg.list("acme")] == [("main", 1, "active")]
    # Audit: one refusal per attempt through the registry paths, with the reason, and nothing else new.
    log.close()
    assert verify_log(tmp_path / "audit" / "audit.log", {signer.key_id: signer.public_key}).ok
    refusals = [
        r for r in iter_records(tmp_path / "audit" / "audit.log") if r["event"] == Event.KEY_UPLOAD_REFUSED
    ]
    assert len(refusals) == 3 * 6 * 3
    assert all(r["detail"]["reason"] == "secret_key_present" and r["outcome"] == "refused" for r in refusals)
    # Disk: only the legit key's file was ever stored.
    assert [p.name for p in (tmp_path / "evk").rglob("*") if p.is_file()] == ["main.v1.evk"]
    # No piece of any secret blob or raw secret key anywhere on disk or in the error texts.
    # (the CLMK uploads' secret part is raw_secret_keys[-1]; their public part is the legit key's)
    tenseal = [blob for name, blob in blobs.items() if not name.startswith("CLMK")]
    needles = [w for blob in tenseal + raw_secret_keys[:-1] for w in _windows(blob)]
    needles += _windows(raw_secret_keys[-1], step=997)
    haystacks = {str(p): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    haystacks["exception texts"] = "\n".join(messages).encode("utf-8", "backslashreplace")
    for name, hay in haystacks.items():
        assert not _hits(needles, hay), f"secret bytes found in {name}"
    # The scanner itself works: a planted fragment of a raw secret key (or its hex) is found.
    assert _hits(needles, b"prefix" + raw_secret_keys[1][1000:1100] + b"suffix")
    assert _hits(needles, raw_secret_keys[0][:200].hex().encode())


def _hits(needles: list[bytes], hay: bytes) -> list[str]:
    return found({f"{i}{form}": n.hex().encode() if form == "hex" else n
                  for i, n in enumerate(needles) for form in ("", "hex")}, hay)


def test_the_public_half_of_the_same_keys_is_accepted(secrets_and_public):
    """The check is about the secret key: the same client's public blobs alone pass."""
    blobs, _, public = secrets_and_public
    assert inspect(public).verdict is Verdict.PUBLIC
    assert screen_evaluation_key(public, inspect(public), max_bytes=10**9).size == len(public)
    for name in ("CLMK + secret_key", "CLMK + sk", "ckks-4096"):
        assert inspect(blobs[name]).verdict is Verdict.SECRET_KEY, name
