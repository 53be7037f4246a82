"""Beam search on the real default model equals transformers' ``num_beams`` search (same weights, fp32)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, BeamSearchParams
from engine.engine_config import EngineConfig
from tests.engine.test_beam_search import _hf_beams
from tests.engine.test_smollm2 import PROMPTS

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module")
def models(default_model_dir):
    """(transformers' model, our LLM) on the default model, loaded once for both cases: each case is a new
    set of requests to the same engine, as a user's second call would be."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()
    return hf, LLM(default_model_dir, engine_config=EngineConfig(device="cpu"))


@pytest.mark.parametrize("width, length_penalty", [(4, 1.0), (3, 0.6)])
def test_beams_equal_transformers_on_smollm2(models, width, length_penalty):
    hf, llm = models
    tok = llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS[:5]]
    outs = llm.beam_search(prompts, BeamSearchParams(width, max_tokens=24, length_penalty=length_penalty))
    eos = sorted(llm.engine.output_processor.eos)
    for ids, out in zip(prompts, outs, strict=True):
        ref = _hf_beams(hf, ids, width, 24, length_penalty, eos)
        assert out.sequences[0].token_ids == ref, tok.decode(ids)
        assert out.sequences[0].text == tok.decode(ref)
