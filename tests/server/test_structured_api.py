"""Structured output at the OpenAI endpoints: ``response_format`` and vLLM's ``guided_*`` extras.

Through the ASGI app (the real AsyncLLM on a random 2-layer model with SmolLM2's tokenizer) and through
the official ``openai`` client against a live ``cipherlm serve``. The schemas have finite languages, so
the random model must finish them (``finish_reason == "stop"``) inside max_tokens.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema_rs
import openai
import pydantic
import pytest

from server.app import create_app
from tests.server.app_helpers import (  # noqa: F401 (fixtures)
    KEYS,
    auth,
    engine,
    live_server,
    make_settings,
    tiny_loaded,
    tiny_model_dir,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "sunny": {"type": "boolean"},
        "days": {"type": "array", "items": {"enum": ["mon", "tue"]}, "maxItems": 2},
        "temp": {"type": "object", "properties": {"c": {"type": "integer", "minimum": -9, "maximum": 9}},
                 "required": ["c"]},
    },
    "required": ["city", "sunny", "days", "temp"],
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
CHAT = [{"role": "user", "content": "The weather as JSON"}]


@pytest.fixture
async def client(engine, tiny_model_dir):  # noqa: F811
    app = create_app(make_settings(tiny_model_dir), engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                 timeout=120) as c:
        yield c


def _valid(text: str) -> None:
    jsonschema_rs.validator_for(SCHEMA).validate(json.loads(text))


async def test_chat_json_schema_validates(client):
    body = {"messages": CHAT, "response_format": FORMAT, "max_tokens": 80, "temperature": 1.0, "seed": 1, "n": 3}
    r = await client.post("/v1/chat/completions", json=body, headers=auth("plain"))
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        _valid(choice["message"]["content"])


async def test_streamed_chat_json_schema_validates(client):
    body = {"messages": CHAT, "response_format": FORMAT, "max_tokens": 80, "temperature": 0, "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=auth("plain")) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) async for line in r.aiter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    _valid(text)


@pytest.mark.parametrize(("extra", "check"), [
    ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
    ({"guided_regex": "[A-Z][a-z]{2}"}, lambda t: len(t) == 3 and t[0].isupper() and t[1:].islower()),
    ({"guided_json": SCHEMA}, lambda t: _valid(t) is None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}},
     lambda t: _valid(t) is None),
])
async def test_completions_take_the_extras(client, extra, check):
    body = {"prompt": "Answer:", "max_tokens": 80, "temperature": 1.0, "seed": 2, **extra}
    r = await client.post("/v1/completions", json=body, headers=auth("plain"))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and check(choice["text"]), choice["text"]


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "nope"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {
        "type": "object", "required": "city"}}}}, "response_format.json_schema.schema", "required"),
    ({"guided_regex": "([a-z]"}, "guided_regex", "regex"),
    ({"guided_grammar": "root ::= "}, "guided_grammar", "EBNF"),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "at most one"),
    ({"guided_choice": "a"}, "guided_choice", ""),       # pydantic: not a list
]


@pytest.mark.parametrize(("extra", "param", "words"), BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
async def test_bad_structured_input_is_400_before_any_work(client, engine, extra, param, words):  # noqa: F811
    before = engine.stats()     # the public stats: also what the engine-core process mode reports
    r = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 8, **extra},
                          headers=auth("plain"))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and param in (err["param"] or "") and words in err["message"]
    assert "/project/" not in err["message"]
    after = engine.stats()      # nothing reached the engine
    assert after.prompt_tokens_total == before.prompt_tokens_total and after.num_running == after.num_waiting == 0


# --- the official openai client against a live server ------------------------------------------------


class Temp(pydantic.BaseModel):
    c: Literal[-1, 0, 1]


class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    sunny: bool
    temp: Temp


@pytest.fixture
def oai(live_server):  # noqa: F811
    client = openai.OpenAI(api_key=KEYS["plain"], base_url=live_server.url + "/v1", max_retries=0, timeout=120)
    yield client
    client.close()


def test_openai_client_response_format_json_schema(oai):
    resp = oai.chat.completions.create(model="tiny", messages=CHAT, response_format=FORMAT, max_tokens=80,
                                       temperature=0.7, seed=4)
    assert resp.choices[0].finish_reason == "stop"
    _valid(resp.choices[0].message.content)


def test_openai_client_parse_with_a_pydantic_model(oai):
    """``chat.completions.parse`` sends the model's strict schema ($defs + $ref) and parses the answer."""
    resp = oai.chat.completions.parse(model="tiny", messages=CHAT, response_format=Weather, max_tokens=80,
                                      temperature=1.0, seed=5)
    parsed = resp.choices[0].message.parsed
    assert isinstance(parsed, Weather) and isinstance(parsed.temp, Temp)


def test_openai_client_json_object_streamed(oai):
    stream = oai.chat.completions.create(model="tiny", messages=CHAT, response_format={"type": "json_object"},
                                         max_tokens=40, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.startswith("{")   # open-ended: the random model may not close it within 40 tokens


def test_openai_client_bad_schema_is_a_bad_request(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object", "properties": 3}}})
    assert info.value.param == "response_format.json_schema.schema"
    assert "properties must be an object" in info.value.message
