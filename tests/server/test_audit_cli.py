"""``cipherlm audit ...`` end to end through :func:`server.cli.main` (the console entry point)."""

from __future__ import annotations

import json

from server.audit import AuditConfig, AuditLog, Event, Pseudonymizer, SigningKeyDir
from server.cli import main


def _make_log(tmp_path):
    key_dir = tmp_path / "keys"
    assert main(["audit", "keygen", "--key-dir", str(key_dir)]) == 0
    log = AuditLog.open(
        AuditConfig(tmp_path / "audit.log"), SigningKeyDir(key_dir).load(), Pseudonymizer(b"p" * 32)
    )
    log.append(
        Event.KEY_UPLOAD_REFUSED,
        source="server.keys",
        outcome="refused",
        tenant="acme",
        actor="alice",
        detail={"reason": "secret_key_present"},
    )
    log.append(Event.PLAINTEXT_FALLBACK, source="server.policy", tenant="acme", actor="alice")
    log.close()
    return key_dir, tmp_path / "audit.log"


def test_keygen_verify_report_export(tmp_path, capsys):
    key_dir, log = _make_log(tmp_path)
    assert main(["audit", "verify", str(log), "--pubkey", str(key_dir / "public")]) == 0
    assert "OK: 3 records" in capsys.readouterr().out
    (tmp_path / "pk").write_bytes(b"p" * 32)
    assert (
        main(
            [
                "audit",
                "report",
                str(log),
                "--pubkey",
                str(key_dir / "public"),
                "--json",
                "--pseudonym-key",
                str(tmp_path / "pk"),
                "--tenant",
                "acme",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    ((name, tenant),) = report["tenants"].items()
    assert name.startswith("acme (h:")
    assert (
        tenant["counts"]["refused_secret_key_uploads"] == 1 and tenant["counts"]["plaintext_fallbacks"] == 1
    )
    out = tmp_path / "export.jsonl"
    assert (
        main(["audit", "export", str(log), "--since", "2000-01-01", "--until", "2999-01-01", "-o", str(out)])
        == 0
    )
    assert len(out.read_bytes().splitlines()) == 3
    assert main(["audit", "export", str(log), "--until", "2000-01-01"]) == 0
    assert capsys.readouterr().out == ""


def test_verify_reports_tampering_with_exit_status_1(tmp_path, capsys):
    key_dir, log = _make_log(tmp_path)
    log.write_bytes(log.read_bytes().replace(b"request.plaintext_fallback", b"request.plaintext_fallbacx"))
    assert main(["audit", "verify", str(log), "--pubkey", str(key_dir / "public")]) == 1
    assert "FAILED at record 2" in capsys.readouterr().out
    assert main(["audit", "report", str(log), "--pubkey", str(key_dir / "public")]) == 1


def test_rotate_and_publish(tmp_path, capsys):
    key_dir, log = _make_log(tmp_path)
    assert main(["audit", "rotate-key", "--key-dir", str(key_dir), "--log", str(log)]) == 0
    assert main(["audit", "publish-key", "--key-dir", str(key_dir), "-o", str(tmp_path / "current.pem")]) == 0
    capsys.readouterr()
    assert main(["audit", "verify", str(log), "--pubkey", str(key_dir / "public"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    # Only the newest key: the checkpoints signed before the rotation cannot be checked.
    assert main(["audit", "verify", str(log), "--pubkey", str(tmp_path / "current.pem")]) == 1


def test_usage_errors_exit_2(tmp_path, capsys):
    assert main(["audit", "verify", str(tmp_path / "missing.log"), "--pubkey", str(tmp_path / "nokey")]) == 2
    assert main(["audit", "keygen", "--key-dir", str(tmp_path / "k")]) == 0
    assert main(["audit", "keygen", "--key-dir", str(tmp_path / "k")]) == 2  # never overwrites a key
    assert "error" in capsys.readouterr().err


def test_strict_and_markdown_report(tmp_path, capsys):
    key_dir, log = _make_log(tmp_path)
    signer = SigningKeyDir(key_dir).load()
    with AuditLog.open(AuditConfig(log, checkpoint_every=100), signer, Pseudonymizer(b"p" * 32)) as writer:
        writer.append(Event.SESSION_OPENED, source="server.private", tenant="acme")
        # simulate a crash: the records after the last checkpoint stay unsigned
        writer._broken = "simulated crash"
    assert main(["audit", "verify", str(log), "--pubkey", str(key_dir / "public")]) == 0
    assert "warning: records 3..4 are not yet covered" in capsys.readouterr().out
    assert main(["audit", "verify", str(log), "--pubkey", str(key_dir / "public"), "--strict"]) == 1
    capsys.readouterr()
    assert main(["audit", "report", str(log)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# Audit report: 5 records") and "refused_secret_key_uploads=1" in out
