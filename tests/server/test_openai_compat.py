"""The official ``openai`` package against a real ``cipherlm serve`` process on loopback."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.server.app_helpers import KEYS, live_server, tiny_loaded, tiny_model_dir  # noqa: F401 (fixtures)


@pytest.fixture
def oai(live_server):  # noqa: F811
    client = openai.OpenAI(api_key=KEYS["plain"], base_url=live_server.url + "/v1", max_retries=0, timeout=60)
    yield client
    client.close()


def test_models(oai):
    assert [m.id for m in oai.models.list().data] == ["tiny"]


def test_completion(oai):
    resp = oai.completions.create(model="tiny", prompt="The capital of France is", max_tokens=8,
                                  temperature=0, n=2, extra_body={"top_k": 5, "ignore_eos": True})
    assert resp.object == "text_completion" and len(resp.choices) == 2
    assert {c.index for c in resp.choices} == {0, 1}
    assert resp.choices[0].text == resp.choices[1].text  # greedy: both choices agree
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 16 and resp.usage.prompt_tokens > 0
    assert resp.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_stream_matches_full(oai):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    full = oai.completions.create(**kw).choices[0].text
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat(oai):
    resp = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say hi"}],
                                       max_tokens=6, seed=7, temperature=0.8, logprobs=True, top_logprobs=2)
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert len(choice.logprobs.content) == resp.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    again = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say hi"}],
                                        max_tokens=6, seed=7, temperature=0.8)
    assert again.choices[0].message.content == choice.message.content  # seeded sampling is reproducible


def test_chat_stream(oai):
    stream = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Count"}],
                                         max_tokens=10, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    full = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Count"}],
                                       max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_openai_errors(live_server):  # noqa: F811
    bad = openai.OpenAI(api_key="clm-wrong", base_url=live_server.url + "/v1", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    enc = openai.OpenAI(api_key=KEYS["enc"], base_url=live_server.url + "/v1", max_retries=0)
    with pytest.raises(openai.PermissionDeniedError) as info:
        enc.completions.create(model="tiny", prompt="secret", max_tokens=2)
    assert "privacy='encrypted'" in info.value.message
    ok = openai.OpenAI(api_key=KEYS["plain"], base_url=live_server.url + "/v1", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        ok.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        ok.completions.create(model="gpt-4", prompt="x", max_tokens=2)


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def test_disconnect_cancels_engine_request(live_server):  # noqa: F811
    """Closing a stream mid-way aborts the request in the engine (it stops running)."""
    body = {"model": "tiny", "prompt": "Go on forever", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEYS['plain2']}"}
    with httpx.stream("POST", live_server.url + "/v1/completions", json=body, headers=headers, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data:")
        assert _metric(live_server.url, "cipherlm:num_requests_running") == 1.0
    deadline = time.monotonic() + 10
    while _metric(live_server.url, "cipherlm:num_requests_running") != 0.0:
        assert time.monotonic() < deadline, "the engine still runs the request after the client left"
        time.sleep(0.1)
    generated = _metric(live_server.url, "cipherlm:engine_generation_tokens_total")
    time.sleep(0.5)
    assert _metric(live_server.url, "cipherlm:engine_generation_tokens_total") == generated
    assert generated < 2500, "the request ran to max_tokens instead of being aborted"
    steps = _metric(live_server.url, "cipherlm:engine_steps_total")  # the engine's step counters, exported
    assert 1 <= _metric(live_server.url, "cipherlm:engine_prefill_steps_total") < steps
    assert _metric(live_server.url, "cipherlm:engine_step_tokens_total") >= steps
    assert _metric(live_server.url, "cipherlm:engine_step_seconds_total") > 0
    assert _metric(live_server.url, "cipherlm:engine_graph_steps_total") == 0  # the CPU replays no graph


def test_skip_special_tokens_reaches_the_detokenizer():
    """The API's and the SDK's ``skip_special_tokens`` extra lands in SamplingParams (the output processor
    hands it to the detokenizer: tests/engine/test_tokenizer.py); both go through engine.openai_api."""
    from engine.openai_api import OpenAIRequestError, sampling_params
    from server.routers.openai import _sampling_params
    from server.routers.openai_schemas import CompletionRequest

    assert _sampling_params(CompletionRequest(prompt="x"), 4).skip_special_tokens is True
    assert _sampling_params(CompletionRequest(prompt="x", skip_special_tokens=False), 4).skip_special_tokens is False
    sdk = sampling_params({"prompt": "x", "skip_special_tokens": False}, chat=False, max_tokens=4)
    assert sdk.skip_special_tokens is False
    with pytest.raises(OpenAIRequestError, match="skip_special_tokens"):
        sampling_params({"prompt": "x", "skip_special_tokens": "no"}, chat=False, max_tokens=4)
