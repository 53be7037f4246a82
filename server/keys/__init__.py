"""Server key registry: evaluation keys per tenant and their NIST SP 800-57 lifecycle.

pre_active -> active -> suspended / deactivated / compromised -> destroyed; only ACTIVE keys are
usable; every transition writes exactly one audit record (:mod:`server.audit`) before it takes
effect; uploads come with an inspector's verdict (:class:`Inspection`; the production inspector is
:func:`inspect_upload`, run in a worker) and those carrying a secret key are refused and audited
(:func:`screen_evaluation_key`).

Exceptions: see :mod:`server.keys._errors` (base :class:`KeyRegistryError`).
"""

from ._errors import (
    KeyAuditError,
    KeyCancelledError,
    KeyExistsError,
    KeyIntegrityError,
    KeyNotFoundError,
    KeyNotUsableError,
    KeyRegistryError,
    KeyStateError,
    KeyTooLargeError,
    MalformedKeyError,
    SecretKeyUploadError,
    UploadRefusedError,
)
from ._registry import KeyLease, KeyRecord, KeyRegistry, RegistryConfig
from ._screen import EvalKeyInfo, Inspection, Verdict, inspect_upload, inspect_upload_keys, screen_evaluation_key
from ._states import TRANSITIONS, KeyState, can_transition
from ._storage import EvalKeyStorage

__all__ = [
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
    "Verdict",
    "can_transition",
    "inspect_upload",
    "inspect_upload_keys",
    "screen_evaluation_key",
]
