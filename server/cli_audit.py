"""``cipherlm audit``: offline verification, reports and exports for auditors; signing-key commands.

Exit status of ``verify``: 0 consistent, 1 tampering or inconsistency found, 2 usage/format error.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from pathlib import Path

from server.audit import (
    AuditConfig,
    AuditError,
    AuditLog,
    Pseudonymizer,
    SigningKeyDir,
    build_report,
    export_records,
    iter_records,
    load_public_keys,
    parse_time,
    render_report,
    verify_log,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``audit`` command group."""
    audit = subparsers.add_parser("audit", help="verify, report on and export the key-handling audit log")
    sub = audit.add_subparsers(dest="audit_command", required=True)

    p = sub.add_parser("verify", help="check a log offline against its signed checkpoints")
    p.add_argument("log", type=Path)
    p.add_argument(
        "--pubkey",
        action="append",
        required=True,
        type=Path,
        help="operator public key file or keyring directory (repeatable)",
    )
    p.add_argument("--checkpoints", type=Path, help="default: LOG.checkpoints")
    p.add_argument("--strict", action="store_true", help="fail if the newest records are not yet signed")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_verify)

    p = sub.add_parser("report", help="per tenant and key: lifecycle, actors, refusals, fallbacks")
    p.add_argument("log", type=Path)
    p.add_argument("--pubkey", action="append", type=Path, help="verify first with these keys")
    p.add_argument("--pseudonym-key", type=Path, help="file with the HMAC pseudonym key (to name a tenant)")
    p.add_argument("--tenant", action="append", help="only these tenants (needs --pseudonym-key)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_report)

    p = sub.add_parser("export", help="records with SINCE <= time < UNTIL, byte-exact")
    p.add_argument("log", type=Path)
    p.add_argument("--since", help="ISO 8601 time or date (UTC if no offset)")
    p.add_argument("--until", help="ISO 8601 time or date, exclusive")
    p.add_argument("-o", "--output", type=Path, help="default: stdout")
    p.set_defaults(func=_export)

    p = sub.add_parser("keygen", help="create the checkpoint signing key")
    p.add_argument("--key-dir", type=Path, required=True)
    p.set_defaults(func=_keygen)

    p = sub.add_parser("rotate-key", help="replace the signing key; the old key signs the handover in LOG")
    p.add_argument("--key-dir", type=Path, required=True)
    p.add_argument("--log", type=Path, required=True, help="the log (its writer must be stopped)")
    p.set_defaults(func=_rotate)

    p = sub.add_parser("publish-key", help="print (or write) the current public key for auditors")
    p.add_argument("--key-dir", type=Path, required=True)
    p.add_argument("-o", "--output", type=Path)
    p.set_defaults(func=_publish)


def _guard(func):
    """Audit errors become a message and exit status 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except (AuditError, OSError, ValueError) as exc:
            print(f"cipherlm audit: error: {exc}", file=sys.stderr)
            return 2

    run.__doc__ = func.__doc__
    return run


@_guard
def _verify(args: argparse.Namespace) -> int:
    """Verify and print the result; 1 if anything is wrong."""
    result = verify_log(args.log, load_public_keys(args.pubkey), checkpoints_path=args.checkpoints)
    if args.json:
        print(json.dumps(result.__dict__, indent=2))
    elif result.ok:
        print(
            f"OK: {result.records} records, {result.checkpoints} checkpoints, {result.covered} signed "
            f"(log {result.log_id})"
        )
        for warning in result.warnings:
            print(f"warning: {warning}")
    else:
        print(f"FAILED at record {result.first_bad}: {result.reason}")
    if not result.ok or (args.strict and result.warnings):
        return 1
    return 0


@_guard
def _report(args: argparse.Namespace) -> int:
    """Print the per-tenant report (after verifying, when keys are given)."""
    if args.pubkey:
        result = verify_log(args.log, load_public_keys(args.pubkey))
        if not result.ok:
            print(
                f"log does not verify (record {result.first_bad}: {result.reason}); no report",
                file=sys.stderr,
            )
            return 1
    report = build_report(iter_records(args.log))
    if args.tenant:
        if not args.pseudonym_key:
            raise ValueError("--tenant needs --pseudonym-key")
        pseudo = Pseudonymizer(args.pseudonym_key.read_bytes().strip())
        wanted = {pseudo.label("tenant", t): t for t in args.tenant}
        report["tenants"] = {f"{wanted[k]} ({k})": v for k, v in report["tenants"].items() if k in wanted}
    print(json.dumps(report, indent=2) if args.json else render_report(report))
    return 0


@_guard
def _export(args: argparse.Namespace) -> int:
    """Write the records of a time range."""
    since = parse_time(args.since) if args.since else None
    until = parse_time(args.until) if args.until else None
    out = args.output.open("wb") if args.output else sys.stdout.buffer
    try:
        for line in export_records(args.log, since, until):
            out.write(line + b"\n")
    finally:
        if args.output:
            out.close()
    return 0


@_guard
def _keygen(args: argparse.Namespace) -> int:
    """Create the first signing key."""
    signer = SigningKeyDir(args.key_dir).create()
    print(
        f"created signing key {signer.key_id} in {args.key_dir}; publish {args.key_dir}/public/ to auditors"
    )
    return 0


@_guard
def _rotate(args: argparse.Namespace) -> int:
    """Rotate the key with a handover record + checkpoint signed by the old key."""
    key_dir = SigningKeyDir(args.key_dir)
    old_signer = key_dir.load()
    log = AuditLog.open(AuditConfig(args.log), old_signer, Pseudonymizer(secrets.token_bytes(32)))
    try:
        old, new = key_dir.rotate(lambda _old, new: log.rotate_signing_key(new))
    finally:
        log.close()
    print(f"rotated signing key {old.key_id} -> {new.key_id}; publish {args.key_dir}/public/{new.key_id}.pem")
    return 0


@_guard
def _publish(args: argparse.Namespace) -> int:
    """Print the key id and PEM, or write the PEM to ``--output``."""
    key_dir = SigningKeyDir(args.key_dir)
    path = key_dir.publish(args.output)
    if args.output is None:
        print(f"# key id {key_dir.load().key_id}")
        sys.stdout.write(path.read_text())
    else:
        print(f"wrote {path}")
    return 0
