"""The server hands the engine's fair scheduler one share key per tenant (its prefix-cache salt).

If the router stopped passing the salt, every request would land in one share and the fair policy would
silently stop telling tenants apart; this pins the wiring through the real app and engine.
"""

from __future__ import annotations

import httpx

from server.app import create_app
from server.tenants import derive_cache_salt
from tests.server.app_helpers import auth, engine, make_settings, tiny_loaded, tiny_model_dir  # noqa: F401


async def test_each_tenant_is_its_own_fair_share(engine, tiny_model_dir):  # noqa: F811
    scheduler = engine.engine.scheduler
    seen: list = []
    add = scheduler.add

    def observing_add(seq):
        seen.append(seq.request.tenant)
        add(seq)

    scheduler.add = observing_add
    app = create_app(make_settings(tiny_model_dir), engine)
    body = {"prompt": "hello there", "max_tokens": 2}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        for name in ("plain", "plain2", "plain"):
            assert (await c.post("/v1/completions", json=body, headers=auth(name))).status_code == 200
    secret = b"test-secret"
    assert seen == [derive_cache_salt(secret, "plain"), derive_cache_salt(secret, "plain2"),
                    derive_cache_salt(secret, "plain")]
    assert seen[0] != seen[1] and None not in seen
