"""Logits processors: applied before sampling on every path (greedy fast path included), batched."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.llm import LLM
from engine.logits_process import BanTokens, BatchLogitsProcessor
from engine.sampler import Sampler, SamplingRow
from engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import random_prompts, tiny_model
from tests.engine.test_llm import cpu_config

VOCAB = 97
KEEP = [5, 6, 7]
BAN_ALL_BUT = BanTokens([t for t in range(VOCAB) if t not in KEEP])


def ban_one(token: int):
    """A plain vLLM-style two-argument processor."""
    def proc(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[token] = float("-inf")
        return logits
    return proc


class CountingBan(BanTokens):
    """Records the number of rows of every batched call."""

    def __init__(self, ids):
        super().__init__(ids)
        self.calls: list[int] = []

    def apply_batch(self, prompt_token_ids, output_token_ids, logits):
        self.calls.append(logits.shape[0])
        return super().apply_batch(prompt_token_ids, output_token_ids, logits)


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_model(), engine_config=cpu_config(max_num_batched_tokens=128))


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, **kw)


def _sampled(seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=seed, **kw)


@pytest.mark.parametrize("batched", [False, True])
def test_banning_the_greedy_token_changes_greedy_output(llm, batched):
    prompts = random_prompts([7, 19, 4], vocab=VOCAB, seed=11)
    if not batched:
        prompts = prompts[:1]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy())]
    params = [_greedy(logits_processors=[ban_one(ids[0])]) for ids in plain]
    banned = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for ids, got in zip(plain, banned, strict=True):
        assert ids[0] not in got          # the ban held at every position
        assert got[0] != ids[0]           # and it changed what the greedy path picked


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("greedy", [False, True])
def test_ban_holds_for_every_token_greedy_and_sampled(llm, batched, greedy):
    prompts = random_prompts([9, 30, 3, 16], vocab=VOCAB, seed=12)[: 4 if batched else 1]
    params = [_greedy(logits_processors=[BAN_ALL_BUT]) if greedy else
              _sampled(i, logits_processors=[BAN_ALL_BUT]) for i in range(len(prompts))]
    for out in llm.generate(prompts, params):
        assert len(out.outputs[0].token_ids) == 10
        assert set(out.outputs[0].token_ids) <= set(KEEP)
    unbanned = llm.generate(prompts, [_sampled(i) for i in range(len(prompts))])
    assert any(set(o.outputs[0].token_ids) - set(KEEP) for o in unbanned)  # the test can fail


def test_request_without_processor_is_untouched_in_a_mixed_batch(llm):
    prompts = random_prompts([12, 21], vocab=VOCAB, seed=13)
    solo = llm.generate([prompts[1]], _greedy())[0].outputs[0].token_ids
    outs = llm.generate(prompts, [_greedy(logits_processors=[BAN_ALL_BUT]), _greedy()])
    assert set(outs[0].outputs[0].token_ids) <= set(KEEP)
    assert outs[1].outputs[0].token_ids == solo


def test_shared_batch_processor_runs_once_per_step_over_all_its_rows(llm):
    ban = CountingBan([1, 2, 3])
    prompts = random_prompts([6, 6, 6], vocab=VOCAB, seed=14)
    params = [_greedy(logits_processors=[ban]), _sampled(0, logits_processors=[ban]),
              _greedy(logits_processors=[ban])]
    llm.generate(prompts, params)
    assert ban.calls and max(ban.calls) == 3    # one call for the greedy and sampled rows together
    assert sum(ban.calls) == 3 * 10             # every token of every request went through it


def test_three_argument_processor_gets_the_prompt():
    seen = []

    def proc(prompt_ids, output_ids, logits):
        seen.append((list(prompt_ids), list(output_ids)))
        logits[0] = 1e9
        return logits
    rows = [SamplingRow(SamplingParams(temperature=0, logits_processors=[proc]), [4, 5], [6])]
    out = Sampler()(torch.zeros(1, 8), rows)
    assert out.token_ids == [0] and seen == [([4, 5], [6])]


def test_logprobs_are_after_the_processors():
    rows = [SamplingRow(SamplingParams(temperature=0, logprobs=2, logits_processors=[BanTokens([3])]), [], [])]
    x = torch.tensor([[0.0, 1.0, 2.0, 9.0]])
    out = Sampler()(x, rows)
    assert out.token_ids == [2] and 3 not in out.logprobs[0]


def test_batch_processor_single_row_form_matches_vllm_signature():
    row = torch.zeros(5)
    assert BanTokens([1])([], row)[1] == float("-inf")
    assert isinstance(BAN_ALL_BUT, BatchLogitsProcessor)


def test_non_callable_processor_is_a_typed_error():
    with pytest.raises(InvalidRequestError, match="logits_processors"):
        SamplingParams(logits_processors=["ban"])  # type: ignore[list-item]
