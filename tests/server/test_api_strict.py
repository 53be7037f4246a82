"""Bad input at the OpenAI endpoints is a 400 in OpenAI's shape (issue 12, items 5 and 11).

Before: a lone surrogate in chat content was a 500 leaking the tokenizer library's message;
``stream: "yes"``, ``max_tokens: true`` and ``n: "2"`` were coerced; a 1 MB Authorization header was
parsed as a key.
"""

from __future__ import annotations

import json

import httpx
import pytest

from server.app import create_app
from tests.server.app_helpers import auth, engine, make_settings, tiny_loaded, tiny_model_dir  # noqa: F401


@pytest.fixture
async def client(engine, tiny_model_dir):  # noqa: F811
    app = create_app(make_settings(tiny_model_dir), engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c


def _post(client, path: str, body: dict, headers: dict | None = None):
    # json.dumps with ensure_ascii keeps "\ud800" as the escape JSON allows (a lone surrogate)
    return client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json",
                                                                 **(headers or auth("plain"))})


def _assert_400(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert "TextEncodeInput" not in err["message"] and "Union" not in err["message"]
    return err


CHATS = {
    "user": [{"role": "user", "content": "hi \ud800"}],
    "system": [{"role": "system", "content": "\udc00"}, {"role": "user", "content": "hi"}],
    "text part": [{"role": "user", "content": [{"type": "text", "text": "a\ud800b"}]}],
}


@pytest.mark.parametrize("case", list(CHATS))
async def test_lone_surrogate_in_chat_is_400(client, case):
    err = _assert_400(await _post(client, "/v1/chat/completions", {"messages": CHATS[case], "max_tokens": 1}))
    assert "surrogate" in err["message"]


async def test_lone_surrogate_on_the_fallback_path_is_400(client):
    headers = {**auth("enc-fallback"), "X-Cipherlm-Sensitivity": "non-sensitive"}
    _assert_400(await _post(client, "/v1/chat/completions", {"messages": CHATS["user"], "max_tokens": 1}, headers))
    _assert_400(await _post(client, "/v1/completions", {"prompt": "\ud800", "max_tokens": 1}, headers))


@pytest.mark.parametrize(("field", "value"), [
    ("stream", "yes"), ("stream", 1), ("max_tokens", True), ("max_tokens", "4"), ("n", "2"), ("n", 2.0),
    ("temperature", "0"), ("seed", True), ("logprobs", 1), ("stream_options", {"include_usage": "yes"}),
])
async def test_lax_types_are_400(client, field, value):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, field: value}
    err = _assert_400(await _post(client, "/v1/chat/completions", body))
    assert err["param"].startswith(field)


async def test_numbers_still_accept_integers(client):
    body = {"prompt": "hi", "max_tokens": 1, "temperature": 0, "top_p": 1}
    assert (await _post(client, "/v1/completions", body)).status_code == 200


async def test_huge_authorization_header_is_refused(client):
    for headers in ({"Authorization": "Bearer " + "k" * (1 << 20)}, {"X-Api-Key": "k" * 5000}):
        r = await _post(client, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, headers)
        err = r.json()["error"]
        assert r.status_code == 401 and err["code"] == "invalid_api_key"
        assert "over 1024 characters" in err["message"]  # refused for its size, before any key lookup
        assert len(r.text) < 1000  # the header is not echoed


async def test_typed_control_tokens_are_plain_text_in_chat(client):
    """'<|im_start|>' typed by a user is billed and run as its characters, not as one control token."""
    base = {"max_tokens": 1, "temperature": 0}
    plain = await _post(client, "/v1/chat/completions",
                        {**base, "messages": [{"role": "user", "content": "x"}]})
    forged = await _post(client, "/v1/chat/completions",
                         {**base, "messages": [{"role": "user", "content": "x<|im_start|>"}]})
    assert plain.status_code == forged.status_code == 200
    extra = forged.json()["usage"]["prompt_tokens"] - plain.json()["usage"]["prompt_tokens"]
    assert extra > 1  # '<', '|', 'im', '_', 'start', ... — not the single special token


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_body_that_is_not_json_is_400_saying_so_without_a_param(client, path):
    """A truncated body: OpenAI's shape, a message that says the JSON is broken and where, and no ``param``
    (FastAPI's location for it is a character offset, not a field)."""
    r = await client.post(path, content=b'{"prompt": "hi",', headers={"Content-Type": "application/json",
                                                                      **auth("plain")})
    err = _assert_400(r)
    assert err["message"].startswith("the request body is not valid JSON") and "at character 16" in err["message"]
    assert err["param"] is None
