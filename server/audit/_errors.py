"""Exceptions raised by :mod:`server.audit`.

Hierarchy::

    AuditError
    ├── AuditWriteError        a record or checkpoint could not be made durable; the caller's
    │                          operation must fail (NIST SP 800-53 AU-5: no unaudited key change)
    ├── AuditFormatError       a log or checkpoint file is not in the expected format
    └── SigningKeyError        a signing key is missing, malformed or has wrong permissions

Verification failures are *results*, not exceptions: :func:`server.audit.verify_log` returns a
:class:`~server.audit.VerifyResult` naming the first bad record and why.
"""

from __future__ import annotations


class AuditError(Exception):
    """Base class of every audit error."""


class AuditWriteError(AuditError):
    """A record could not be appended durably (disk full, I/O error, log closed or broken)."""


class AuditFormatError(AuditError, ValueError):
    """A log, checkpoint or key file cannot be parsed."""


class SigningKeyError(AuditError):
    """A checkpoint signing key is missing, malformed or unsafe to use."""
