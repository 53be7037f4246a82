"""``/v1/private``: the manifest and client bundle, key registration, encrypted sessions and steps.

Bodies of steps and key uploads are binary (``application/octet-stream``); everything else is JSON.
Errors use the OpenAI error shape (``server.errors``). See ``docs/protocol.md``.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import FileResponse
from pydantic import BaseModel, Field

from server.errors import NotFoundError
from server.keys import KeyRecord
from server.private.service import PrivateService
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


Private = Annotated[PrivateService, Depends(get_private)]
TenantDep = Annotated[Tenant, Depends(get_tenant)]


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


@router.post("/keys/{key_id}", status_code=201,
             openapi_extra={"requestBody": {"content": {OCTET: {"schema": {"type": "string", "format": "binary"}}}}})
async def register_key(key_id: Annotated[str, Field(pattern=KEY_ID_PATTERN)], request: Request,
                       tenant: TenantDep, svc: Private) -> dict:
    """Upload public evaluation keys (never a secret key: such uploads are refused and audited)."""
    body = await request.body()
    rec = await svc.register_key(tenant.id, key_id, body, actor=tenant.id, request_id=_request_id(request))
    return _key_json(rec)


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
    key_id: str = Field(pattern=KEY_ID_PATTERN)
    plan_hash: str = Field(min_length=64, max_length=64, pattern=r"^[0-9a-f]{64}$")


@router.post("/sessions", status_code=201)
async def open_session(body: OpenSession, request: Request, tenant: TenantDep, svc: Private) -> dict:
    """Open a session on an ACTIVE key for this server's plan."""
    s = await svc.open_session(tenant.id, body.key_id, body.plan_hash, actor=tenant.id,
                               request_id=_request_id(request))
    return {"session_id": s.id, "key_id": s.key_id, "key_version": s.key_version,
            "key_fingerprint": s.fingerprint, "layers": list(svc.layers), "ttl_s": svc.cfg.session_ttl_s,
            "max_tokens": svc.cfg.max_session_tokens, "max_step_tokens": svc.cfg.max_step_tokens}


@router.post("/sessions/{session_id}/steps", response_class=Response,
             openapi_extra={"requestBody": {"content": {OCTET: {"schema": {"type": "string", "format": "binary"}}}}},
             responses={200: {"content": {OCTET: {}}, "description": "result envelope"}})
async def step(session_id: str, request: Request, tenant: TenantDep, svc: Private) -> Response:
    """One encrypted layer over one or more positions (binary envelope in, binary envelope out)."""
    out = await svc.step(tenant.id, session_id, await request.body(), request_id=_request_id(request))
    return Response(out, media_type=OCTET)


@router.delete("/sessions/{session_id}", status_code=204, response_class=Response)
async def close_session(session_id: str, request: Request, tenant: TenantDep, svc: Private) -> Response:
    """Close a session and free its encrypted KV cache."""
    await svc.close_session(tenant.id, session_id, actor=tenant.id, request_id=_request_id(request))
    return Response(status_code=204)
