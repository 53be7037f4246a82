"""Tamper-evident audit log for key handling (NIST SP 800-53 AU-3/AU-9/AU-10 ideas).

Records are RFC 8785 canonical JSON, committed in an RFC 6962 Merkle tree, with Ed25519-signed
checkpoints. Typical server use::

    signer = SigningKeyDir(settings.audit_key_dir).load()
    log = AuditLog.open(AuditConfig(path), signer, Pseudonymizer(pseudonym_key))
    log.append(Event.PLAINTEXT_FALLBACK, source="server.policy", tenant=t, actor=a, request_id=rid)
    ...
    log.close()                      # final signed checkpoint

and auditor use: :func:`verify_log`, :func:`build_report`, :func:`export_records`.

Exceptions (see :mod:`server.audit._errors`): :class:`AuditError` ⊃ :class:`AuditWriteError`,
:class:`AuditFormatError`, :class:`SigningKeyError`.
"""

from ._errors import AuditError, AuditFormatError, AuditWriteError, SigningKeyError
from ._log import AuditConfig, AuditLog
from ._merkle import MerkleFrontier, inclusion_proof, leaf_hash, merkle_root, node_hash, verify_inclusion
from ._record import Event, Outcome, Pseudonymizer, canonical, format_time, parse_time
from ._report import build_report, export_records, iter_records, render_report
from ._signing import CheckpointSigner, SigningKeyDir, key_id_of, load_public_keys
from ._verify import VerifyResult, checkpoints_path_for, verify_log

__all__ = [
    "AuditConfig",
    "AuditError",
    "AuditFormatError",
    "AuditLog",
    "AuditWriteError",
    "CheckpointSigner",
    "Event",
    "MerkleFrontier",
    "Outcome",
    "Pseudonymizer",
    "SigningKeyDir",
    "SigningKeyError",
    "VerifyResult",
    "build_report",
    "canonical",
    "checkpoints_path_for",
    "export_records",
    "format_time",
    "inclusion_proof",
    "iter_records",
    "key_id_of",
    "leaf_hash",
    "load_public_keys",
    "merkle_root",
    "node_hash",
    "parse_time",
    "render_report",
    "verify_inclusion",
    "verify_log",
]
