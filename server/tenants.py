"""Tenants: API-key authentication, privacy-mode enforcement, per-tenant prefix-cache salts.

* API keys are random 256-bit tokens (``clm-…``) shown once; the settings keep only ``sha256:<hex>``.
  A plain SHA-256 suffices because the keys are high-entropy (no dictionary to try); the lookup
  compares against every stored hash with :func:`hmac.compare_digest` and never stops early, so the
  time taken does not reveal which tenant (or which prefix) matched.
* The prefix-cache salt is HMAC-SHA256(server secret, tenant id): derived on the server, never sent by
  the client, so two tenants can never hit each other's cached blocks.
* An encrypted-mode tenant's plaintext request is refused (403) unless its policy is
  ``non_sensitive`` and the request carries ``X-Cipherlm-Sensitivity: non-sensitive``; each fallback is
  handed to every registered :class:`FallbackRecorder` (the audit log plugs in here) and counted.

The FastAPI dependencies :func:`get_tenant` and :func:`require_plaintext_access` are reusable by other
routers (the encrypted-session and key routers use ``get_tenant``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import secrets
from typing import Annotated, Protocol

from fastapi import Depends, Request

from server.errors import AuthenticationError, PermissionDeniedError
from server.settings import (
    FallbackPolicy,
    LimitSettings,
    PrivacyMode,
    Settings,
    SettingsDep,
    TenantSettings,
)

SENSITIVITY_HEADER = "X-Cipherlm-Sensitivity"
NON_SENSITIVE = "non-sensitive"
API_KEY_PREFIX = "clm-"
_SALT_CONTEXT = b"cipherlm/prefix-cache-salt/v1:"

log = logging.getLogger("cipherlm.server")


def generate_api_key() -> str:
    """A fresh API key (256 random bits, URL-safe). Show it once, store only :func:`hash_api_key`."""
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(key: str) -> str:
    """The form stored in settings: ``sha256:<64 hex>``."""
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


def derive_cache_salt(server_secret: bytes, tenant_id: str) -> str:
    """Prefix-cache salt of a tenant: hex HMAC-SHA256(server secret, context || tenant id)."""
    return hmac.new(server_secret, _SALT_CONTEXT + tenant_id.encode("utf-8"), hashlib.sha256).hexdigest()


@dataclasses.dataclass(frozen=True)
class Tenant:
    """A tenant as the request path sees it (no key material besides hashes)."""

    id: str
    privacy_mode: PrivacyMode
    fallback: FallbackPolicy
    limits: LimitSettings
    priority: int
    cache_salt: str


@dataclasses.dataclass(frozen=True)
class FallbackEvent:
    """One encrypted-mode tenant's request served on the plaintext path (no prompt content)."""

    tenant_id: str
    request_id: str
    endpoint: str
    reason: str


class FallbackRecorder(Protocol):
    """Something that records plaintext fallbacks (the audit log implements this).

    ``record_fallback`` runs before the request is served; if it raises, the request is refused
    with a 503 — a fallback that cannot be recorded does not happen.
    """

    def record_fallback(self, event: FallbackEvent) -> None: ...


class TenantRegistry:
    """Tenants of one settings object, looked up by API key."""

    def __init__(self, settings: Settings, server_secret: bytes) -> None:
        self.settings = settings
        self._tenants: dict[str, Tenant] = {}
        self._hashes: list[tuple[bytes, str]] = []  # (sha256 digest, tenant id)
        for t in settings.tenants:
            self._tenants[t.id] = self._build(t, settings, server_secret)
            self._hashes += [(bytes.fromhex(h.split(":", 1)[1]), t.id) for h in t.api_key_hashes]

    @staticmethod
    def _build(t: TenantSettings, settings: Settings, secret: bytes) -> Tenant:
        return Tenant(id=t.id, privacy_mode=t.privacy_mode, fallback=t.fallback,
                      limits=settings.limits_for(t), priority=t.priority,
                      cache_salt=derive_cache_salt(secret, t.id))

    def __len__(self) -> int:
        return len(self._tenants)

    def get(self, tenant_id: str) -> Tenant | None:
        """The tenant with this id, or None."""
        return self._tenants.get(tenant_id)

    def authenticate(self, api_key: str) -> Tenant | None:
        """The tenant owning ``api_key``, or None. Compares against every hash (constant work)."""
        digest = hashlib.sha256(api_key.encode("utf-8")).digest()
        found: str | None = None
        for stored, tenant_id in self._hashes:
            if hmac.compare_digest(digest, stored):
                found = tenant_id
        return self._tenants[found] if found is not None else None


def server_secret_bytes(settings: Settings) -> bytes:
    """The configured server secret, or a random one for this process (salts then change on restart)."""
    if settings.server_secret is not None:
        return settings.server_secret.get_secret_value().encode("utf-8")
    log.warning("no server_secret configured: using a random one (prefix-cache salts change on restart)")
    return secrets.token_bytes(32)


async def get_registry(request: Request, settings: SettingsDep) -> TenantRegistry:
    """FastAPI dependency: the registry of the current settings (rebuilt if the settings are swapped)."""
    registry: TenantRegistry | None = getattr(request.app.state, "tenant_registry", None)
    if registry is None or registry.settings is not settings:
        registry = TenantRegistry(settings, request.app.state.server_secret)
        request.app.state.tenant_registry = registry
    return registry


MAX_CREDENTIAL_CHARS = 1024  # API keys are ~50 characters; anything far longer is refused unparsed


def _bearer_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    api_key = request.headers.get("x-api-key", "")
    if len(auth) > MAX_CREDENTIAL_CHARS or len(api_key) > MAX_CREDENTIAL_CHARS:
        raise AuthenticationError(f"credentials over {MAX_CREDENTIAL_CHARS} characters", code="invalid_api_key")
    scheme, _, key = auth.partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return key.strip()
    return api_key or None


async def get_tenant(request: Request, registry: Annotated[TenantRegistry, Depends(get_registry)]) -> Tenant:
    """FastAPI dependency: the authenticated tenant (``Authorization: Bearer <key>``), else 401."""
    key = _bearer_key(request)
    if key is None:
        raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'",
                                  code="missing_api_key")
    tenant = registry.authenticate(key)
    if tenant is None:
        raise AuthenticationError("invalid API key", code="invalid_api_key")
    request.state.tenant = tenant
    return tenant


def is_marked_non_sensitive(request: Request) -> bool:
    """True when the request marks itself non-sensitive (the header, case-insensitive value)."""
    return request.headers.get(SENSITIVITY_HEADER, "").strip().lower() == NON_SENSITIVE


def check_plaintext_access(tenant: Tenant, request: Request) -> bool:
    """Decide whether ``tenant`` may use the plaintext path for ``request``.

    Returns:
        True when this is a fallback (an encrypted tenant's non-sensitive request), False when the
        tenant is a plaintext tenant.

    Raises:
        PermissionDeniedError: an encrypted tenant's request that may not fall back.
    """
    if tenant.privacy_mode is PrivacyMode.PLAINTEXT:
        return False
    if tenant.fallback is FallbackPolicy.NON_SENSITIVE and is_marked_non_sensitive(request):
        return True
    why = (f"tenant {tenant.id!r} is in {tenant.privacy_mode.value!r} privacy mode, so the server refuses "
           "plaintext prompts. Use the cipherlm SDK in encrypted mode (client_sdk.Client(privacy='encrypted')), "
           "which encrypts on your machine and calls the /v1/private endpoints.")
    if tenant.fallback is FallbackPolicy.NON_SENSITIVE:
        why += (f" This tenant's policy allows a plaintext fallback only for requests marked "
                f"'{SENSITIVITY_HEADER}: {NON_SENSITIVE}'.")
    raise PermissionDeniedError(why, code="privacy_mode_encrypted")


TenantDep = Annotated[Tenant, Depends(get_tenant)]


async def require_plaintext_access(request: Request, tenant: TenantDep) -> Tenant:
    """FastAPI dependency for plaintext endpoints: the tenant, after the privacy-mode check.

    A fallback is recorded later by the router (it needs the request id): see ``request.state.fallback``.
    """
    request.state.fallback = check_plaintext_access(tenant, request)
    return tenant


PlaintextTenantDep = Annotated[Tenant, Depends(require_plaintext_access)]
