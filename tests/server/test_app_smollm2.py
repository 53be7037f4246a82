"""End to end on the default SmolLM2-135M-Instruct: the served model answers through the API."""

from __future__ import annotations

import httpx
import pytest

from server.app import create_app
from tests.server.app_helpers import auth, make_settings

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def smol_loaded(default_model_dir):
    from engine.loader import load_model
    from engine.tokenizer import Tokenizer

    return load_model(default_model_dir), Tokenizer.from_folder(default_model_dir)


@pytest.fixture
async def smol_client(smol_loaded):
    from engine.async_llm import AsyncLLM
    from engine.engine_config import EngineConfig

    model, tok = smol_loaded
    llm = AsyncLLM.from_model(model, tok, EngineConfig(device="cpu", num_kv_blocks=128))
    await llm.start()
    app = create_app(make_settings(None, served_model_name="SmolLM2-135M-Instruct"), llm)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        yield c
    await llm.shutdown()


async def test_chat_answers_a_fact(smol_client):
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24, "temperature": 0}
    r = await smol_client.post("/v1/chat/completions", headers=auth("plain"), json=body)
    answer = r.json()["choices"][0]["message"]["content"]
    assert r.status_code == 200 and "Paris" in answer, answer


async def test_streamed_completion_equals_full_and_prefix_cache_hits(smol_client):
    body = {"prompt": "Water boils at a temperature of " * 3, "max_tokens": 12, "temperature": 0}
    full = (await smol_client.post("/v1/completions", headers=auth("plain"), json=body)).json()
    r = await smol_client.post("/v1/completions", headers=auth("plain"), json={**body, "stream": True})
    import json

    events = [json.loads(line[5:]) for line in r.text.splitlines()
              if line.startswith("data:") and not line.endswith("[DONE]")]
    assert "".join(e["choices"][0]["text"] for e in events) == full["choices"][0]["text"]
    again = (await smol_client.post("/v1/completions", headers=auth("plain"), json=body)).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    assert again["choices"][0]["text"] == full["choices"][0]["text"]
