"""Exceptions raised by :mod:`server.keys`.

Hierarchy (HTTP mapping for the key endpoints in brackets)::

    KeyRegistryError
    ├── KeyNotFoundError        no such tenant/key id/version                          [404]
    ├── KeyExistsError          key id already registered for this tenant              [409]
    ├── KeyStateError           transition not allowed from the current state          [409]
    ├── KeyNotUsableError       key is not ACTIVE (expired, revoked, suspended, ...)    [403]
    │   └── KeyCancelledError   an in-flight lease was cancelled by a revocation       [409]
    ├── UploadRefusedError      the uploaded evaluation key was refused                 [4xx]
    │   ├── SecretKeyUploadError  it carries a secret key (audited, nothing stored)    [403]
    │   ├── KeyTooLargeError      larger than the configured limit (checked first)     [413]
    │   └── MalformedKeyError     not a parsable evaluation key                        [400]
    ├── KeyIntegrityError       stored material altered or moved to another tenant     [500, audited]
    └── KeyAuditError           the audit record could not be written: nothing changed [503]
"""

from __future__ import annotations


class KeyRegistryError(Exception):
    """Base class of every key-registry error."""


class KeyNotFoundError(KeyRegistryError, LookupError):
    """No key with this tenant, id and version."""


class KeyExistsError(KeyRegistryError):
    """The key id is already registered for this tenant (rotate it instead)."""


class KeyStateError(KeyRegistryError):
    """The requested lifecycle transition is not allowed from the key's current state."""


class KeyNotUsableError(KeyRegistryError):
    """The key is not ACTIVE (or its expiry / grace window has passed)."""


class KeyCancelledError(KeyNotUsableError):
    """In-flight work was cancelled because its key stopped being ACTIVE."""


class UploadRefusedError(KeyRegistryError, ValueError):
    """An uploaded evaluation key was refused; nothing of it was stored."""


class SecretKeyUploadError(UploadRefusedError):
    """The upload carries a secret key. The refusal is audited; the bytes are dropped."""


class KeyTooLargeError(UploadRefusedError):
    """The upload is larger than ``RegistryConfig.max_upload_bytes``."""


class MalformedKeyError(UploadRefusedError):
    """The upload is not a parsable evaluation key."""


class KeyIntegrityError(KeyRegistryError):
    """Stored key material fails its integrity check (altered, or moved to another tenant/key)."""


class KeyAuditError(KeyRegistryError):
    """The audit write failed, so the key operation was not performed."""
