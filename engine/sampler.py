"""Batched token sampling with per-row parameters.

One call handles a batch in which every row may have its own temperature, top-k, top-p, min-p,
penalties, logits processors, seed and logprobs request. Order of operations (vLLM's): logits processors
(:mod:`engine.logits_process`) -> penalties -> greedy rows take the argmax -> temperature -> top-k ->
top-p -> min-p -> sample. Sampling uses the
exponential race ``argmax(p / E)`` with ``E ~ Exp(1)`` drawn from the row's own generator when the
request has a seed, so a seeded request samples the same tokens whatever else shares its batch.
Logprobs are those of the model's distribution after the logits processors (before penalties and
temperature).

A sequence may own several rows of one call (a speculative verify step scores several positions of it);
each row carries the token history it is sampled after.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.logits_process import apply_logits_processors
from engine.sampling_params import SamplingParams


@dataclasses.dataclass
class SamplingRow:
    """One row's parameters and the token history penalties look at."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None

    @property
    def processors(self) -> list:
        """The request's logits processors."""
        return self.params.logits_processors


@dataclasses.dataclass
class SamplerOutput:
    """Sampled ids [B] and, per row, ``{token: logprob}`` (sampled + top-n) or None."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


class Sampler:
    """Stateless apart from the generator used by rows without a seed."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits [B, V] (any float dtype) -> one token per row."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        raw, x = self.processed(logits, rows)
        tokens = x.argmax(-1)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            idx = torch.tensor(sampled, device=x.device)
            tokens[idx] = self._sample(x[idx], [rows[i] for i in sampled])
        token_list = tokens.tolist()
        return SamplerOutput(token_list, compute_logprobs(raw, rows, token_list))

    @staticmethod
    def processed(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """(raw, x): fp32 logits [B, V] after the logits processors (what logprobs report), and x after
        the penalties too (greedy rows take its argmax; :meth:`target_probs` turns it into p)."""
        raw = logits.float()
        if any(r.params.logits_processors for r in rows):
            raw = apply_logits_processors(raw.clone() if raw is logits else raw, rows)
        x = apply_penalties(raw, rows) if any(r.params.has_penalties for r in rows) else raw
        return raw, x

    def _sample(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """x [S, V] -> sampled ids [S] for non-greedy rows."""
        probs = self.target_probs(x, rows)
        return probs.div_(self._exponentials(probs, rows)).argmax(-1)

    @staticmethod
    def target_probs(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The distribution non-greedy rows sample from (temperature, top-k, top-p, min-p; not
        renormalised after min-p: the exponential race does not need it): x [S, V] -> p [S, V]."""
        dev = x.device
        temp = torch.tensor([r.params.temperature for r in rows], device=dev, dtype=x.dtype)
        x = x / temp[:, None]
        x = apply_top_k_top_p(x, rows)
        probs = x.softmax(-1)
        min_p = torch.tensor([r.params.min_p for r in rows], device=dev, dtype=probs.dtype)
        if bool((min_p > 0).any()):
            cut = probs.max(-1, keepdim=True).values * min_p[:, None]
            probs = probs.masked_fill(probs < cut, 0.0)
        return probs

    def _exponentials(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Exp(1) noise [S, V]; seeded rows draw from their own generator."""
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, r in enumerate(rows):
            if r.generator is not None:
                q[i].exponential_(generator=r.generator)
        return q


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition (prompt + output), presence and frequency (output only) penalties; returns a copy."""
    b, v = logits.shape
    dev = logits.device
    out_counts = torch.zeros(b, v, device=dev)
    seen = torch.zeros(b, v, dtype=torch.bool, device=dev)
    for i, r in enumerate(rows):
        if r.output_token_ids:
            ids = torch.tensor(r.output_token_ids, device=dev)
            out_counts[i].index_add_(0, ids, torch.ones(len(ids), device=dev))
        if r.params.repetition_penalty != 1.0 and r.prompt_token_ids:
            seen[i, torch.tensor(r.prompt_token_ids, device=dev)] = True
    seen |= out_counts > 0
    rep = torch.tensor([r.params.repetition_penalty for r in rows], device=dev)[:, None]
    pres = torch.tensor([r.params.presence_penalty for r in rows], device=dev)[:, None]
    freq = torch.tensor([r.params.frequency_penalty for r in rows], device=dev)[:, None]
    x = torch.where(seen & (logits > 0), logits / rep, logits)
    x = torch.where(seen & (logits <= 0), logits * rep, x)
    return x - freq * out_counts - pres * (out_counts > 0).float()


def apply_top_k_top_p(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (x [S, V] already divided by temperature)."""
    v = x.shape[1]
    ks = [r.params.top_k if 0 < r.params.top_k < v else v for r in rows]
    ps = [r.params.top_p for r in rows]
    if all(k == v for k in ks) and all(p >= 1.0 for p in ps):
        return x
    dev = x.device
    sorted_x, order = x.sort(-1, descending=True)
    ranks = torch.arange(v, device=dev)[None, :]
    drop = ranks >= torch.tensor(ks, device=dev)[:, None]
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    probs = sorted_x.softmax(-1)
    mass_before = probs.cumsum(-1) - probs               # mass of strictly more likely tokens
    drop |= mass_before >= torch.tensor(ps, device=dev, dtype=probs.dtype)[:, None]
    drop[:, 0] = False                                   # always keep the most likely token
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)


def compute_logprobs(raw: torch.Tensor, rows: list[SamplingRow],
                     tokens: list[int]) -> list[dict[int, float] | None]:
    """Per row asking for logprobs: ``{sampled: lp, top-1: lp, ..., top-n: lp}``; None for the others."""
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    result: list[dict[int, float] | None] = [None] * len(rows)
    if not want:
        return result
    idx = torch.tensor(want, device=raw.device)
    lp = raw[idx].log_softmax(-1)                        # [W, V]
    n_max = max(rows[i].params.logprobs or 0 for i in want)
    top_v, top_i = lp.topk(n_max, -1) if n_max else (lp[:, :0], lp[:, :0].long())
    chosen = lp[torch.arange(len(want), device=raw.device), torch.tensor([tokens[i] for i in want],
                                                                         device=raw.device)]
    top_v, top_i, chosen = top_v.tolist(), top_i.tolist(), chosen.tolist()
    for j, i in enumerate(want):
        n = rows[i].params.logprobs or 0
        d = {tokens[i]: chosen[j]}
        d.update({tok: val for tok, val in zip(top_i[j][:n], top_v[j][:n], strict=False) if tok not in d})
        result[i] = d
    return result
