"""Client key store: locally generated keys, the secret part encrypted at rest with a passphrase.

Layout of a store directory (0700; every file 0600)::

    keystore.json             KDF parameters + salt, the index of keys/versions, HMAC over both
    keys/<key_id>/v<N>.secret MAGIC || nonce || AES-256-GCM(secret), AAD = {key_id, version, fingerprint}
    keys/<key_id>/v<N>.public the public evaluation material to upload (SHA-256 pinned in the index)
    events.log                the store's own key events, an HMAC chain; its length and head are in
                              the index, so dropping or editing an event is noticed

One master key is derived from the passphrase (Argon2id when ``cryptography`` has it, else scrypt),
and HKDF splits it into the file-encryption, index-MAC and log-MAC keys. Associated data is taken
from where a file is *expected* (key id and version from the request, not from the file), so a file
moved to another key id or version, copied from another store, or edited fails to open. All such
failures, and a wrong passphrase, raise the same :class:`InvalidKeyStoreAccess`.

Secrets never leave this module serialized unless asked for with a keyword-only ``unsafe_...`` flag;
:class:`KeyHandle` gives the secret to the code that needs it in-process and refuses pickling.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import rfc8785
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from ._keystore_errors import (
    InvalidKeyStoreAccess,
    KeyStoreError,
    KeyStoreNotFoundError,
    KeyStorePermissionError,
    KeyUnusableError,
)

try:  # cryptography >= 44
    from cryptography.hazmat.primitives.kdf.argon2 import Argon2id
except ImportError:  # pragma: no cover - depends on the installed cryptography
    Argon2id = None

__all__ = [
    "InvalidKeyStoreAccess",
    "KdfParams",
    "KeyHandle",
    "KeyMaterial",
    "KeyStore",
    "KeyStoreConfig",
    "KeyStoreError",
    "KeyStoreNotFoundError",
    "KeyStorePermissionError",
    "KeyUnusableError",
]

FORMAT = "cipherlm-keystore/1"
_MAGIC = b"CLMKS1\n"
_INDEX = "keystore.json"
_LOG = "events.log"


class KeyMaterial(NamedTuple):
    """What a key generator returns: the secret serialization and the public evaluation material."""

    secret: bytes
    public: bytes


@dataclass(frozen=True)
class KdfParams:
    """Passphrase KDF settings (stored in the index; changing them needs a new store).

    Defaults follow OWASP's 2023 guidance: Argon2id m=64 MiB, t=3, p=4; scrypt N=2^17, r=8, p=1.
    """

    name: str = "argon2id" if Argon2id is not None else "scrypt"
    memory_kib: int = 65536
    iterations: int = 3
    lanes: int = 4
    n: int = 2**17
    r: int = 8
    p: int = 1

    def __post_init__(self) -> None:
        if self.name not in ("argon2id", "scrypt"):
            raise ValueError("KDF must be argon2id or scrypt")
        if self.name == "argon2id" and Argon2id is None:
            raise ValueError("this cryptography build has no Argon2id; use scrypt")
        if self.n < 2 or self.n & (self.n - 1):
            raise ValueError("scrypt n must be a power of two")

    def derive(self, passphrase: bytes, salt: bytes) -> bytes:
        """32-byte master key."""
        if self.name == "argon2id":
            return Argon2id(
                salt=salt,
                length=32,
                iterations=self.iterations,
                lanes=self.lanes,
                memory_cost=self.memory_kib,
            ).derive(passphrase)
        return Scrypt(salt=salt, length=32, n=self.n, r=self.r, p=self.p).derive(passphrase)


@dataclass(frozen=True)
class KeyStoreConfig:
    """Store settings: KDF and the bound on a rotation's grace window."""

    kdf: KdfParams = KdfParams()
    max_grace_s: float = 7 * 86400.0

    def __post_init__(self) -> None:
        if self.max_grace_s < 0:
            raise ValueError("max_grace_s must be >= 0")


class _Keys:
    """Subkeys derived from the master key (never stored)."""

    def __init__(self, master: bytes) -> None:
        def sub(label: bytes) -> bytes:
            return HKDF(hashes.SHA256(), 32, salt=None, info=b"cipherlm-keystore/" + label).derive(master)

        self.aead = AESGCM(sub(b"file"))
        self.index_mac = sub(b"index")
        self.log_mac = sub(b"log")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _write_private(path: Path, data: bytes) -> None:
    """Atomic write with mode 0600 from the first byte."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _check_private(path: Path) -> None:
    """Refuse files/dirs that group or others can access (like ssh does for its keys)."""
    mode = path.stat().st_mode
    if stat.S_IMODE(mode) & 0o077:
        raise KeyStorePermissionError(f"{path} is accessible to others (mode {stat.S_IMODE(mode):o})")


class KeyHandle:
    """In-process access to one key version. Checks usability on every access; never pickles."""

    def __init__(self, store: KeyStore, key_id: str, version: int) -> None:
        self._store, self.key_id, self.version = store, key_id, version

    def __repr__(self) -> str:
        return f"KeyHandle(key_id={self.key_id!r}, version={self.version})"

    def __reduce__(self) -> Any:
        raise TypeError("KeyHandle holds access to a secret key and cannot be pickled")

    def check(self) -> None:
        """Raise :class:`KeyUnusableError` if the version was destroyed or its grace window ended."""
        self._store._check_usable(self.key_id, self.version)

    def secret_material(self) -> bytes:
        """The decrypted secret serialization, for building the local crypto context now."""
        self.check()
        return self._store._read_secret(self.key_id, self.version)

    def public_material(self) -> bytes:
        """The public evaluation material (what gets uploaded)."""
        self.check()
        return self._store._read_public(self.key_id, self.version)


class KeyStore:
    """A passphrase-protected directory of client keys. Use :meth:`create` or :meth:`open`.

    Args (both constructors):
        path: the store directory.
        passphrase: str or bytes, never stored.
        clock: epoch seconds (injected for exact grace-window tests).
        rng: ``n -> n random bytes`` (injected for known-answer tests).
    """

    def __init__(
        self,
        path: Path,
        keys: _Keys,
        index: dict[str, Any],
        header: dict[str, Any],
        clock: Callable[[], float],
        rng: Callable[[int], bytes],
        config: KeyStoreConfig,
    ) -> None:
        self.path, self._keys, self._index, self._header = path, keys, index, header
        self._clock, self._rng, self.config = clock, rng, config
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"KeyStore({str(self.path)!r})"

    def __reduce__(self) -> Any:
        raise TypeError("KeyStore holds derived keys and cannot be pickled")

    # -- create / open -------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        passphrase: str | bytes,
        *,
        config: KeyStoreConfig | None = None,
        clock: Callable[[], float] = time.time,
        rng: Callable[[int], bytes] = secrets.token_bytes,
    ) -> KeyStore:
        """Create an empty store at ``path`` (which must not exist or be empty)."""
        path, config = Path(path), config or KeyStoreConfig()
        if (path / _INDEX).exists():
            raise KeyStoreError(f"a key store already exists at {path}")
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path, 0o700)
        (path / "keys").mkdir(mode=0o700, exist_ok=True)
        salt = rng(16)
        header = {
            "format": FORMAT,
            "kdf": {**asdict(config.kdf), "salt": _b64(salt)},
            "max_grace_s": config.max_grace_s,
        }
        store = cls(
            path,
            _Keys(config.kdf.derive(_passphrase(passphrase), salt)),
            {"keys": {}, "log": {"count": 0, "head": ""}},
            header,
            clock,
            rng,
            config,
        )
        store._log_event("store.created", None, None, {})
        return store

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        passphrase: str | bytes,
        *,
        clock: Callable[[], float] = time.time,
        rng: Callable[[int], bytes] = secrets.token_bytes,
    ) -> KeyStore:
        """Open a store; wrong passphrase or any tampering -> :class:`InvalidKeyStoreAccess`."""
        path = Path(path)
        if not (path / _INDEX).exists():
            raise KeyStoreNotFoundError(f"no key store at {path}")
        for item in (path, path / _INDEX):
            _check_private(item)
        header, index, mac = _parse_index((path / _INDEX).read_bytes())
        kdf = dict(header["kdf"])
        try:
            salt = base64.b64decode(kdf.pop("salt"), validate=True)
            config = KeyStoreConfig(kdf=KdfParams(**kdf), max_grace_s=float(header["max_grace_s"]))
        except (KeyError, TypeError, ValueError):
            raise InvalidKeyStoreAccess() from None
        keys = _Keys(config.kdf.derive(_passphrase(passphrase), salt))
        if not hmac.compare_digest(_index_mac(keys, header, index), mac):
            raise InvalidKeyStoreAccess()
        store = cls(path, keys, index, header, clock, rng, config)
        _cut_torn_line(path / _LOG)
        store.events()  # verifies the local log against the head pinned in the index
        return store

    # -- key operations ------------------------------------------------------------------------
    def generate(self, generator: Callable[[], KeyMaterial], *, key_id: str | None = None) -> KeyHandle:
        """Create a new key (version 1, primary) from ``generator()``; returns its handle."""
        with self._lock:
            key_id = key_id or "k_" + self._rng(8).hex()
            if key_id in self._index["keys"]:
                raise KeyStoreError(f"key {key_id} exists; rotate it")
            _check_key_id(key_id)
            material = generator()  # first: a failing generator must leave the store untouched
            self._index["keys"][key_id] = {"primary": 1, "versions": {}}
            self._add_version(key_id, 1, material)
            return KeyHandle(self, key_id, 1)

    def rotate(self, key_id: str, generator: Callable[[], KeyMaterial], *, grace_s: float) -> KeyHandle:
        """New version becomes primary; the previous one stays usable for ``grace_s`` seconds."""
        if not 0 <= grace_s <= self.config.max_grace_s:
            raise ValueError(f"grace_s must be within [0, {self.config.max_grace_s}]")
        with self._lock:
            entry = self._entry(key_id)
            material = generator()
            old = entry["primary"]
            new = max(int(v) for v in entry["versions"]) + 1
            info = entry["versions"][str(old)]
            if info["state"] == "active":
                now = self._clock()
                info.update(state="retired", retired_at=now, usable_until=now + grace_s)
            entry["primary"] = new
            self._add_version(key_id, new, material, rotated_from=old, grace_s=grace_s)
            return KeyHandle(self, key_id, new)

    def destroy(self, key_id: str, version: int | None = None) -> None:
        """Overwrite and delete a version's files (all versions if None); the key can never be used again."""
        with self._lock:
            entry = self._entry(key_id)
            targets = [version] if version is not None else sorted(int(v) for v in entry["versions"])
            for v in targets:
                info = self._version(key_id, v)
                if info["state"] == "destroyed":
                    continue
                for suffix in (".secret", ".public"):
                    _shred(self._file(key_id, v, suffix))
                info.update(state="destroyed", destroyed_at=self._clock())
                self._log_event("key.destroyed", key_id, v, {})

    def key(self, key_id: str, version: int | None = None) -> KeyHandle:
        """A handle on ``version`` (default: the primary). Raises if it is not usable now."""
        with self._lock:
            version = self._entry(key_id)["primary"] if version is None else version
            handle = KeyHandle(self, key_id, version)
            handle.check()
            return handle

    def keys(self) -> dict[str, dict[str, Any]]:
        """Metadata only: ``{key_id: {"primary": v, "versions": {v: {...state, times, fingerprint}}}}``."""
        with self._lock:
            return json.loads(json.dumps(self._index["keys"]))

    def export(
        self, key_id: str, version: int | None = None, *, unsafe_include_secret: bool = False
    ) -> bytes:
        """JSON bundle of a version's public material; the secret only with ``unsafe_include_secret=True``."""
        handle = self.key(key_id, version)
        bundle = {
            "format": FORMAT + "+export",
            "key_id": key_id,
            "version": handle.version,
            "public": _b64(handle.public_material()),
        }
        if unsafe_include_secret:
            bundle["secret"] = _b64(handle.secret_material())
            self._log_event("key.secret_exported", key_id, handle.version, {})
        return rfc8785.dumps(bundle)

    # -- local event log -----------------------------------------------------------------------
    def events(self) -> list[dict[str, Any]]:
        """The store's own key events, after checking their HMAC chain against the index."""
        path = self.path / _LOG
        lines = path.read_bytes().split(b"\n")[:-1] if path.exists() else []
        head, out = "", []
        for line in lines:
            try:
                event = json.loads(line)
                mac = event.pop("mac")
            except (ValueError, KeyError, AttributeError):
                raise InvalidKeyStoreAccess() from None
            if not hmac.compare_digest(_log_mac(self._keys, head, event), mac) or event.get("seq") != len(
                out
            ):
                raise InvalidKeyStoreAccess()
            head = mac
            out.append(event)
        pinned = self._index["log"]
        if len(out) < pinned["count"] or (
            pinned["count"] and _chain_head_at(lines, pinned["count"]) != pinned["head"]
        ):
            raise InvalidKeyStoreAccess()
        return out

    def _log_event(self, event: str, key_id: str | None, version: int | None, detail: dict[str, Any]) -> None:
        """Append one HMAC-chained event (fsync), then pin the new head in the index."""
        log = self._index["log"]
        body = {
            "seq": log["count"],
            "time": self._clock(),
            "event": event,
            "key_id": key_id,
            "version": version,
            "detail": detail,
        }
        mac = _log_mac(self._keys, log["head"], body)
        fd = os.open(self.path / _LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, json.dumps({**body, "mac": mac}, sort_keys=True).encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        log.update(count=log["count"] + 1, head=mac)
        self._save_index()

    # -- internals -----------------------------------------------------------------------------
    def _add_version(self, key_id: str, version: int, material: KeyMaterial, **detail: Any) -> None:
        if isinstance(material, (bytes, bytearray)):
            material = KeyMaterial(bytes(material), b"")
        fingerprint = hashlib.sha256(material.public).hexdigest()
        kdir = self.path / "keys" / key_id
        kdir.mkdir(mode=0o700, exist_ok=True)
        nonce = self._rng(12)
        sealed = self._keys.aead.encrypt(nonce, bytes(material.secret), _aad(key_id, version, fingerprint))
        _write_private(self._file(key_id, version, ".secret"), _MAGIC + nonce + sealed)
        _write_private(self._file(key_id, version, ".public"), bytes(material.public))
        self._index["keys"][key_id]["versions"][str(version)] = {
            "state": "active",
            "created_at": self._clock(),
            "public_fingerprint": fingerprint,
        }
        self._log_event("key.created" if version == 1 else "key.rotated", key_id, version, detail)

    def _check_usable(self, key_id: str, version: int) -> None:
        info = self._version(key_id, version)
        if info["state"] == "destroyed":
            raise KeyUnusableError(f"key {key_id} v{version} was destroyed")
        if info["state"] == "retired" and self._clock() >= info["usable_until"]:
            raise KeyUnusableError(f"key {key_id} v{version} was rotated and its grace window has ended")

    def _read_secret(self, key_id: str, version: int) -> bytes:
        blob = self._read(self._file(key_id, version, ".secret"))
        fingerprint = self._version(key_id, version)["public_fingerprint"]
        if not blob.startswith(_MAGIC):
            raise InvalidKeyStoreAccess()
        nonce, sealed = blob[len(_MAGIC) : len(_MAGIC) + 12], blob[len(_MAGIC) + 12 :]
        try:
            return self._keys.aead.decrypt(nonce, sealed, _aad(key_id, version, fingerprint))
        except InvalidTag:
            raise InvalidKeyStoreAccess() from None

    def _read_public(self, key_id: str, version: int) -> bytes:
        data = self._read(self._file(key_id, version, ".public"))
        if not hmac.compare_digest(
            hashlib.sha256(data).hexdigest(), self._version(key_id, version)["public_fingerprint"]
        ):
            raise InvalidKeyStoreAccess()
        return data

    def _read(self, path: Path) -> bytes:
        try:
            _check_private(path)
            return path.read_bytes()
        except FileNotFoundError:
            raise InvalidKeyStoreAccess() from None  # the index says it exists: it was moved away

    def _file(self, key_id: str, version: int, suffix: str) -> Path:
        return self.path / "keys" / key_id / f"v{version}{suffix}"

    def _entry(self, key_id: str) -> dict[str, Any]:
        try:
            return self._index["keys"][key_id]
        except KeyError:
            raise KeyStoreNotFoundError(f"no key {key_id!r}") from None

    def _version(self, key_id: str, version: int) -> dict[str, Any]:
        try:
            return self._entry(key_id)["versions"][str(version)]
        except KeyError:
            raise KeyStoreNotFoundError(f"no version {version} of key {key_id!r}") from None

    def _save_index(self) -> None:
        mac = _index_mac(self._keys, self._header, self._index)
        _write_private(self.path / _INDEX, rfc8785.dumps({**self._header, "index": self._index, "mac": mac}))


def _passphrase(passphrase: str | bytes) -> bytes:
    data = passphrase.encode() if isinstance(passphrase, str) else bytes(passphrase)
    if not data:
        raise ValueError("passphrase must not be empty")
    return data


def _aad(key_id: str, version: int, fingerprint: str) -> bytes:
    return rfc8785.dumps(
        {"format": FORMAT, "key_id": key_id, "version": version, "public_fingerprint": fingerprint}
    )


def _index_mac(keys: _Keys, header: dict[str, Any], index: dict[str, Any]) -> str:
    return hmac.new(keys.index_mac, rfc8785.dumps({**header, "index": index}), hashlib.sha256).hexdigest()


def _log_mac(keys: _Keys, prev: str, body: dict[str, Any]) -> str:
    return hmac.new(keys.log_mac, prev.encode() + b"\n" + rfc8785.dumps(body), hashlib.sha256).hexdigest()


def _chain_head_at(lines: list[bytes], count: int) -> str:
    return json.loads(lines[count - 1])["mac"]


def _parse_index(data: bytes) -> tuple[dict[str, Any], dict[str, Any], str]:
    try:
        obj = json.loads(data)
        mac, index = obj.pop("mac"), obj.pop("index")
        if obj.get("format") != FORMAT or not isinstance(mac, str):
            raise ValueError
        return obj, index, mac
    except (ValueError, KeyError, TypeError, AttributeError):
        raise InvalidKeyStoreAccess() from None


def _check_key_id(key_id: str) -> None:
    if (
        not key_id
        or len(key_id) > 64
        or not all(c.isalnum() or c in "_.-" for c in key_id)
        or key_id[0] == "."
    ):
        raise ValueError("key_id must be 1-64 chars of [A-Za-z0-9_.-], not starting with '.'")


def _cut_torn_line(path: Path) -> None:
    """Drop a partial last line (crash mid-append): it was never pinned in the index."""
    if path.exists():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            os.truncate(path, data.rfind(b"\n") + 1)


def _shred(path: Path) -> None:
    """Overwrite with zeros, fsync, unlink (best effort: SSDs and COW filesystems may keep old blocks)."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        return
    try:
        os.write(fd, b"\x00" * os.fstat(fd).st_size)
        os.fsync(fd)
    finally:
        os.close(fd)
    path.unlink()
