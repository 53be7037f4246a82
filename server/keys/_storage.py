"""Evaluation keys at rest, bound to (tenant, key id, version, fingerprint) with AES-256-GCM.

File ``<root>/<tenant-dir>/<key_id>.v<version>.evk`` = ``MAGIC || nonce(12) || AES-GCM(bytes)`` with
associated data = canonical JSON of ``{tenant, key_id, version, fingerprint}``. The binding is checked
against where the caller *expects* the key to be, so a file copied into another tenant's directory,
renamed to another key or version, or altered in one bit fails authentication; the SHA-256 of the
decrypted bytes must also equal the registered digest (of the canonical bytes the registry stores; the
upload's own fingerprint for records made before canonical storage). Evaluation keys are public material: the
encryption adds integrity and keeps them out of casual reach, it is not what protects clients.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Callable
from pathlib import Path

import rfc8785
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from server._files import write_private

from ._errors import KeyIntegrityError, KeyNotFoundError

__all__ = ["EvalKeyStorage"]

_MAGIC = b"CLMEVK1\n"
_NONCE = 12


class EvalKeyStorage:
    """Integrity-bound files of evaluation keys under ``root``.

    Args:
        root: directory (created 0700).
        storage_key: 32 secret bytes of the operator (settings / secret manager).
        rng: ``n -> n random bytes`` (injected for tests).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        storage_key: bytes,
        *,
        rng: Callable[[int], bytes] = secrets.token_bytes,
    ) -> None:
        if len(storage_key) != 32:
            raise ValueError("storage_key must be 32 bytes")
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._aead = AESGCM(storage_key)
        self._dir_key = hashlib.sha256(b"cipherlm-evk-dir\x00" + storage_key).digest()
        self._rng = rng

    def __repr__(self) -> str:
        return f"EvalKeyStorage({str(self.root)!r})"

    def path(self, tenant: str, key_id: str, version: int) -> Path:
        """Where a key lives; the tenant directory name is an HMAC, not the tenant id."""
        tdir = hmac.new(self._dir_key, tenant.encode(), hashlib.sha256).hexdigest()[:32]
        return self.root / tdir / f"{key_id}.v{version}.evk"

    @staticmethod
    def _aad(tenant: str, key_id: str, version: int, fingerprint: str) -> bytes:
        return rfc8785.dumps(
            {"tenant": tenant, "key_id": key_id, "version": version, "fingerprint": fingerprint}
        )

    def store(self, tenant: str, key_id: str, version: int, fingerprint: str, data: bytes) -> Path:
        """Write ``data`` atomically (temp file, fsync, rename), mode 0600."""
        path = self.path(tenant, key_id, version)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        nonce = self._rng(_NONCE)
        sealed = self._aead.encrypt(nonce, data, self._aad(tenant, key_id, version, fingerprint))
        write_private(path, _MAGIC + nonce, sealed)   # not joined: one copy of hundreds of MB less
        return path

    def load(self, tenant: str, key_id: str, version: int, fingerprint: str, *, sha256: str | None = None) -> bytes:
        """The stored bytes, after checking they belong here and hash to ``sha256`` (default: ``fingerprint``).

        Raises:
            KeyNotFoundError: no file.
            KeyIntegrityError: altered, truncated, or not bound to this tenant/key/version/fingerprint.
        """
        path = self.path(tenant, key_id, version)
        try:
            blob = path.read_bytes()
        except FileNotFoundError as exc:
            raise KeyNotFoundError(f"no stored material for {key_id} v{version}") from exc
        if not blob.startswith(_MAGIC) or len(blob) < len(_MAGIC) + _NONCE + 16:
            raise KeyIntegrityError(f"{path.name}: not a key file")
        view = memoryview(blob)   # the body is hundreds of MB: decrypted from a view, not a sliced copy
        nonce, body = blob[len(_MAGIC) : len(_MAGIC) + _NONCE], view[len(_MAGIC) + _NONCE :]
        try:
            data = self._aead.decrypt(nonce, body, self._aad(tenant, key_id, version, fingerprint))
        except InvalidTag:
            raise KeyIntegrityError(f"{path.name}: altered or not bound to this tenant/key") from None
        if not hmac.compare_digest(hashlib.sha256(data).hexdigest(), sha256 or fingerprint):
            raise KeyIntegrityError(f"{path.name}: fingerprint mismatch")
        return data

    def delete(self, tenant: str, key_id: str, version: int) -> bool:
        """Overwrite with zeros, fsync, unlink (best effort on SSDs/COW filesystems). True if it existed."""
        path = self.path(tenant, key_id, version)
        try:
            fd = os.open(path, os.O_WRONLY)
        except FileNotFoundError:
            return False
        try:
            size = os.fstat(fd).st_size
            os.write(fd, b"\x00" * size)
            os.fsync(fd)
        finally:
            os.close(fd)
        path.unlink()
        return True
