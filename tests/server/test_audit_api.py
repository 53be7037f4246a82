"""The public API of ``server.audit`` and ``server.keys`` is their ``__all__`` (pinned here)."""

from __future__ import annotations

import server.audit
import server.keys

AUDIT = {
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
}
KEYS = {
    "EvalKeyInfo",
    "EvalKeyStorage",
    "Inspection",
    "KeyAuditError",
    "KeyCancelledError",
    "KeyExistsError",
    "KeyIntegrityError",
    "KeyLease",
    "KeyNotFoundError",
    "KeyNotUsableError",
    "KeyRecord",
    "KeyRegistry",
    "KeyRegistryError",
    "KeyState",
    "KeyStateError",
    "KeyTooLargeError",
    "MalformedKeyError",
    "RegistryConfig",
    "SecretKeyUploadError",
    "TRANSITIONS",
    "UploadRefusedError",
    "can_transition",
    "Verdict",
    "inspect_upload",
    "inspect_upload_keys",
    "screen_evaluation_key",
}


def test_exported_members():
    assert set(server.audit.__all__) == AUDIT
    assert set(server.keys.__all__) == KEYS
    for module in (server.audit, server.keys):
        for name in module.__all__:
            assert getattr(module, name) is not None


def test_one_exception_hierarchy_per_package():
    audit_errors = [getattr(server.audit, n) for n in AUDIT if n.endswith("Error")]
    assert all(issubclass(e, server.audit.AuditError) for e in audit_errors)
    key_errors = [getattr(server.keys, n) for n in KEYS if n.endswith("Error")]
    assert all(issubclass(e, server.keys.KeyRegistryError) for e in key_errors)
