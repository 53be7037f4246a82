"""``/v1/private``: the manifest and client bundle, key registration, encrypted sessions and steps.

Bodies of steps and key uploads are binary (``application/octet-stream``); everything else is JSON.
Errors use the OpenAI error shape (``server.errors``). See ``docs/protocol.md``.

Every check a request can fail from its headers runs before a byte of its body is read::

    auth (401) → encrypted-mode tenant (403) → draining: no new keys or sessions (503)
      → session exists and is the tenant's (404/410) → declared Content-Length vs this endpoint's cap (413)
      → requests/min + concurrency of the tenant (429) → body streamed up to the cap (413 past it) → work

The caps are per endpoint (``max_step_bytes`` for steps, ``max_key_bytes`` for key uploads, the server's
``max_request_bytes`` for JSON), enforced while streaming, so a body without a Content-Length cannot
grow past them either (``server.app.body_limit`` applies the same caps in the middleware).
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import FileResponse
from pydantic import BaseModel, Field

from server.errors import NotFoundError, PermissionDeniedError, RequestTooLargeError
from server.keys import KeyRecord, KeyTooLargeError
from server.private.service import PrivateService, StepTimes
from server.routers.deps import admit_request, admit_step, ensure_admitting
from server.settings import PrivacyMode
from server.tenants import Tenant, get_tenant

router = APIRouter(prefix="/v1/private", tags=["private"])
OCTET = "application/octet-stream"
KEY_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


def get_private(request: Request) -> PrivateService:
    """FastAPI dependency: the app's private service (404 when encrypted sessions are disabled)."""
    svc = getattr(request.app.state, "private", None)
    if svc is None:
        raise NotFoundError("encrypted sessions are not enabled on this server", code="private_disabled")
    return svc


def require_encrypted_tenant(tenant: Annotated[Tenant, Depends(get_tenant)]) -> Tenant:
    """FastAPI dependency: the tenant, if its privacy mode uses encrypted sessions (else 403)."""
    if tenant.privacy_mode is PrivacyMode.PLAINTEXT:
        raise PermissionDeniedError(f"tenant {tenant.id!r} is in plaintext mode: the /v1/private endpoints are "
                                    "for encrypted-mode tenants; use /v1/completions", code="privacy_mode_plaintext")
    return tenant


Private = Annotated[PrivateService, Depends(get_private)]
TenantDep = Annotated[Tenant, Depends(require_encrypted_tenant)]
_NEW_WORK = [Depends(ensure_admitting)]  # draining: no new keys or sessions; open sessions may finish


def check_declared_size(request: Request, cap: int, code: str) -> None:
    """413 when the declared Content-Length exceeds ``cap`` (checked before any byte is read)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > cap):
        raise RequestTooLargeError(f"request body over {cap} bytes", code=code)


async def read_capped(request: Request, cap: int, code: str, digest: Any = None) -> bytes:
    """The request body, streamed and refused with 413 the moment it passes ``cap`` bytes (so a body with
    no or a false Content-Length is never held past the cap). The chunks are joined once at the end: one copy
    of a multi-MB step body, not a growing buffer's copies and then a second one into ``bytes``. ``digest``: a
    ``hashlib`` object fed each chunk as it arrives (while the client still sends the rest, and from the cache)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise RequestTooLargeError(f"request body over {cap} bytes", code=code)
        chunks.append(chunk)
        if digest is not None:
            digest.update(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _request_id(request: Request) -> str | None:
    return request.headers.get("x-request-id")


def _key_json(rec: KeyRecord) -> dict:
    return {"key_id": rec.key_id, "version": rec.version, "fingerprint": rec.fingerprint,
            "state": rec.state.value, "created_at": rec.created_at, "expires_at": rec.expires_at}


@router.get("/manifest")
async def manifest(request: Request, tenant: TenantDep, svc: Private) -> dict:
    """Model id, plan hash, CKKS parameters, which layers run where, the bundle's hash and size."""
    return request.app.state.private_manifest


@router.get("/bundle", response_class=FileResponse,
            responses={200: {"content": {OCTET: {}}, "description": "the client bundle (safetensors)"}})
async def bundle(request: Request, tenant: TenantDep, svc: Private) -> FileResponse:
    """The client bundle; its SHA-256 is in the manifest and in ``X-Cipherlm-Bundle-SHA256``."""
    man = request.app.state.private_manifest
    return FileResponse(request.app.state.private_bundle_path, media_type=OCTET,
                        headers={"X-Cipherlm-Bundle-SHA256": man["bundle"]["sha256"]})


@router.post("/keys/{key_id}", status_code=201, dependencies=_NEW_WORK,
             openapi_extra={"requestBody": {"content": {OCTET: {"schema": {"type": "string", "format": "binary"}}}}})
async def register_key(key_id: Annotated[str, Field(pattern=KEY_ID_PATTERN)], request: Request,
                       tenant: TenantDep, svc: Private) -> dict:
    """Upload public evaluation keys (never a secret key: such uploads are refused and audited)."""
    check_declared_size(request, svc.cfg.max_key_bytes, "key_too_large")
    limiter = admit_request(request, tenant)
    try:
        with _audit_oversize(request, tenant, key_id, svc):
            body = await read_capped(request, svc.cfg.max_key_bytes, "key_too_large")
        rec = await svc.register_key(tenant.id, key_id, body, actor=tenant.id, request_id=_request_id(request))
    finally:
        limiter.release()
    return _key_json(rec)


@contextlib.contextmanager
def _audit_oversize(request: Request, tenant: Tenant, key_id: str, svc: PrivateService):
    """A key upload cut with 413 while its body streams in is audited like any refused upload (size: the
    cap it passed). One whose declared size is over the cap never gets here: the app's middleware refuses
    it before authentication, when no tenant is known (an unauthenticated 413 is not a key event)."""
    try:
        yield
    except RequestTooLargeError:
        size = svc.cfg.max_key_bytes + 1
        svc.registry.audit_refused_upload(tenant.id, KeyTooLargeError(f"{size} bytes"), size, actor=tenant.id,
                                          key_id=key_id, request_id=_request_id(request))
        raise


@router.get("/keys")
async def list_keys(tenant: TenantDep, svc: Private) -> dict:
    """The tenant's registered key versions and their states."""
    return {"object": "list", "data": [_key_json(r) for r in svc.list_keys(tenant.id)]}


class RevokeRequest(BaseModel):
    version: int | None = Field(None, ge=1, description="None: the primary version")
    compromised: bool = False


@router.post("/keys/{key_id}/revoke")
async def revoke_key(key_id: Annotated[str, Field(pattern=KEY_ID_PATTERN)], body: RevokeRequest,
                     request: Request, tenant: TenantDep, svc: Private) -> dict:
    """Revoke a key version now: its sessions close and in-flight steps are refused."""
    rec = svc.revoke_key(tenant.id, key_id, body.version, actor=tenant.id, compromised=body.compromised,
                         request_id=_request_id(request))
    return _key_json(rec)


class OpenSession(BaseModel):
    #: the attention key set (the manifest's ``ckks``); None where no server layer needs one (an offload plan
    #: of linear steps only: manifest ``offload.attention_key`` false)
    key_id: str | None = Field(None, pattern=KEY_ID_PATTERN)
    plan_hash: str = Field(min_length=64, max_length=64, pattern=r"^[0-9a-f]{64}$")
    #: an offload plan's MLP key set (registered like any key, made for the manifest's offload.mlp.ckks)
    mlp_key_id: str | None = Field(None, pattern=KEY_ID_PATTERN)


@router.post("/sessions", status_code=201, dependencies=_NEW_WORK)
async def open_session(body: OpenSession, request: Request, tenant: TenantDep, svc: Private) -> dict:
    """Open a session on an ACTIVE key for this server's plan (may start a worker: seconds)."""
    limiter = admit_request(request, tenant)
    try:
        s = await svc.open_session(tenant.id, body.key_id, body.plan_hash, actor=tenant.id,
                                   request_id=_request_id(request), mlp_key_id=body.mlp_key_id)
    finally:
        limiter.release()
    return {"session_id": s.id, "key_id": s.key_id, "key_version": s.key_version,
            "key_fingerprint": s.fingerprint, "mlp_key_id": s.mlp_key_id, "mlp_key_fingerprint": s.mlp_fingerprint,
            "layers": list(svc.layers), "ttl_s": svc.cfg.session_ttl_s,
            "max_tokens": svc.cfg.max_session_tokens, "max_step_tokens": svc.cfg.max_step_tokens}


@router.post("/sessions/{session_id}/steps", response_class=Response,
             openapi_extra={"requestBody": {"content": {OCTET: {"schema": {"type": "string", "format": "binary"}}}}},
             responses={200: {"content": {OCTET: {}}, "description": "result envelope"}})
async def step(session_id: str, request: Request, tenant: TenantDep, svc: Private) -> Response:
    """One encrypted layer over one or more positions (binary envelope in, binary envelope out)."""
    svc.session_for(tenant.id, session_id)  # 404/410 before a byte of the body is read
    check_declared_size(request, svc.cfg.max_step_bytes, "step_too_large")
    limiter = admit_step(request, tenant)   # steps/min, not requests/min: a generation is thousands of steps
    times = StepTimes()
    try:
        sha = hashlib.sha256()   # the step's digest (retry semantics), of exactly the bytes handed on
        body = await read_capped(request, svc.cfg.max_step_bytes, "step_too_large", sha)
        times.since("body_read", times.started)
        out = await svc.step(tenant.id, session_id, body, request_id=_request_id(request), times=times,
                             digest=sha.hexdigest())
    finally:
        limiter.release()
    svc.record_times(times)
    return Response(out, media_type=OCTET)


@router.delete("/sessions/{session_id}", status_code=204, response_class=Response)
async def close_session(session_id: str, request: Request, tenant: TenantDep, svc: Private) -> Response:
    """Close a session and free its encrypted KV cache."""
    await svc.close_session(tenant.id, session_id, actor=tenant.id, request_id=_request_id(request))
    return Response(status_code=204)
