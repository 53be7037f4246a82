"""Speculative decoding over the OpenAI API (ASGI, real engine): lossless per request, 400 on a bad k."""

from __future__ import annotations

import httpx
import pytest

from server.app import create_app
from tests.server.app_helpers import auth, engine, make_settings, tiny_loaded, tiny_model_dir  # noqa: F401


@pytest.fixture
async def client(engine, tiny_model_dir):  # noqa: F811
    app = create_app(make_settings(tiny_model_dir), engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c


async def test_speculative_completion_equals_the_plain_one(client):
    body = {"prompt": "a b c a b c a b c a b", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    plain = await client.post("/v1/completions", headers=auth("plain"), json=body | {"num_speculative_tokens": 0})
    spec = await client.post("/v1/completions", headers=auth("plain"), json=body | {"num_speculative_tokens": 6})
    assert plain.status_code == spec.status_code == 200, spec.text
    assert spec.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    assert spec.json()["usage"] == plain.json()["usage"]
    metrics = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in (await client.get("/metrics")).text
               .splitlines() if line.startswith("cipherlm:spec_decode")}
    assert metrics["cipherlm:spec_decode_num_drafts_total"] > 0  # the drafts were verified, not skipped
    assert 0 < metrics["cipherlm:spec_decode_num_accepted_tokens_total"] \
        <= metrics["cipherlm:spec_decode_num_draft_tokens_total"]


@pytest.mark.parametrize("value", [17, -1, "3"])
async def test_bad_num_speculative_tokens_is_400(client, value):
    r = await client.post("/v1/completions", headers=auth("plain"),
                          json={"prompt": "x", "num_speculative_tokens": value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("num_speculative_tokens")
