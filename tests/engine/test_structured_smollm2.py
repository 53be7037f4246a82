"""Structured output on the real default model: 100 % of 50 prompt × schema pairs parse and validate.

The pairs (10 schemas with nesting, enums, arrays, required fields, bounded integers and string patterns,
× 5 chat prompts) and the generation are those of ``bench/structured.py``, which also measures the
per-token overhead; this test runs its validity part (greedy, one batch of 50).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from engine.engine_config import EngineConfig
from engine.llm import LLM

pytestmark = [pytest.mark.model, pytest.mark.slow]

BENCH = Path(__file__).resolve().parents[2] / "bench" / "structured.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_structured", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fifty_pairs_all_parse_and_validate(default_model_dir):
    bench = _bench()
    llm = LLM(default_model_dir, engine_config=EngineConfig(device="cpu", max_num_seqs=64,
                                                            max_num_batched_tokens=2048))
    cases = bench.pairs()
    assert len(cases) >= 50 and len({n for n, _ in cases}) == 10
    report = bench.validity(llm, cases)
    bad = [(r["schema"], r["prompt"], r["error"], r["text"][-80:]) for r in report["results"] if r["error"]]
    assert not bad and report["valid"] == report["pairs"] == len(cases)
    assert all(r["finish_reason"] == "stop" for r in report["results"])
