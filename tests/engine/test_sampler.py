"""Sampler: greedy, temperature/top-k/top-p/min-p, penalties, seeds, logprobs, mixed rows in one batch."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import Sampler, SamplingRow, apply_penalties, apply_top_k_top_p
from engine.sampling_params import SamplingParams


def row(**kw) -> SamplingRow:
    prompt = kw.pop("prompt", [])
    output = kw.pop("output", [])
    gen = kw.pop("generator", None)
    return SamplingRow(SamplingParams(**kw), prompt, output, gen)


def logits(b=4, v=50, seed=0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    x = logits()
    out = Sampler()(x, [row(temperature=0)] * 4)
    assert out.token_ids == x.argmax(-1).tolist()


def test_top_k_1_and_tiny_top_p_equal_argmax_when_sampling():
    x = logits()
    s = Sampler(torch.Generator().manual_seed(0))
    assert s(x, [row(temperature=1.0, top_k=1)] * 4).token_ids == x.argmax(-1).tolist()
    assert s(x, [row(temperature=1.0, top_p=1e-6)] * 4).token_ids == x.argmax(-1).tolist()
    assert s(x, [row(temperature=1.0, min_p=1.0)] * 4).token_ids == x.argmax(-1).tolist()


def test_top_k_top_p_masks():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = apply_top_k_top_p(x.clone(), [row(top_k=2)]).isfinite()
    assert kept.tolist() == [[True, True, False, False]]
    kept = apply_top_k_top_p(x.clone(), [row(top_p=0.7)]).isfinite()  # 0.5 < 0.7, 0.8 >= 0.7
    assert kept.tolist() == [[True, True, False, False]]
    kept = apply_top_k_top_p(x.clone(), [row(top_p=0.9)]).isfinite()
    assert kept.tolist() == [[True, True, True, False]]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    x = probs.log()[None].repeat(4000, 1)
    out = Sampler(torch.Generator().manual_seed(1))(x, [row(temperature=1.0)] * 4000)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_seed_is_reproducible_whatever_the_batch():
    x = logits(b=3)
    params = dict(temperature=1.0)
    solo = Sampler()(x[1:2], [row(generator=torch.Generator().manual_seed(7), **params)])
    rows = [row(**params), row(generator=torch.Generator().manual_seed(7), **params), row(temperature=0)]
    mixed = Sampler(torch.Generator().manual_seed(123))(x, rows)
    assert mixed.token_ids[1] == solo.token_ids[0]
    assert mixed.token_ids[2] == int(x[2].argmax())


def test_penalties_match_their_definitions():
    x = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    r = row(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25, prompt=[1], output=[2, 2])
    y = apply_penalties(x, [r])
    # token 0: unseen; 1: prompt only (negative -> *2); 2: output twice (positive -> /2, -0.5, -2*0.25)
    assert torch.allclose(y, torch.tensor([[2.0, -2.0, 0.25 - 0.5 - 0.5, 1.0]]))


def test_repetition_penalty_changes_greedy_choice():
    x = torch.tensor([[3.0, 2.9, 0.0]])
    assert Sampler()(x, [row(temperature=0, output=[0], repetition_penalty=1.5)]).token_ids == [1]
    assert Sampler()(x, [row(temperature=0, output=[0])]).token_ids == [0]


def test_logprobs_top_n_and_sampled():
    x = logits(b=2, v=10)
    out = Sampler()(x, [row(temperature=0, logprobs=3), row(temperature=0)])
    lp = x[0].log_softmax(-1)
    top = lp.topk(3)
    assert out.logprobs[1] is None
    got = out.logprobs[0]
    assert list(got)[0] == out.token_ids[0]
    for tok, val in zip(top.indices.tolist(), top.values.tolist(), strict=False):
        assert got[tok] == pytest.approx(val, abs=1e-6)


def test_mixed_parameters_in_one_batch():
    x = logits(b=4)
    rows = [row(temperature=0), row(temperature=0.7, top_k=5), row(temperature=1.2, top_p=0.5),
            row(temperature=1.0, min_p=0.2, logprobs=0)]
    out = Sampler(torch.Generator().manual_seed(0))(x, rows)
    assert out.token_ids[0] == int(x[0].argmax())
    assert out.token_ids[1] in x[1].topk(5).indices.tolist()
    assert out.logprobs[3] is not None and len(out.logprobs[3]) == 1
