"""The audit log writer: records, pseudonyms, checkpoints, durability, failure, reopening, reports."""

from __future__ import annotations

import json
import os

import hypothesis.strategies as st
import pytest
import rfc8785
from hypothesis import given, settings

from server.audit import (
    AuditConfig,
    AuditFormatError,
    AuditLog,
    AuditWriteError,
    CheckpointSigner,
    Event,
    Pseudonymizer,
    SigningKeyDir,
    SigningKeyError,
    build_report,
    checkpoints_path_for,
    export_records,
    iter_records,
    parse_time,
    render_report,
    verify_log,
)
from server.audit._record import fast_canonical

PSEUDO_KEY = b"p" * 32


class Clock:
    """Injected time: starts at 2026-01-01T00:00:00Z, moves only when told."""

    def __init__(self, t: float = 1767225600.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def signer():
    return CheckpointSigner.generate()


def open_log(tmp_path, signer, clock, **cfg):
    cfg.setdefault("checkpoint_every", 10)
    return AuditLog.open(
        AuditConfig(tmp_path / "audit.log", **cfg),
        signer,
        Pseudonymizer(PSEUDO_KEY),
        clock=clock,
        rng=lambda n: b"\x01" * n,
    )


def keys_of(*signers):
    return {s.key_id: s.public_key for s in signers}


def test_records_are_canonical_pseudonymous_and_verify(tmp_path, signer, clock):
    with open_log(tmp_path, signer, clock) as log:
        rec = log.append(
            Event.KEY_REGISTERED,
            source="server.keys",
            tenant="acme",
            actor="alice",
            key_id="k1",
            key_version=1,
            key_fingerprint="ab" * 32,
            state_to="pre_active",
            request_id="req-1",
            detail={"size": 1234},
        )
    line = (tmp_path / "audit.log").read_bytes().split(b"\n")[1]
    assert line == rfc8785.dumps(rec)
    assert rec["tenant"] == Pseudonymizer(PSEUDO_KEY).label("tenant", "acme") != "acme"
    assert b"acme" not in line and b"alice" not in line and b"req-1" not in line
    assert rec["time"] == "2026-01-01T00:00:00.000000Z"
    result = verify_log(tmp_path / "audit.log", keys_of(signer))
    assert result.ok and result.records == 2 and result.covered == 2 and not result.warnings


@pytest.mark.parametrize(
    "detail", [{"prompt": "x" * 500}, {"blob": b"\x00\x01"}, {"nested": {"a": 1}}, {"Bad-Key": 1}, {"f": 1.5}]
)
def test_detail_refuses_payloads(tmp_path, signer, clock, detail):
    with open_log(tmp_path, signer, clock) as log:
        with pytest.raises(AuditFormatError):
            log.append(Event.SESSION_OPENED, source="server.sessions", detail=detail)
        assert log.size == 1  # nothing written


def test_checkpoints_by_count_time_and_close(tmp_path, signer, clock):
    log = open_log(tmp_path, signer, clock, checkpoint_every=5, checkpoint_interval_s=60)
    for _ in range(8):  # + the creation record = 9
        log.append(Event.SESSION_OPENED, source="s")
    cps = checkpoints_path_for(tmp_path / "audit.log")
    assert [json.loads(x)["size"] for x in cps.read_bytes().splitlines()] == [5]
    clock.t += 59
    assert log.checkpoint_if_due() is None
    clock.t += 1
    assert log.checkpoint_if_due()["size"] == 9
    log.append(Event.SESSION_CLOSED, source="s")
    log.close()
    sizes = [json.loads(x)["size"] for x in cps.read_bytes().splitlines()]
    assert sizes == [5, 9, 10]
    assert verify_log(tmp_path / "audit.log", keys_of(signer)).ok


def test_unsigned_tail_is_a_warning(tmp_path, signer, clock):
    log = open_log(tmp_path, signer, clock, checkpoint_every=100)
    log.checkpoint()
    log.append(Event.SESSION_OPENED, source="s")
    result = verify_log(tmp_path / "audit.log", keys_of(signer))
    assert result.ok and result.covered == 1 and result.records == 2 and result.warnings
    log.close()


def test_write_failure_fails_the_operation_and_breaks_the_log(tmp_path, signer, clock, monkeypatch):
    log = open_log(tmp_path, signer, clock)
    real_write = os.write

    def disk_full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", disk_full)
    with pytest.raises(AuditWriteError):
        log.append(Event.KEY_ACTIVATED, source="server.keys")
    monkeypatch.setattr(os, "write", real_write)
    with pytest.raises(AuditWriteError):  # stays refused until reopened
        log.append(Event.KEY_ACTIVATED, source="server.keys")
    log.close()


def test_torn_write_is_discarded_on_reopen(tmp_path, signer, clock):
    with open_log(tmp_path, signer, clock) as log:
        log.append(Event.SESSION_OPENED, source="s")
    with open(tmp_path / "audit.log", "ab") as f:
        f.write(b'{"actor":null,"det')  # crash mid-write
    assert verify_log(tmp_path / "audit.log", keys_of(signer)).first_bad == 2
    with open_log(tmp_path, signer, clock) as log:
        assert log.size == 4  # created, opened, + torn-write notice, reopened
    events = [r["event"] for r in iter_records(tmp_path / "audit.log")]
    assert events == [Event.LOG_CREATED, Event.SESSION_OPENED, Event.TORN_WRITE_DISCARDED, Event.LOG_OPENED]
    assert verify_log(tmp_path / "audit.log", keys_of(signer)).ok


def test_reopen_refuses_tampered_log_and_wrong_key(tmp_path, signer, clock):
    with open_log(tmp_path, signer, clock) as log:
        log.append(Event.SESSION_OPENED, source="s")
    with pytest.raises(SigningKeyError):
        open_log(tmp_path, CheckpointSigner.generate(), clock)
    data = (tmp_path / "audit.log").read_bytes().replace(b"session.opened", b"session.closed")
    (tmp_path / "audit.log").write_bytes(data)
    with pytest.raises(AuditFormatError):
        open_log(tmp_path, signer, clock)


def test_one_writer_at_a_time(tmp_path, signer, clock):
    with open_log(tmp_path, signer, clock):
        with pytest.raises(AuditWriteError):
            open_log(tmp_path, signer, clock)


def test_signing_key_rotation_handover(tmp_path, clock):
    key_dir = SigningKeyDir(tmp_path / "keys")
    first = key_dir.create()
    assert oct((tmp_path / "keys" / "current.pem").stat().st_mode & 0o777) == "0o600"
    log = open_log(tmp_path, first, clock)
    old, new = key_dir.rotate(lambda _o, n: log.rotate_signing_key(n))
    assert old.key_id == first.key_id and key_dir.load().key_id == new.key_id
    log.append(Event.SESSION_OPENED, source="s")
    log.close()
    assert verify_log(tmp_path / "audit.log", keys_of(old, new)).ok
    # The auditor needs the whole published keyring: with the new key alone the old checkpoints fail.
    only_new = verify_log(tmp_path / "audit.log", keys_of(new))
    assert not only_new.ok and only_new.first_bad == 0
    with open_log(tmp_path, new, clock):  # the server restarts with the new key
        pass


def test_rotation_handover_failure_keeps_the_old_key(tmp_path):
    key_dir = SigningKeyDir(tmp_path / "keys")
    first = key_dir.create()

    def fail(_old, _new):
        raise AuditWriteError("disk full")

    with pytest.raises(AuditWriteError):
        key_dir.rotate(fail)
    assert key_dir.load().key_id == first.key_id and not (tmp_path / "keys" / "next.pem").exists()


def test_loose_key_permissions_refused(tmp_path):
    key_dir = SigningKeyDir(tmp_path / "keys")
    key_dir.create()
    os.chmod(tmp_path / "keys" / "current.pem", 0o644)
    with pytest.raises(SigningKeyError):
        key_dir.load()


def test_report_and_export(tmp_path, signer, clock):
    with open_log(tmp_path, signer, clock) as log:
        for event, detail in [
            (Event.KEY_UPLOAD_REFUSED, {"reason": "secret_key_present"}),
            (Event.KEY_UPLOAD_REFUSED, {"reason": "too_large"}),
            (Event.PLAINTEXT_FALLBACK, {}),
            (Event.PLAINTEXT_FALLBACK, {}),
        ]:
            clock.t += 3600
            log.append(event, source="server", outcome="refused", tenant="acme", actor="bob", detail=detail)
        log.append(
            Event.KEY_REGISTERED,
            source="server.keys",
            tenant="acme",
            actor="bob",
            key_id="k1",
            key_version=1,
            key_fingerprint="cd" * 32,
            state_to="pre_active",
        )
        log.append(
            Event.KEY_ACTIVATED,
            source="server.keys",
            tenant="acme",
            actor="ops",
            key_id="k1",
            key_version=1,
            key_fingerprint="cd" * 32,
            state_from="pre_active",
            state_to="active",
        )
        log.append(Event.PLAINTEXT_FALLBACK, source="server", tenant="other")
    report = build_report(iter_records(tmp_path / "audit.log"))
    acme = report["tenants"][Pseudonymizer(PSEUDO_KEY).label("tenant", "acme")]
    assert acme["counts"]["refused_secret_key_uploads"] == 1
    assert acme["counts"]["refused_other_uploads"] == 1
    assert acme["counts"]["plaintext_fallbacks"] == 2
    version = acme["keys"]["k1"]["versions"]["1"]
    assert version["state"] == "active" and [e["event"] for e in version["events"]] == [
        Event.KEY_REGISTERED,
        Event.KEY_ACTIVATED,
    ]
    assert "k1 v1 — now active" in render_report(report)
    lines = list(
        export_records(
            tmp_path / "audit.log", parse_time("2026-01-01T01:00:00Z"), parse_time("2026-01-01T03:00:00Z")
        )
    )
    assert [json.loads(x)["event"] for x in lines] == [Event.KEY_UPLOAD_REFUSED, Event.KEY_UPLOAD_REFUSED]


_json_str = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=20)


@settings(max_examples=200, deadline=None)
@given(
    st.fixed_dictionaries(
        {
            "tenant": st.one_of(st.none(), _json_str),
            "seq": st.integers(0, 2**53 - 1),
            "detail": st.dictionaries(
                st.from_regex(r"[a-z][a-z0-9_.]{0,10}", fullmatch=True),
                st.one_of(st.booleans(), st.none(), st.integers(-(2**53) + 1, 2**53 - 1), _json_str),
                max_size=4,
            ),
        }
    )
)
def test_fast_canonical_equals_rfc8785_on_the_record_schema(obj):
    assert fast_canonical(obj) == rfc8785.dumps(obj)


def test_reopen_refuses_a_log_shorter_than_its_last_checkpoint(tmp_path, signer, clock):
    with open_log(tmp_path, signer, clock) as log:
        log.append(Event.SESSION_OPENED, source="s")
    lines = (tmp_path / "audit.log").read_bytes().split(b"\n")
    (tmp_path / "audit.log").write_bytes(lines[0] + b"\n")
    with pytest.raises(AuditFormatError, match="last checkpoint"):
        open_log(tmp_path, signer, clock)


def test_torn_checkpoint_line_is_cut_on_reopen(tmp_path, signer, clock):
    with open_log(tmp_path, signer, clock) as log:
        log.append(Event.SESSION_OPENED, source="s")
    with open(checkpoints_path_for(tmp_path / "audit.log"), "ab") as f:
        f.write(b'{"key_id":"ab')  # crash while writing a checkpoint
    with open_log(tmp_path, signer, clock) as log:
        log.append(Event.SESSION_CLOSED, source="s")
    assert verify_log(tmp_path / "audit.log", keys_of(signer)).ok
