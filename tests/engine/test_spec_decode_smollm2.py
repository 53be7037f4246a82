"""Speculative greedy decoding on the real default model: the same tokens as without it, on 20 prompts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from engine.engine_config import EngineConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.engine.test_smollm2 import PROMPTS as QUESTIONS

pytestmark = [pytest.mark.model, pytest.mark.slow]

BENCH = Path(__file__).resolve().parents[2] / "bench" / "spec_decode.py"


def _bench_prompts() -> list[str]:
    spec = importlib.util.spec_from_file_location("bench_spec_decode", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PROMPTS


def test_speculative_greedy_equals_plain_greedy_on_twenty_prompts(default_model_dir):
    # copy-heavy prompts (drafts accepted) and open questions (drafts mostly rejected or absent)
    prompts = (_bench_prompts() + QUESTIONS + [f"Say '{q}' three times." for q in QUESTIONS[:4]])[:20]
    assert len(prompts) == 20
    llm = LLM(default_model_dir, engine_config=EngineConfig(device="cpu", max_num_seqs=32,
                                                            speculative_disable_by_batch_size=None))
    ids = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    plain = llm.generate(ids, SamplingParams(temperature=0, max_tokens=64, num_speculative_tokens=0))
    spec = llm.generate(ids, SamplingParams(temperature=0, max_tokens=64, num_speculative_tokens=8))
    for p, a, b in zip(prompts, plain, spec, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, p
        assert b.outputs[0].finish_reason == a.outputs[0].finish_reason
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 20 and stats.spec_num_accepted_tokens > 100, stats  # drafts did land
