"""``GET /v1/tenant``: who am I? The calling tenant's privacy mode, fallback policy and limits.

The client SDK reads this to pick its transport (plaintext endpoints or the encrypted ones), so one
``Client`` object can serve both kinds of tenants.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from server.tenants import SENSITIVITY_HEADER, TenantDep

router = APIRouter(tags=["tenant"])


@router.get("/v1/tenant")
async def whoami(tenant: TenantDep) -> dict[str, Any]:
    """The authenticated tenant's public settings (never key hashes or salts)."""
    return {"object": "tenant", "id": tenant.id, "privacy_mode": tenant.privacy_mode.value,
            "fallback": tenant.fallback.value, "sensitivity_header": SENSITIVITY_HEADER,
            "limits": tenant.limits.model_dump()}
