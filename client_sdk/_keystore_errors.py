"""Exceptions raised by :mod:`client_sdk.keystore`.

Hierarchy (``KeyStoreError`` derives from the SDK's base, :class:`client_sdk._exceptions.CipherlmError`)::

    KeyStoreError
    ├── InvalidKeyStoreAccess    wrong passphrase, or a key/index/log file edited, moved or swapped:
    │                            deliberately ONE opaque error (like pyca's ``InvalidToken``), so the
    │                            store never tells an attacker which guess or edit got further
    ├── KeyStorePermissionError  the store's files are readable by group/others (chmod 600/700)
    ├── KeyStoreNotFoundError    no such key id / version, or no store at the path
    └── KeyUnusableError         the version was destroyed, or its rotation grace window ended
"""

from __future__ import annotations

from ._exceptions import CipherlmError


class KeyStoreError(CipherlmError):
    """Base class of every key-store error."""


class InvalidKeyStoreAccess(KeyStoreError):
    """Wrong passphrase, or key store contents edited, moved or swapped. Deliberately uninformative."""

    def __init__(self) -> None:
        super().__init__("wrong passphrase or key store altered")


class KeyStorePermissionError(KeyStoreError, PermissionError):
    """A key-store file or directory is accessible to group or others."""


class KeyStoreNotFoundError(KeyStoreError, LookupError):
    """No key store at the path, or no such key id / version in it."""


class KeyUnusableError(KeyStoreError):
    """The key version was destroyed or its rotation grace window has ended."""
