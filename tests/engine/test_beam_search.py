"""Beam search: transformers' ``num_beams`` search on the same weights, shared KV blocks, bad input."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, BeamSearchParams
from engine.engine_config import EngineConfig
from engine.errors import EngineOverloadedError, InvalidRequestError
from tests.engine.engine_helpers import random_prompts
from tests.engine.hf_tiny import hf_tiny, ours_from_hf


@pytest.fixture(scope="module")
def pair():
    hf = hf_tiny("llama-gqa", seed=3)
    return hf, ours_from_hf(hf)


def _llm(model, **kw) -> LLM:
    return LLM(model, None, EngineConfig(device="cpu", block_size=4, **({"num_kv_blocks": 512} | kw)))


@torch.inference_mode()
def _hf_beams(hf, ids: list[int], width: int, max_tokens: int, length_penalty: float, eos: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([ids]), num_beams=width, num_return_sequences=1, do_sample=False,
                      max_new_tokens=max_tokens, length_penalty=length_penalty, early_stopping=False,
                      eos_token_id=eos, pad_token_id=eos[0])[0, len(ids):].tolist()
    for i, t in enumerate(out):  # what follows the end-of-sequence token is padding
        if t in eos:
            return out[:i + 1]
    return out


@pytest.mark.parametrize("width, length_penalty", [(2, 1.0), (4, 1.0), (3, 0.5), (4, 2.0)])
def test_beams_equal_transformers_on_random_weights(pair, width, length_penalty):
    hf, ours = pair
    llm = _llm(ours)
    eos = sorted(llm.engine.output_processor.eos)
    # eos ids at 3, 5 and 8 make beams end early in some prompts (finished-set and early-stop paths)
    eos_llm = _llm(ours)
    eos_llm.engine.output_processor.eos = {3, 5, 8}
    prompts = random_prompts([5, 9, 14, 7, 20], seed=11)
    params = BeamSearchParams(width, max_tokens=12, length_penalty=length_penalty)
    for engine_llm, stop in ((llm, eos), (eos_llm, [3, 5, 8])):
        outs = engine_llm.beam_search(prompts, params)
        for ids, out in zip(prompts, outs, strict=True):
            assert len(out.sequences) == width
            assert out.sequences[0].token_ids == _hf_beams(hf, ids, width, 12, length_penalty, stop), (ids, stop)
            scores = [s.score for s in out.sequences]
            assert scores == sorted(scores, reverse=True)
    stopped = [s for o in eos_llm.beam_search(prompts, params) for s in o.sequences if s.finish_reason == "stop"]
    assert stopped and all(s.token_ids[-1] in (3, 5, 8) for s in stopped)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks  # every beam freed


def test_beams_share_the_prompt_blocks(pair):
    _, ours = pair
    prompt = random_prompts([64], seed=2)[0]
    # 64 prompt tokens = 16 blocks of 4; 4 beams of 64 + 8 tokens copied apart would need 4 * 18 = 72 blocks
    llm = _llm(ours, num_kv_blocks=36)
    out = llm.beam_search([prompt], BeamSearchParams(4, max_tokens=8, ignore_eos=True))[0]
    assert len(out.sequences) == 4 and all(len(s.token_ids) == 8 for s in out.sequences)
    with pytest.raises(EngineOverloadedError):   # too few blocks even shared: a typed error, no crash
        _llm(ours, num_kv_blocks=18).beam_search([prompt], BeamSearchParams(8, max_tokens=8, ignore_eos=True))


def test_bad_beam_search_input_is_refused(pair):
    _, ours = pair
    for bad in (dict(beam_width=0), dict(beam_width=65), dict(beam_width=2, max_tokens=0),
                dict(beam_width=2, length_penalty=float("nan")), dict(beam_width=True)):
        with pytest.raises(InvalidRequestError):
            BeamSearchParams(**bad)
    llm = _llm(ours, max_model_len=32)
    with pytest.raises(InvalidRequestError, match="maximum model length"):
        llm.beam_search([[1] * 30], BeamSearchParams(2, max_tokens=8))
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.beam_search([[]], BeamSearchParams(2))
