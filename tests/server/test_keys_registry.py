"""Key registry: lifecycle, expiry and grace with injected time, revocation cancels in-flight work,
integrity-bound storage, audit-or-fail, persistence. Uploads are real (small, N = 8192) ``CLMK`` key
uploads, each with the verdict of the production inspector (``inspect_upload``: the SEAL wire allow-list)."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from fhe.backends.seal import hazmat as seal
from fhe.backends.seal import wire
from fhe.backends.seal.keys import CKKSClient
from fhe.envelope import pack_key_upload, parse_key_upload
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
    Inspection,
    KeyAuditError,
    KeyCancelledError,
    KeyExistsError,
    KeyIntegrityError,
    KeyNotFoundError,
    KeyNotUsableError,
    KeyRegistry,
    KeyState,
    KeyStateError,
    KeyTooLargeError,
    MalformedKeyError,
    RegistryConfig,
    SecretKeyUploadError,
    Verdict,
    inspect_upload,
    screen_evaluation_key,
)
from tests.fhe.test_wire import _smuggle

DAY = 86400.0


class Clock:
    def __init__(self) -> None:
        self.t = 1767225600.0

    def __call__(self) -> float:
        return self.t


P = CKKSParams(8192, (60, 40, 40, 60), 40)
STEPS = (1, 2)


def key_upload(params: CKKSParams = P) -> bytes:
    """A client's real public-key upload (what the SDK sends)."""
    return pack_key_upload(wire.dump_public_keys(CKKSClient(params, STEPS)))


def inspected(data: bytes) -> tuple[bytes, Inspection]:
    return data, inspect_upload(data, P, STEPS, max_bytes=10**9)


@pytest.fixture(scope="module")
def evks():
    """Two uploads the production inspector accepts (bytes, verdict)."""
    return [inspected(key_upload()), inspected(key_upload())]


class Env:
    def __init__(self, tmp_path, **cfg):
        self.clock, self.signer = Clock(), CheckpointSigner.generate()
        self.log_path = tmp_path / "audit.log"
        self.log = AuditLog.open(
            AuditConfig(self.log_path), self.signer, Pseudonymizer(b"p" * 32), clock=self.clock
        )
        self.storage = EvalKeyStorage(tmp_path / "evk", b"s" * 32)
        cfg.setdefault("state_path", tmp_path / "registry.json")
        self.config = RegistryConfig(**cfg)
        self.reg = KeyRegistry(self.config, self.log, self.storage, clock=self.clock)

    def events(self):
        return [r["event"] for r in iter_records(self.log_path)][1:]  # skip the log's creation record


@pytest.fixture
def env(tmp_path):
    e = Env(tmp_path, default_lifetime_s=30 * DAY, max_grace_s=DAY)
    yield e
    e.log.close()
    assert verify_log(e.log_path, {e.signer.key_id: e.signer.public_key}).ok


def test_lifecycle_and_one_record_per_transition(env, evks):
    reg = env.reg
    rec = reg.register("acme", "k1", *evks[0], actor="alice", request_id="r1")
    assert rec.state is KeyState.PRE_ACTIVE and len(rec.fingerprint) == 64
    with pytest.raises(KeyNotUsableError):
        reg.use("acme", "k1")
    reg.activate("acme", "k1", 1, actor="ops")
    with reg.use("acme", "k1") as lease:
        stored = reg.load_material(lease)
    assert stored == evks[0][1].canonical != evks[0][0]  # the parsed keys re-serialized, not the upload
    assert rec.key_set == evks[0][1].key_set == wire.load_server_keys(
        parse_key_upload(evks[0][0], 10**9), P, STEPS).fingerprint
    assert rec.stored_sha256 == hashlib.sha256(stored).hexdigest()
    reg.suspend("acme", "k1", 1, actor="ops")
    reg.reinstate("acme", "k1", 1, actor="ops")
    reg.revoke("acme", "k1", 1, actor="ops")
    reg.destroy("acme", "k1", 1, actor="ops")
    assert not env.storage.path("acme", "k1", 1).exists()
    assert env.events() == [
        Event.KEY_REGISTERED,
        Event.KEY_USE_REFUSED,
        Event.KEY_ACTIVATED,
        Event.KEY_SUSPENDED,
        Event.KEY_REINSTATED,
        Event.KEY_DEACTIVATED,
        Event.KEY_DESTROYED,
    ]
    recs = list(iter_records(env.log_path))
    assert [(r["state_from"], r["state_to"]) for r in recs if r["event"] == Event.KEY_DEACTIVATED] == [
        ("active", "deactivated")
    ]
    assert all(r["key_fingerprint"] == rec.fingerprint for r in recs[1:])


def test_disallowed_transitions_are_refused_and_audited(env, evks):
    env.reg.register("acme", "k1", *evks[0], actor="a")
    for op in (env.reg.suspend, env.reg.reinstate, env.reg.revoke):
        with pytest.raises(KeyStateError):
            op("acme", "k1", 1, actor="a")
    env.reg.activate("acme", "k1", 1, actor="a")
    with pytest.raises(KeyStateError):  # SP 800-57: an active key is deactivated before destruction
        env.reg.destroy("acme", "k1", 1, actor="a")
    failures = [r for r in iter_records(env.log_path) if r["outcome"] == "failure"]
    assert len(failures) == 4 and env.reg.get("acme", "k1", 1).state is KeyState.ACTIVE


def test_expiry_is_exact_with_injected_time(env, evks):
    env.reg.register("acme", "k1", *evks[0], actor="a")
    env.reg.activate("acme", "k1", 1, actor="a", expires_at=env.clock.t + 100)
    env.clock.t += 99.999
    env.reg.use("acme", "k1").release()
    env.clock.t += 0.001
    with pytest.raises(KeyNotUsableError):
        env.reg.use("acme", "k1")
    assert env.reg.get("acme", "k1").state is KeyState.DEACTIVATED
    assert env.events()[-2:] == [Event.KEY_EXPIRED, Event.KEY_USE_REFUSED]


def test_expire_due_sweep_and_lease_check(env, evks):
    env.reg.register("acme", "k1", *evks[0], actor="a")
    env.reg.activate("acme", "k1", 1, actor="a", expires_at=env.clock.t + 10)
    lease = env.reg.use("acme", "k1")
    env.clock.t += 10
    with pytest.raises(KeyCancelledError):  # in-flight work notices expiry on its next check
        lease.check()
    assert env.reg.expire_due() == []  # already deactivated by the check, exactly once
    assert env.events().count(Event.KEY_EXPIRED) == 1


def test_revocation_cancels_in_flight_work_immediately(env, evks):
    env.reg.register("acme", "k1", *evks[0], actor="a")
    env.reg.activate("acme", "k1", 1, actor="a")
    seen, global_seen = [], []
    env.reg.add_cancel_hook(lambda rec, why: global_seen.append((rec.key_id, why)))
    lease = env.reg.use("acme", "k1")
    lease.on_cancel(seen.append)
    lease.check()
    env.reg.revoke("acme", "k1", 1, actor="ops", compromised=True, reason="laptop stolen")
    assert lease.cancelled and seen and global_seen[0][0] == "k1"
    with pytest.raises(KeyCancelledError):
        lease.check()
    with pytest.raises(KeyNotUsableError):
        env.reg.use("acme", "k1")
    assert env.reg.get("acme", "k1").state is KeyState.COMPROMISED


def test_rotation_grace_window(env, evks):
    reg = env.reg
    reg.register("acme", "k1", *evks[0], actor="a")
    reg.activate("acme", "k1", 1, actor="a")
    old_session = reg.use("acme", "k1")
    with pytest.raises(ValueError):
        reg.rotate("acme", "k1", *evks[1], actor="a", grace_s=DAY + 1)
    new = reg.rotate("acme", "k1", *evks[1], actor="a", grace_s=3600)
    assert new.version == 2 and reg.use("acme", "k1").record.version == 2
    env.clock.t += 3599
    old_session.check()
    reg.use("acme", "k1", 1).release()
    env.clock.t += 1
    with pytest.raises(KeyCancelledError):
        old_session.check()
    with pytest.raises(KeyNotUsableError):
        reg.use("acme", "k1", 1)
    reg.use("acme", "k1", 2).release()
    assert Event.KEY_ROTATED in env.events()


def test_tenants_are_isolated(env, evks):
    env.reg.register("acme", "k1", *evks[0], actor="a")
    env.reg.activate("acme", "k1", 1, actor="a")
    with pytest.raises(KeyNotFoundError):
        env.reg.use("globex", "k1")
    env.reg.register("globex", "k1", *evks[1], actor="b")  # same key id, another tenant: independent
    with pytest.raises(KeyExistsError):
        env.reg.register("acme", "k1", *evks[1], actor="a")


def test_bytes_smuggled_inside_a_valid_blob_are_never_stored(env):
    """SEAL ignores bytes after the object it reads, so an upload can pass the allow-list with a secret
    key hidden inside a public blob; the registry stores the parsed keys re-serialized, and a worker loads
    them under the fingerprint the client's ciphertexts name."""
    client = CKKSClient(P, STEPS)
    secret = seal.to_bytes(client.keys.secret)
    blobs = wire.dump_public_keys(client)
    payload = _smuggle(wire._unpack(blobs["galois_keys"], "galois_keys", P, None, None), secret, True)
    upload = pack_key_upload({**blobs, "galois_keys": wire._pack("galois_keys", P, None, payload)})
    rec = env.reg.register("acme", "k1", *inspected(upload), actor="a")
    env.reg.activate("acme", "k1", 1, actor="a")
    with env.reg.use("acme", "k1") as lease:
        stored = env.reg.load_material(lease)
    on_disk = env.storage.path("acme", "k1", 1).read_bytes()
    for piece in (secret[100:1100], secret[-4000:-3000]):
        assert piece in upload and piece not in stored and piece not in on_disk
    keys = wire.load_server_keys(parse_key_upload(stored, len(stored)), P, STEPS, fingerprint=rec.key_set)
    as_sent = wire.load_server_keys(parse_key_upload(upload, 10**9), P, STEPS).fingerprint
    assert keys.fingerprint == as_sent  # what the sender's ciphertexts name


def test_stored_key_moved_to_another_tenant_or_altered_is_refused(env, evks):
    env.reg.register("acme", "k1", *evks[0], actor="a")
    env.reg.activate("acme", "k1", 1, actor="a")
    env.reg.register("globex", "k1", *evks[1], actor="b")
    env.reg.activate("globex", "k1", 1, actor="b")
    src, dst = env.storage.path("acme", "k1", 1), env.storage.path("globex", "k1", 1)
    shutil.copyfile(src, dst)  # acme's file planted as globex's key
    with env.reg.use("globex", "k1") as lease, pytest.raises(KeyIntegrityError):
        env.reg.load_material(lease)
    blob = bytearray(src.read_bytes())
    blob[-40] ^= 1
    src.write_bytes(bytes(blob))
    with env.reg.use("acme", "k1") as lease, pytest.raises(KeyIntegrityError):
        env.reg.load_material(lease)
    assert env.events().count(Event.KEY_INTEGRITY_FAILURE) == 2


def test_audit_failure_means_no_key_change(env, evks):
    env.reg.register("acme", "k1", *evks[0], actor="a")
    env.log.close()  # every further append fails
    with pytest.raises(KeyAuditError):
        env.reg.activate("acme", "k1", 1, actor="a")
    assert env.reg.get("acme", "k1").state is KeyState.PRE_ACTIVE
    with pytest.raises(KeyAuditError):
        env.reg.register("acme", "k2", *evks[1], actor="a")
    with pytest.raises(KeyNotFoundError):
        env.reg.get("acme", "k2")
    assert not env.storage.path("acme", "k2", 1).exists()


def test_state_persists_across_restart(tmp_path, evks):
    e = Env(tmp_path)
    e.reg.register("acme", "k1", *evks[0], actor="a")
    e.reg.activate("acme", "k1", 1, actor="a")
    e.log.close()
    again = KeyRegistry(e.config, e.log, e.storage, clock=e.clock)
    assert again.get("acme", "k1").state is KeyState.ACTIVE
    assert (
        json.loads((tmp_path / "registry.json").read_text())[0]["fingerprint"]
        == again.get("acme", "k1").fingerprint
    )


def test_screen_size_limit_first_then_the_verdict(evks):
    data, public = evks[0]
    with pytest.raises(KeyTooLargeError):  # the size decides before any verdict
        screen_evaluation_key(b"x" * 101, public, max_bytes=100)
    info = screen_evaluation_key(data, public, max_bytes=10**9)
    assert info.size == len(data) and info.params_hash == evks[1][1].params_hash
    with pytest.raises(SecretKeyUploadError):
        screen_evaluation_key(data, Inspection(Verdict.SECRET_KEY), max_bytes=10**9)
    with pytest.raises(MalformedKeyError, match="nope"):
        screen_evaluation_key(data, Inspection(Verdict.MALFORMED, reason="nope"), max_bytes=10**9)
    for junk in (b"", "not bytes"):
        with pytest.raises(MalformedKeyError):
            screen_evaluation_key(junk, public, max_bytes=10**9)
    with pytest.raises(ValueError):
        Inspection(Verdict.PUBLIC)  # an accepted key names its parameters


def test_production_inspector_verdicts(evks):
    data = evks[0][0]
    assert evks[0][1].verdict is Verdict.PUBLIC
    for junk in (b"garbage" * 10, data[:1000], data[:-1]):
        assert inspect_upload(junk, P, STEPS, max_bytes=10**9).verdict is Verdict.MALFORMED
    other = inspect_upload(key_upload(CKKSParams(8192, (60, 40, 40, 60), 39)), P, STEPS, max_bytes=10**9)
    assert other.verdict is Verdict.MALFORMED and "does not fit the plan" in other.reason
    fewer = inspect_upload(data, P, (1,), max_bytes=10**9)  # Galois keys the plan does not use
    assert fewer.verdict is Verdict.SECRET_KEY


def test_registry_refuses_on_the_verdict_and_audits(env, evks):
    data = evks[0][0]
    with pytest.raises(SecretKeyUploadError):
        env.reg.register("acme", "k1", data, Inspection(Verdict.SECRET_KEY), actor="a")
    with pytest.raises(MalformedKeyError):
        env.reg.rotate("acme", "k1", data, Inspection(Verdict.MALFORMED), actor="a", grace_s=0)
    with pytest.raises(KeyNotFoundError):
        env.reg.get("acme", "k1")
    reasons = [r["detail"]["reason"] for r in iter_records(env.log_path) if r["event"] == Event.KEY_UPLOAD_REFUSED]
    assert reasons == ["secret_key_present", "malformed"]
