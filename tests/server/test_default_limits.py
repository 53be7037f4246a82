"""The shipped default limits: a tenant without its own limits cannot queue unbounded long prompts.

A tiny random model with an 8,192-token context (SmolLM2's) is served, so the 4,096-token default of
``max_context_tokens`` -- not the model's length -- is what refuses a longer request.
"""

from __future__ import annotations

import re

import httpx
import pytest

from server.app import create_app
from server.limits import LimitRegistry
from server.settings import LimitSettings, Settings
from tests.server.app_helpers import auth, build_tiny_model_dir, make_settings

MODEL_LEN = 8192


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-8k"), max_len=MODEL_LEN)


@pytest.fixture
async def long_engine(long_model_dir):
    from engine.async_llm import AsyncLLM
    from engine.engine_config import EngineConfig
    from engine.loader import load_model
    from engine.tokenizer import Tokenizer

    llm = AsyncLLM.from_model(load_model(long_model_dir), Tokenizer.from_folder(long_model_dir),
                              EngineConfig(device="cpu", num_kv_blocks=1024, block_size=16, max_waiting=64))
    await llm.start()
    yield llm
    await llm.shutdown()


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def _body(prompt_tokens: int, max_tokens: int) -> dict:
    return {"prompt": [101] * prompt_tokens, "max_tokens": max_tokens, "ignore_eos": True}


def test_defaults_cap_context_and_token_rate():
    lim = Settings().limits_default
    assert (lim.max_context_tokens, lim.tokens_per_minute) == (4096, 60_000)
    assert LimitSettings(max_context_tokens=0, tokens_per_minute=0).max_context_tokens is None  # 0: off


async def test_default_context_limit_refuses_long_prompts(long_engine, long_model_dir):
    app = create_app(make_settings(long_model_dir), long_engine, limits=LimitRegistry(FakeClock()))
    async with _client(app) as c:
        r = await c.post("/v1/completions", json=_body(4000, 97), headers=auth("plain"))
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and "4096" in err["message"]
        r = await c.post("/v1/completions", json=_body(4000, 96), headers=auth("plain"))
        assert r.status_code == 200


async def test_context_limit_switched_off_allows_the_model_length(long_engine, long_model_dir):
    settings = make_settings(long_model_dir, limits_default=LimitSettings(max_context_tokens=0))
    app = create_app(settings, long_engine, limits=LimitRegistry(FakeClock()))
    async with _client(app) as c:
        r = await c.post("/v1/completions", json=_body(5000, 1), headers=auth("plain"))
        assert r.status_code == 200


async def test_default_token_rate_bounds_one_tenants_backlog(long_engine, long_model_dir):
    clock = FakeClock()
    app = create_app(make_settings(long_model_dir), long_engine, limits=LimitRegistry(clock))
    async with _client(app) as c:
        for _ in range(15):   # 15 x 4,000 tokens = the default 60,000 per minute
            r = await c.post("/v1/completions", json=_body(3999, 1), headers=auth("plain"))
            assert r.status_code == 200
        r = await c.post("/v1/completions", json=_body(3999, 1), headers=auth("plain"))
        assert r.status_code == 429 and r.json()["error"]["code"] == "tokens_per_minute_exceeded"
        r = await c.post("/v1/completions", json=_body(8, 1), headers=auth("plain2"))
        assert r.status_code == 200   # another tenant's budget is its own
        clock.now += 4.0              # 4 s refill 4,000 tokens
        r = await c.post("/v1/completions", json=_body(3999, 1), headers=auth("plain"))
        assert r.status_code == 200


def test_operator_guide_states_the_shipped_defaults():
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[2] / "docs" / "operator-guide.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", guide.split("## Limits", 1)[1], re.M))
    for name, value in LimitSettings().model_dump().items():
        stated = rows[name].split(" (")[0].replace(" ", "")
        assert stated == ("none" if value is None else str(value)), name
