"""Speculative decoding on tiny random models: proposer, KV rollback, lossless greedy, exact distribution."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from engine import LLM, SamplingParams
from engine import spec_decode as sd
from engine.block_manager import BlockManager
from engine.engine_config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.logits_process import BanTokens
from engine.parts import EngineParts
from tests.engine.engine_helpers import make_seq, random_prompts, run_to_computed, tiny_model
from tests.engine.test_model import our_logits

# ---- the n-gram proposer -------------------------------------------------------------------------


def test_ngram_copies_what_followed_the_latest_match():
    p = sd.NgramProposer(2, 3)
    assert p.propose([1, 2, 3, 4, 5, 9, 1, 2, 3], 2) == [4, 5]          # 3-gram [1, 2, 3]
    assert p.propose([7, 8, 1, 8, 2, 7, 8], 3) == [1, 8, 2]            # 2-gram [7, 8]
    assert p.propose([5, 6, 1, 5, 6, 2, 5, 6], 1) == [2]               # the latest of two matches


def test_ngram_prefers_the_longest_match_and_stops_at_the_end():
    p = sd.NgramProposer(1, 3)
    # the 1-gram [3] last occurs before 7; the 3-gram [1, 2, 3] before 4: longest wins
    assert p.propose([1, 2, 3, 4, 3, 7, 1, 2, 3], 1) == [4]
    assert p.propose([1, 2, 9, 1, 2], 5) == [9, 1, 2]                  # the history runs out first


def test_ngram_without_a_match_proposes_nothing():
    p = sd.NgramProposer(2, 4)
    assert p.propose([1, 2, 3, 4, 5], 4) == []
    assert p.propose([1, 2], 4) == []
    assert p.propose([1, 2, 1, 2], 0) == []


# ---- KV rollback ---------------------------------------------------------------------------------


def test_trim_frees_the_blocks_of_rejected_drafts():
    bm = BlockManager(16, 4)
    seq = make_seq(list(range(6)))
    run_to_computed(bm, seq)                      # 6 tokens: 2 blocks
    seq.token_ids.append(50)                      # the next token to compute
    assert bm.allocate_slots(seq, 1 + 8)          # a verify with 8 drafts: positions 6..14 -> 4 blocks
    assert len(seq.block_table) == 4 and bm.num_free_blocks == 12
    seq.num_computed_tokens += 1                  # the step computed the token ...
    seq.token_ids += [51, 52]                     # ... one draft was accepted, then the target's token
    sd.SpecDecoder(EngineConfig().spec_config(), 64).rollback(bm, seq, 1)
    assert seq.num_computed_tokens == 8
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 13  # 9 tokens need 3 blocks
    assert bm.allocate_slots(seq, 1)              # the next decode fits without a new block
    assert bm.num_free_blocks == 13


# ---- greedy: token for token what the engine decodes without drafts --------------------------------

def _engine_config(**kw) -> EngineConfig:
    base = dict(device="cpu", num_kv_blocks=256, block_size=4, speculative_disable_by_batch_size=None)
    return EngineConfig(**(base | kw))


def _repetitive_prompts(n: int, seed: int = 1) -> list[list[int]]:
    """Random token runs repeated: the model's greedy output tends to loop, so n-grams find drafts."""
    return [p * 3 for p in random_prompts([5 + i % 4 for i in range(n)], seed=seed)]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _outputs(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_greedy_speculation_is_lossless_in_a_mixed_batch(model):
    llm = LLM(model, None, _engine_config())
    prompts = _repetitive_prompts(8)
    ref = _outputs(llm, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    # half the batch speculates (various k), half does not: one step mixes verify rows and decodes
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, num_speculative_tokens=k)
              for k in (1, 0, 3, 0, 5, 0, 8, 16)]
    assert _outputs(llm, prompts, params) == ref
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 0 and 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert stats.spec_tokens_per_step > 1.5  # the loops are copied several tokens a step
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks  # nothing leaked


def test_greedy_speculation_is_lossless_with_processors_penalties_and_n(model):
    llm = LLM(model, None, _engine_config())
    prompts = _repetitive_prompts(4, seed=3)
    common = dict(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3,
                  logits_processors=[BanTokens([3, 5, 7])], logprobs=2)
    ref = llm.generate(prompts, SamplingParams(**common, num_speculative_tokens=0))
    got = llm.generate(prompts, SamplingParams(**common, num_speculative_tokens=4))
    for a, b in zip(ref, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            assert all(abs(la[t] - lb[t]) < 1e-4 for t in la)
    n_ref = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=20, n=3, ignore_eos=True))
    n_got = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=20, n=3, ignore_eos=True,
                                                     num_speculative_tokens=4))
    assert [c.token_ids for c in n_ref[0].outputs] == [c.token_ids for c in n_got[0].outputs]


def test_greedy_speculation_survives_preemption_and_stops(model):
    prompts = _repetitive_prompts(6, seed=5)
    params = dict(temperature=0, max_tokens=33, ignore_eos=True)
    ref = _outputs(LLM(model, None, _engine_config()), prompts, SamplingParams(**params))
    small = LLM(model, None, _engine_config(num_kv_blocks=24))   # too few blocks: preemption by recompute
    assert _outputs(small, prompts, SamplingParams(**params, num_speculative_tokens=6)) == ref
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.block_manager.num_free_blocks == small.engine.num_blocks
    # a stop token inside an accepted run ends the output there, as without drafts
    stop = ref[0][10]
    ref_stop = _outputs(LLM(model, None, _engine_config()), prompts[:1],
                        SamplingParams(**params, stop_token_ids=[stop]))
    got_stop = _outputs(small, prompts[:1], SamplingParams(**params, stop_token_ids=[stop],
                                                           num_speculative_tokens=8))
    assert got_stop == ref_stop and got_stop[0][-1] == stop


def test_deployment_default_and_switch_off_by_load(model):
    prompts = _repetitive_prompts(4, seed=7)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    on = LLM(model, None, _engine_config(num_speculative_tokens=4))
    on.generate(prompts, params)
    assert on.engine.stats().spec_num_drafts > 0
    loaded = LLM(model, None, _engine_config(num_speculative_tokens=4, speculative_disable_by_batch_size=3))
    calls, propose = [], loaded.engine.scheduler.proposer
    loaded.engine.scheduler.proposer = lambda seq, n, budget: calls.append(n) or propose(seq, n, budget)
    loaded.generate(prompts, params)                         # 4 running > 3: nobody speculates ...
    assert loaded.engine.stats().spec_num_drafts == 0
    assert not calls                                         # (the scheduler does not even ask the proposer)
    loaded.generate(prompts[:1], params)                     # ... but a lone request does
    assert loaded.engine.stats().spec_num_drafts > 0 and calls and set(calls) == {1}


def test_bad_speculation_requests_are_refused(model):
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=17)
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=-1)
    off = LLMEngine(model, None, _engine_config(speculative_method=None))
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens"):
        off.add_request("r", [1, 2, 3], SamplingParams(num_speculative_tokens=2))
    off.add_request("ok", [1, 2, 3], SamplingParams(num_speculative_tokens=0))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=99)
    with pytest.raises(ValueError, match="prompt_lookup"):
        EngineConfig(prompt_lookup_min=3, prompt_lookup_max=2)


# ---- sampled: the output keeps the target distribution (chi-square) -----------------------------

PROMPT = [11, 42, 7, 63, 29, 5]
TOP_K, STEPS, K = 3, 4, 2   # 3 tokens per position, 4 generated tokens (3 ** 4 = 81 outcomes), 2 drafts


@torch.inference_mode()
def _target_table(model) -> dict[tuple[int, ...], dict[int, float]]:
    """p(next | prompt + history) after top-k, for every history of length < STEPS (exact, dense cache)."""
    table: dict[tuple[int, ...], dict[int, float]] = {}
    frontier: list[tuple[int, ...]] = [()]
    for _ in range(STEPS):
        nxt = []
        for hist in frontier:
            ids = torch.tensor(PROMPT + list(hist))
            last = our_logits(model, ids, [ids.numel()])[-1]
            top = last.topk(TOP_K)
            table[hist] = dict(zip(top.indices.tolist(), top.values.softmax(-1).tolist(), strict=True))
            nxt += [hist + (t,) for t in table[hist]]
        frontier = nxt
    return table


class _TableProposer:
    """Drafts a likely-but-not-certain continuation: the 2nd most likely token, then the most likely."""

    def __init__(self, table) -> None:
        self.table = table

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        hist, drafts = tuple(token_ids[len(PROMPT):]), []
        for i in range(k):
            dist = self.table.get(hist)
            if dist is None:
                break
            ranked = sorted(dist, key=dist.get, reverse=True)
            drafts.append(ranked[1] if i == 0 else ranked[0])
            hist += (drafts[-1],)
        return drafts


def _chi_square_p(model, table, num: int = 3000) -> float:
    parts = EngineParts(spec_decoder=lambda cfg, n: sd.SpecDecoder(cfg, n, _TableProposer(table)))
    llm = LLM(model, None, _engine_config(num_kv_blocks=2048, max_num_seqs=256, seed=1234), parts=parts)
    engine = llm.engine
    params = SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=STEPS, ignore_eos=True,
                            num_speculative_tokens=K)
    counts: dict[tuple[int, ...], int] = {}
    for out in llm.generate([PROMPT] * num, params):
        key = tuple(out.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    assert engine.stats().spec_num_drafts >= num  # every request went through a verify step
    frontier = [((), 1.0)]
    for _ in range(STEPS):
        frontier = [(h + (t,), p * q) for h, p in frontier for t, q in table[h].items()]
    expected = {h: p * num for h, p in frontier}
    assert set(counts) <= set(expected), "a token outside the top-k was emitted"
    small = [h for h, e in expected.items() if e < 5]  # merge rare outcomes into one cell
    obs = [counts.get(h, 0) for h in expected if h not in small] + [sum(counts.get(h, 0) for h in small)]
    exp = [e for h, e in expected.items() if h not in small] + [sum(expected[h] for h in small)]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = [e * sum(obs) / sum(exp) for e in exp]  # float rounding: scipy wants equal sums
    return float(chisquare(obs, exp).pvalue)


@pytest.fixture(scope="module")
def table(model):
    return _target_table(model)


def test_sampled_speculation_keeps_the_target_distribution(model, table):
    assert _chi_square_p(model, table) > 1e-3


def test_the_chi_square_test_catches_a_biased_acceptance(model, table, monkeypatch):
    """The same test fails for a sampler that accepts every draft the target allows at all."""
    def accept_all(drafts, probs, generator):
        out = []
        for i, d in enumerate(drafts):
            if float(probs[i][d]) == 0:
                return out + [sd._draw(probs[i], generator)]
            out.append(d)
        return out + [sd._draw(probs[len(drafts)], generator)]

    monkeypatch.setattr(sd, "_accept_sampled", accept_all)
    assert _chi_square_p(model, table) < 1e-3


def test_seeded_speculative_sampling_is_reproducible(model):
    prompts = _repetitive_prompts(3, seed=9)
    params = SamplingParams(temperature=0.8, max_tokens=20, seed=7, ignore_eos=True, num_speculative_tokens=4)
    a = _outputs(LLM(model, None, _engine_config()), prompts, params)
    b = _outputs(LLM(model, None, _engine_config(seed=99)), prompts, params)
    assert a == b
