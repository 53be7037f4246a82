"""The app in-process (ASGI): endpoints, OpenAI shapes, errors, draining, metrics — on the real engine."""

from __future__ import annotations

import json

import httpx
import pytest

from server.app import Lifecycle, create_app
from tests.server.app_helpers import auth, engine, make_settings, tiny_loaded, tiny_model_dir  # noqa: F401


@pytest.fixture
async def client(engine, tiny_model_dir):  # noqa: F811
    app = create_app(make_settings(tiny_model_dir), engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        c.app = app
        yield c


def _events(text: str) -> list:
    data = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


async def test_health_and_models(client):
    assert (await client.get("/health/live")).json() == {"status": "ok"}
    assert (await client.get("/health/ready")).status_code == 200
    models = (await client.get("/v1/models", headers=auth("plain"))).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert models["data"][0]["max_model_len"] > 0


async def test_completion_shape_and_usage(client):
    r = await client.post("/v1/completions", headers=auth("plain"),
                          json={"prompt": "Hello there", "max_tokens": 4, "logprobs": 3, "ignore_eos": True})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert all(len(t) <= 3 for t in lp["top_logprobs"]) and all(v <= 0 for v in lp["token_logprobs"])
    assert "".join(lp["tokens"]) == choice["text"]
    u = body["usage"]
    assert u["completion_tokens"] == 4 and u["total_tokens"] == u["prompt_tokens"] + 4
    assert "cached_tokens" in u["prompt_tokens_details"]


async def test_batched_and_token_prompts(client):
    r = await client.post("/v1/completions", headers=auth("plain"),
                          json={"prompt": ["one", "two", "three"], "max_tokens": 2, "n": 2, "temperature": 0})
    choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == list(range(6))
    assert choices[0]["text"] == choices[1]["text"]  # greedy n=2 on the same prompt
    r = await client.post("/v1/completions", headers=auth("plain"), json={"prompt": [1, 2, 3], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3
    r = await client.post("/v1/completions", headers=auth("plain"), json={"prompt": [[1, 2], [3]], "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


async def test_stop_string_cuts_text(client):
    base = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    full = (await client.post("/v1/completions", headers=auth("plain"), json=base)).json()["choices"][0]["text"]
    stop = full.strip()[:3]
    assert stop
    cut = (await client.post("/v1/completions", headers=auth("plain"), json={**base, "stop": [stop]})).json()
    assert cut["choices"][0]["finish_reason"] == "stop" and stop not in cut["choices"][0]["text"]
    assert full.startswith(cut["choices"][0]["text"])


async def test_streamed_completion_equals_full(client):
    body = {"prompt": ["a b c", "x y"], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    full = (await client.post("/v1/completions", headers=auth("plain"), json=body)).json()
    r = await client.post("/v1/completions", headers=auth("plain"),
                          json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    texts: dict[int, str] = {}
    for e in events[:-1]:
        for ch in e["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
    assert texts == {c["index"]: c["text"] for c in full["choices"]}
    assert events[-1]["choices"] == [] and events[-1]["usage"] == full["usage"]


async def test_stream_interval_coalesces_chunks(engine, tiny_model_dir):  # noqa: F811
    # stream_interval = 4: the first chunk at once, then chunks of >= 4 tokens, the last one shorter;
    # the text is the non-streamed text whatever the chunking
    app = create_app(make_settings(tiny_model_dir, stream_interval=4), engine)
    body = {"prompt": "a b c", "max_tokens": 10, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        full = (await c.post("/v1/completions", headers=auth("plain"), json=body)).json()["choices"][0]
        events = _events((await c.post("/v1/completions", headers=auth("plain"),
                                       json={**body, "stream": True})).text)
    per_chunk = [len(e["choices"][0]["logprobs"]["tokens"]) for e in events]
    assert sum(per_chunk) == 10 and per_chunk[0] == 1 and all(k >= 4 for k in per_chunk[1:-1])
    assert len(events) < 10 and "".join(e["choices"][0]["text"] for e in events) == full["text"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


async def test_streamed_chat(client):
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 1}
    full = (await client.post("/v1/chat/completions", headers=auth("plain"), json=body)).json()
    assert full["object"] == "chat.completion" and full["choices"][0]["message"]["role"] == "assistant"
    events = _events((await client.post("/v1/chat/completions", headers=auth("plain"),
                                        json={**body, "stream": True})).text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == full["choices"][0]["message"]["content"]
    streamed_lps = [t for e in events if e["choices"][0]["logprobs"] for t in e["choices"][0]["logprobs"]["content"]]
    assert [t["token"] for t in streamed_lps] == [t["token"] for t in full["choices"][0]["logprobs"]["content"]]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "logit_bias": {"1": 5}}, "logit_bias"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "n": 9}, "n"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": "x", "max_tokens": 10**6}, "max_tokens"),
    ({"prompt": "x", "skip_special_tokens": "maybe"}, "skip_special_tokens"),
    ({"max_tokens": 3}, "prompt"),
])
async def test_bad_completion_input_is_400(client, body, param):
    r = await client.post("/v1/completions", headers=auth("plain"), json=body)
    err = r.json()["error"]
    assert r.status_code == 400, r.text
    assert err["type"] == "invalid_request_error" and err["param"].startswith(param)


async def test_other_client_errors(client):
    r = await client.post("/v1/completions", headers=auth("plain"), json={"prompt": "x", "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = await client.post("/v1/completions", headers={**auth("plain"), "content-type": "application/json"},
                          content=b"{not json")
    assert r.status_code == 400 and "error" in r.json()
    r = await client.post("/v1/chat/completions", headers=auth("plain"),
                          json={"messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400
    r = await client.post("/v1/chat/completions", headers=auth("plain"),
                          json={"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    r = await client.get("/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = await client.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    r = await client.post("/v1/completions", headers=auth("plain"), content=b"x" * 2_000_000)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"


async def test_nan_is_rejected(client):
    r = await client.post("/v1/completions", headers={**auth("plain"), "content-type": "application/json"},
                          content=b'{"prompt": "x", "temperature": NaN}')
    assert r.status_code == 400


async def test_draining_refuses_new_work(client):
    client.app.state.lifecycle.draining = True
    assert (await client.get("/health/ready")).status_code == 503
    r = await client.post("/v1/completions", headers=auth("plain"), json={"prompt": "x"})
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert r.json()["error"]["code"] == "server_draining"
    assert (await client.get("/health/live")).status_code == 200


async def test_lifecycle_drain_waits_for_in_flight():
    import asyncio

    lc = Lifecycle()
    lc.in_flight = 1

    async def finish_later():
        await asyncio.sleep(0.1)
        lc.in_flight = 0

    task = asyncio.create_task(finish_later())
    assert await lc.drain(timeout_s=5) and lc.draining
    await task
    lc.in_flight = 1
    assert not await lc.drain(timeout_s=0.05)


async def test_metrics_exported_by_tenant(client):
    await client.post("/v1/completions", headers=auth("plain2"), json={"prompt": "x", "max_tokens": 3,
                                                                        "ignore_eos": True})
    text = (await client.get("/metrics")).text
    assert 'cipherlm:generation_tokens_total{model_name="tiny",tenant="plain2"} 3.0' in text
    assert 'cipherlm:time_to_first_token_seconds_count{model_name="tiny",tenant="plain2"} 1.0' in text
    assert 'cipherlm:request_queue_time_seconds_count{model_name="tiny",tenant="plain2"} 1.0' in text
    assert 'cipherlm:first_token_delivery_seconds_count{model_name="tiny",tenant="plain2"} 1.0' in text
    assert 'cipherlm:request_success_total{finished_reason="length",model_name="tiny",tenant="plain2"} 1.0' in text
    assert "cipherlm:kv_cache_usage_perc" in text and "cipherlm:num_requests_running" in text
    assert "x" not in [line.split("{")[0] for line in text.splitlines()]  # nothing from the prompt


async def test_settings_dependency_can_be_overridden(client):
    from server.settings import get_settings

    other = make_settings(None, served_model_name="renamed")
    client.app.dependency_overrides[get_settings] = lambda: other
    models = (await client.get("/v1/models", headers=auth("plain"))).json()
    assert models["data"][0]["id"] == "renamed"


async def test_client_gone_before_stream_starts_frees_everything(engine, tiny_model_dir):  # noqa: F811
    """A client that disconnects right away leaves no engine request and no held concurrency slot."""
    import asyncio

    app = create_app(make_settings(tiny_model_dir), engine)
    body = json.dumps({"prompt": "hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"authorization", f"Bearer {auth('plain')['Authorization'].split()[1]}".encode())]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "headers": headers, "client": ("127.0.0.1", 1), "server": ("test", 80)}
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    sent = []

    async def send(message):  # a slow network: the disconnect is seen before the body starts
        sent.append(message)
        await asyncio.sleep(0.05)

    await asyncio.wait_for(app(scope, receive, send), timeout=30)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    limiter = app.state.limits.for_tenant("plain", app.state.settings.limits_default)
    assert limiter.in_flight == 0
    for _ in range(100):
        await engine.wait_idle()
        if engine.stats().num_running == 0 and engine.stats().num_waiting == 0:
            break
        await asyncio.sleep(0.05)
    assert engine.stats().num_running == 0 and engine.stats().num_waiting == 0
    assert app.state.lifecycle.in_flight == 0


def test_settings_file_env_and_overrides(tmp_path, monkeypatch):
    from pydantic import ValidationError

    from server.settings import Settings

    path = tmp_path / "s.toml"
    path.write_text('port = 8100\nmax_n = 4\n[limits_default]\nmax_concurrent = 3\n'
                    '[[tenants]]\nid = "t1"\nprivacy_mode = "encrypted"\nfallback = "non_sensitive"\n')
    monkeypatch.setenv("CIPHERLM_MAX_N", "6")
    s = Settings.load(path, host="0.0.0.0")
    assert (s.port, s.max_n, s.host, s.limits_default.max_concurrent) == (8100, 6, "0.0.0.0", 3)
    assert s.tenants[0].privacy_mode.value == "encrypted" and s.tenants[0].fallback.value == "non_sensitive"
    assert s.limits_for(s.tenants[0]).max_concurrent == 3
    path.write_text("prot = 1\n")
    with pytest.raises(ValidationError):
        Settings.load(path)
    with pytest.raises(FileNotFoundError):
        Settings.load(tmp_path / "missing.toml")
