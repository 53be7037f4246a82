"""One request spec, two tenants: a plaintext tenant (the server's engine) and an encrypted tenant (the
SDK's private runtime, real CKKS ciphertexts) answer it the same way — stop-string hold-back, sampling
options, chat defaults, limits and validation errors.

Both tenants live in one in-process app (the real ``create_app`` with the engine on SmolLM2 and the
encrypted-session service with a worker process), reached through Starlette's ``TestClient`` — an
``httpx.Client`` over the ASGI app — for the blocking ``Client``, and through ``httpx.ASGITransport`` on
the app's own event loop for ``AsyncClient``. The encrypted tenant runs the smallest real configuration
the e2e test uses: N = 16384, one encrypted layer (layer 0 of the shipped plan).

Run it under ``flock /tmp/cipherlm-heavy.lock`` (several minutes of CKKS on 2 cores).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx
import pytest

from client_sdk import AsyncClient, BadRequestError, Client, PrivateModeError

pytestmark = [pytest.mark.slow, pytest.mark.model]

KEYS = {"plain": "clm-parity-plain-000000000000", "enc": "clm-parity-enc-1111111111111"}
TENANT_MAX_TOKENS = 6        # sets the chat default (min(room, cap, 1024)) to 6 for both tenants
# Three tokens: every prompt token is an encrypted layer step of seconds (five requests here, one replayed),
# and what is checked (the same answer, hold-back, replay) does not depend on the prompt's length. Its greedy
# answer " time, the city of ..." puts a two-token stop string ("the city") in the first four tokens, with a
# logit gap >= 0.33 for each of them in the plan's simulator (CKKS noise does not flip them). Until session
# 22 this was "The capital of France is" (five tokens; its stop string was tokens five and six).
PROMPT = "Once upon a"


@pytest.fixture(scope="module")
def one_layer_plan(tmp_path_factory):
    from fhe.params import CKKSParams
    from fhe.plan import Plan
    from server.private.feature import default_plan_path

    full = Plan.load(default_plan_path())
    ckks = CKKSParams(16384, (48,) + (30,) * 11 + (60,), 30).to_dict()  # as tests/e2e/test_private_e2e.py
    plan = Plan(full.model_id, full.weights_sha256, (full.layers[0],), ckks, "cipherlm parity test",
                full.calibration)
    return plan.save(tmp_path_factory.mktemp("plan") / "one-layer.plan.json")


@pytest.fixture(scope="module")
def app_client(tmp_path_factory, one_layer_plan, default_model_dir):
    """(TestClient, app) with both tenants; lifespan (engine, workers) runs for the module."""
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.private.config import PrivateSettings
    from server.settings import LimitSettings, Settings, TenantSettings
    from server.tenants import hash_api_key

    limits = LimitSettings(max_tokens=TENANT_MAX_TOKENS)
    tenants = [TenantSettings(id="plain", api_key_hashes=[hash_api_key(KEYS["plain"])], limits=limits),
               TenantSettings(id="enc", api_key_hashes=[hash_api_key(KEYS["enc"])], privacy_mode="encrypted",
                              limits=limits)]
    private = PrivateSettings(enabled=True, workers=1, plan=str(one_layer_plan), max_session_tokens=96,
                              max_step_tokens=16, max_keys_per_worker=1,
                              state_dir=str(tmp_path_factory.mktemp("state")))
    settings = Settings(model=str(default_model_dir), server_secret="parity-secret", tenants=tenants,
                        private=private, engine={"device": "cpu", "num_kv_blocks": 64},
                        engine_process=False)   # the engine in a thread (no core process to start): the
    # plaintext tenant's answers are the engine's either way (the core process: tests/engine/test_core_client.py)
    app = create_app(settings)
    with TestClient(app, base_url="http://testserver") as http:
        yield http, app


@pytest.fixture(scope="module")
def key_store(smollm2_key_store):
    """One key store for the sync and async clients: the same key, uploaded once (the run's SmolLM2 key
    store, tests/conftest.py: made by whichever module needs it first)."""
    return smollm2_key_store


@pytest.fixture(scope="module")
def tenants(app_client, key_store, tmp_path_factory):
    from client_sdk._private import runtime_of

    http, _ = app_client
    plain = Client(api_key=KEYS["plain"], base_url="http://testserver", http_client=http, max_retries=0)
    enc = Client(api_key=KEYS["enc"], base_url="http://testserver", http_client=http, privacy="encrypted",
                 max_retries=0, key_store=key_store)
    runtime_of(enc).cache_dir = tmp_path_factory.mktemp("client-cache")
    yield {"plain": plain, "enc": enc}
    enc._private.close_session()


@dataclasses.dataclass(frozen=True)
class Spec:
    """One request both tenants answer."""

    name: str
    chat: bool
    body: dict[str, Any]
    stream: bool = True
    error_param: str | None = None   # both must refuse it, naming this field


def _stops(name: str, greedy_text: str) -> dict[str, Any]:
    """A stop string of several tokens, or the id of the third token, inside the greedy answer."""
    if name == "stop_token_ids":
        from engine.default_model import default_model_dir
        from engine.tokenizer import Tokenizer

        return {"stop_token_ids": [Tokenizer.from_folder(default_model_dir()).encode(greedy_text)[2]]}
    words = greedy_text.split()
    return {"stop": [" ".join(words[1:3])]} if len(words) >= 3 else {"stop": [greedy_text[2:9]]}


# Both modes handle options with the engine's own pieces (Sampler, OutputProcessor; client_sdk/_runtime.py
# drives them for the encrypted tenant). The default run checks what the encrypted path itself decides
# (greedy tokens, streamed hold-back, validation errors); the other option cases add only encrypted
# positions (seconds each here) and run with ``pytest -m heavy``.
HEAVY = pytest.mark.heavy
SPECS = [
    Spec("greedy", False, {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}),
    Spec("stop-string hold-back", False, {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stop": "@@"}),
    pytest.param(Spec("sampling options", False, {"prompt": PROMPT, "max_tokens": 4, "temperature": 0.7, "seed": 11,
                                                  "top_k": 20, "top_p": 0.9, "min_p": 0.05,
                                                  "repetition_penalty": 1.3, "presence_penalty": 0.5,
                                                  "frequency_penalty": 0.2}), marks=HEAVY),
    pytest.param(Spec("stop_token_ids", False, {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}), marks=HEAVY),
    pytest.param(Spec("ignore_eos, logprobs", False, {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                                      "ignore_eos": True, "logprobs": 2}, stream=False), marks=HEAVY),
    pytest.param(Spec("chat default max_tokens = tenant cap", True,
                      {"messages": [{"role": "system", "content": "Be brief."},   # not the template's long
                                    {"role": "user", "content": "Count to ten."}],  # default: each prompt
                       "temperature": 0, "ignore_eos": True}), marks=HEAVY),      # token is a CKKS step
    Spec("max_tokens over the tenant cap", True,
         {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": TENANT_MAX_TOKENS + 1},
         error_param="max_tokens"),
    Spec("bad min_p", False, {"prompt": PROMPT, "min_p": 2}, error_param="min_p"),
    Spec("bad temperature type", False, {"prompt": PROMPT, "temperature": "hot"}, error_param="temperature"),
    Spec("echo refused", False, {"prompt": PROMPT, "echo": True}, error_param="echo"),
]
GREEDY = SPECS[0]


def _short(spec: Spec, max_tokens: int) -> Spec:
    """``spec`` with fewer tokens: each one is an encrypted layer step of several seconds here."""
    return dataclasses.replace(spec, body={**spec.body, "max_tokens": max_tokens})


def _run(client: Client, spec: Spec) -> dict[str, Any]:
    """What the tenant's answer looks like to a user: chunk texts, text, finish reason, usage, logprobs."""
    api = client.chat.completions if spec.chat else client.completions
    key = "messages" if spec.chat else "prompt"
    extra = {k: v for k, v in spec.body.items() if k != key}
    result = api.create(**{key: spec.body[key]}, stream=spec.stream, extra_body=extra)
    if not spec.stream:
        choice = result.choices[0]
        text = choice.message.content if spec.chat else choice.text
        return {"text": text, "finish": choice.finish_reason, "usage": result.usage.completion_tokens,
                "logprobs": choice.logprobs}
    pieces, finish = [], None
    for chunk in result:
        for c in chunk.choices:
            piece = (c.delta.content or "") if spec.chat else c.text
            pieces.append(piece)
            finish = c.finish_reason or finish
    return {"pieces": pieces, "text": "".join(pieces), "finish": finish}


def _same(plain: dict[str, Any], enc: dict[str, Any]) -> None:
    assert enc["finish"] == plain["finish"]
    assert enc["text"] == plain["text"]
    if "pieces" in plain:
        assert enc["pieces"] == plain["pieces"]   # the same deltas: hold-back included
    if plain.get("logprobs") is not None:
        p, e = plain["logprobs"], enc["logprobs"]
        assert e["tokens"] == p["tokens"] and e["text_offset"] == p["text_offset"]
        assert [list(t) for t in e["top_logprobs"]] == [list(t) for t in p["top_logprobs"]]
        for a, b in zip(e["token_logprobs"], p["token_logprobs"], strict=True):
            assert abs(a - b) < 0.2          # CKKS noise + the approximated softmax of one layer


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name if isinstance(s, Spec) else None)
def test_plaintext_and_encrypted_tenants_agree(tenants, spec):
    if spec.error_param is not None:
        with pytest.raises(BadRequestError) as plain_err:
            _run(tenants["plain"], spec)
        with pytest.raises(PrivateModeError) as enc_err:
            _run(tenants["enc"], spec)
        assert plain_err.value.param == enc_err.value.param == spec.error_param
        return
    stops = spec.name in ("stop-string hold-back", "stop_token_ids")
    if stops:  # stops inside the plaintext greedy answer
        greedy = _run(tenants["plain"], Spec("", False, {**spec.body, "stop": None}))
        spec = dataclasses.replace(spec, body={**spec.body, **_stops(spec.name, greedy["text"])})
    plain = _run(tenants["plain"], spec)
    enc = _run(tenants["enc"], spec)
    _same(plain, enc)
    if stops:
        # the stop cut the greedy answer short (chunks are not tokens: held-back text streams as "" chunks)
        assert plain["finish"] == "stop" and len(plain["text"]) < len(greedy["text"])
        assert greedy["text"].startswith(plain["text"])
        assert not any(s in plain["text"] for s in spec.body.get("stop") or [])
        shown = ""
        for piece in enc["pieces"]:           # no prefix of the stop string ever reached the stream
            shown += piece
            assert shown == enc["text"][:len(shown)]
    if spec.name.startswith("chat default"):
        assert plain["finish"] == "length" and len(plain["pieces"]) - 1 == TENANT_MAX_TOKENS


def test_async_client_sends_its_own_bytes(app_client, tenants, key_store):
    """AsyncClient's encrypted path: the runtime's calls go through the AsyncClient's own transport (an
    ASGITransport on the app's loop: a blocking twin client could not reach it), same answer."""
    from client_sdk._private import _async_runtime

    http, app = app_client
    spec = _short(GREEDY, 2)      # the transport is under test, not the length
    expected = _run(tenants["plain"], spec)
    sent: list[str] = []

    async def run() -> str:
        async def record(request: httpx.Request) -> None:
            sent.append(request.url.path)

        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, event_hooks={"request": [record]}) as ahttp:
            async with AsyncClient(api_key=KEYS["enc"], base_url="http://testserver", http_client=ahttp,
                                   privacy="encrypted", max_retries=0, key_store=key_store) as client:
                _async_runtime(client).cache_dir = tenants["enc"]._private.cache_dir
                stream = await client.completions.create(prompt=PROMPT, stream=True,
                                                         extra_body={k: v for k, v in spec.body.items()
                                                                     if k != "prompt"})
                return "".join([c.choices[0].text async for c in stream])

    text = http.portal.call(run)
    assert text == expected["text"]
    assert any(p.endswith("/steps") for p in sent) and "/v1/private/sessions" in sent
    assert not any(p.startswith("/v1/private/keys/") for p in sent)   # the key store's key: not uploaded again


def test_lost_session_is_replayed_without_a_new_key(app_client, tenants):
    """The server closes the session between two tokens: the runtime opens a new one on the same key,
    replays the positions so far and the answer is unchanged; no key is uploaded again."""
    http, _ = app_client
    spec = _short(GREEDY, 3)      # one token before the session is lost, two replayed after it
    expected = _run(tenants["plain"], spec)
    client = tenants["enc"]
    runtime = client._private
    sent: list[str] = []
    http.event_hooks["request"].append(lambda request: sent.append(f"{request.method} {request.url.path}"))
    stream = client.completions.create(prompt=PROMPT, stream=True,
                                       extra_body={k: v for k, v in spec.body.items() if k != "prompt"})
    pieces = [next(stream).choices[0].text]
    sid = runtime.session.id
    r = http.delete(f"/v1/private/sessions/{sid}", headers={"Authorization": f"Bearer {KEYS['enc']}"})
    assert r.status_code == 204
    pieces += [c.choices[0].text for c in stream]
    http.event_hooks["request"].pop()
    assert "".join(pieces) == expected["text"]
    assert sent.count("POST /v1/private/sessions") == 2 and runtime.session is None
    assert not any(s.startswith("POST /v1/private/keys") for s in sent)
