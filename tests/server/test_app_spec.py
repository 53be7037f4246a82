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


@pytest.mark.parametrize("field, value", [("num_speculative_tokens", 17), ("num_speculative_tokens", -1),
                                          ("num_speculative_tokens", "3"), ("use_beam_search", True),
                                          ("use_beam_search", "yes")])
async def test_bad_decoding_fields_are_400(client, field, value):
    r = await client.post("/v1/completions", headers=auth("plain"), json={"prompt": "x", field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(field)
    r = await client.post("/v1/chat/completions", headers=auth("plain"),
                          json={"messages": [{"role": "user", "content": "x"}], field: value})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(field), r.text
