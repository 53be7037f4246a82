"""Ed25519 checkpoint signing keys: create, load, rotate, publish; sign and check checkpoints.

A key directory holds ``current.pem`` (PKCS#8 private key, mode 0600) and ``public/<key_id>.pem``
for every key ever used, which is the keyring an operator publishes to auditors. A key id is the
first 32 hex digits of SHA-256 over the raw 32-byte public key. Rotation writes the new key, then
removes the old private key: a retired key can never sign again, its public half stays published.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from server._files import write_private

from ._errors import AuditFormatError, SigningKeyError
from ._record import canonical

__all__ = [
    "CheckpointSigner",
    "SigningKeyDir",
    "checkpoint_message",
    "key_id_of",
    "load_public_keys",
    "verify_checkpoint_signature",
]

_CHECKPOINT_DOMAIN = b"cipherlm-audit-checkpoint/1\n"


def key_id_of(public_key: Ed25519PublicKey) -> str:
    """Stable short id of a public key (32 hex digits of SHA-256 over its raw bytes)."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:32]


def checkpoint_message(body: dict[str, Any]) -> bytes:
    """The exact bytes a checkpoint signature covers (domain-separated canonical JSON)."""
    return _CHECKPOINT_DOMAIN + canonical(body)


class CheckpointSigner:
    """Signs checkpoints with one Ed25519 private key."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.public_key = private_key.public_key()
        self.key_id = key_id_of(self.public_key)

    def __repr__(self) -> str:
        return f"CheckpointSigner(key_id={self.key_id!r})"

    @classmethod
    def generate(cls) -> CheckpointSigner:
        """A fresh random key (tests and ``keygen``)."""
        return cls(Ed25519PrivateKey.generate())

    def sign(self, body: dict[str, Any]) -> str:
        """Base64 signature over :func:`checkpoint_message` of ``body``."""
        return base64.b64encode(self._key.sign(checkpoint_message(body))).decode()


def verify_checkpoint_signature(
    body: dict[str, Any], sig: str, keys: dict[str, Ed25519PublicKey]
) -> str | None:
    """None if ``sig`` is valid under the key named by ``body['key_id']``, else the reason."""
    key = keys.get(body.get("key_id", ""))
    if key is None:
        return f"signed by key {body.get('key_id')}, which is not among the given public keys"
    try:
        key.verify(base64.b64decode(sig, validate=True), checkpoint_message(body))
    except (InvalidSignature, binascii.Error, ValueError):
        return f"signature does not verify under key {body['key_id']}"
    return None


def _load_public_key(path: Path) -> Ed25519PublicKey:
    """PEM SubjectPublicKeyInfo, or 64 hex digits of a raw key."""
    data = path.read_bytes()
    try:
        if data.lstrip().startswith(b"-----BEGIN"):
            key = serialization.load_pem_public_key(data)
        else:
            key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(data.decode().strip()))
    except ValueError as exc:
        raise SigningKeyError(f"{path}: not an Ed25519 public key") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise SigningKeyError(f"{path}: not an Ed25519 public key")
    return key


def load_public_keys(paths: Iterable[str | os.PathLike[str]]) -> dict[str, Ed25519PublicKey]:
    """Keyring ``{key_id: key}`` from files or directories of ``*.pem``/``*.pub`` files."""
    keys: dict[str, Ed25519PublicKey] = {}
    for item in map(Path, paths):
        files = sorted(p for p in item.iterdir() if p.suffix in (".pem", ".pub")) if item.is_dir() else [item]
        for file in files:
            key = _load_public_key(file)
            keys[key_id_of(key)] = key
    if not keys:
        raise SigningKeyError("no public key given")
    return keys


def _private_pem(signer: CheckpointSigner) -> bytes:
    return signer._key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


class SigningKeyDir:
    """The operator's checkpoint key directory (``current.pem`` + ``public/`` keyring)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @property
    def _current(self) -> Path:
        return self.path / "current.pem"

    def create(self) -> CheckpointSigner:
        """Make the first key; refuses to overwrite an existing one."""
        if self._current.exists():
            raise SigningKeyError(f"{self._current} exists; use rotate")
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return self._install(CheckpointSigner.generate())

    def load(self) -> CheckpointSigner:
        """The current signer; refuses a private key readable by group or others."""
        try:
            mode = self._current.stat().st_mode
            data = self._current.read_bytes()
        except FileNotFoundError as exc:
            raise SigningKeyError(f"no signing key at {self._current}; run `cipherlm audit keygen`") from exc
        if mode & 0o077:
            raise SigningKeyError(f"{self._current} is readable by others (mode {mode & 0o777:o}); chmod 600")
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except ValueError as exc:
            raise SigningKeyError(f"{self._current}: not a PEM private key") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise SigningKeyError(f"{self._current}: not an Ed25519 key")
        return CheckpointSigner(key)

    def rotate(
        self, handover: Callable[[CheckpointSigner, CheckpointSigner], None] | None = None
    ) -> tuple[CheckpointSigner, CheckpointSigner]:
        """Replace the current key; returns ``(old, new)``. The old private key is gone afterwards.

        ``handover(old, new)`` runs while both keys exist (the new one staged as ``next.pem``): it is
        where the audit log records the change under the old key. If it raises, nothing changes.
        """
        old = self.load()
        new = CheckpointSigner.generate()
        staged = self.path / "next.pem"
        write_private(staged, _private_pem(new))
        try:
            if handover is not None:
                handover(old, new)
        except BaseException:
            staged.unlink()
            raise
        self._install(new)
        staged.unlink()
        return old, new

    def publish(self, out: str | os.PathLike[str] | None = None) -> Path:
        """Copy the current public key to ``out`` (default: the keyring file); returns its path."""
        signer = self.load()
        src = self.path / "public" / f"{signer.key_id}.pem"
        if out is None:
            return src
        Path(out).write_bytes(src.read_bytes())
        return Path(out)

    def _install(self, signer: CheckpointSigner) -> CheckpointSigner:
        pem = _private_pem(signer)
        (self.path / "public").mkdir(mode=0o755, exist_ok=True)
        pub = signer.public_key.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        (self.path / "public" / f"{signer.key_id}.pem").write_bytes(pub)
        write_private(self._current, pem)  # atomic replace: the old private key file is unlinked
        return signer


def parse_signed_line(line: bytes) -> tuple[dict[str, Any], str]:
    """Split a checkpoint line into ``(body, signature)``; :class:`AuditFormatError` if malformed."""
    import json

    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise AuditFormatError("checkpoint is not JSON") from exc
    if not isinstance(obj, dict) or not isinstance(obj.get("sig"), str):
        raise AuditFormatError("checkpoint has no signature")
    sig = obj.pop("sig")
    return obj, sig
