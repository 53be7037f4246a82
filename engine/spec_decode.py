"""Speculative decoding: n-gram drafts, one verify forward, rejection sampling, KV rollback.

A step with speculation, in request-path order (docs/engine.md, "Speculative decoding"):

1. the scheduler asks :meth:`SpecDecoder.propose` for the drafts of every decode it schedules: up to ``k``
   tokens that the :class:`NgramProposer` copies from the sequence's own history (prompt lookup: the
   tokens that followed the latest earlier occurrence of its last n tokens). No match, no drafts: the
   sequence decodes as usual, so a sequence costs nothing extra when n-grams do not help;
2. the model runner scores the sequence's last token and its ``k`` drafts as one short prefill against
   the paged cache, writing their K/V, and returns ``1 + k`` logits rows;
3. :meth:`SpecDecoder.verify` runs the rows through the same processors, penalties and truncations as the
   sampler (row ``i`` sees the history extended by the first ``i`` drafts, so a grammar checks every draft
   before it is accepted) and accepts a prefix of the drafts plus one token of the target model:
   greedy rows accept while the draft is the argmax; sampled rows accept draft ``d`` with probability
   ``p(d)`` and otherwise sample from ``p`` with ``d`` removed (Leviathan et al.'s rule for a draft
   distribution that is one-hot at ``d``), so the output keeps the target distribution exactly;
4. the engine appends the tokens (each checked for a finish) and :meth:`SpecDecoder.rollback` counts the
   accepted drafts' K/V as computed and frees the blocks that held only rejected ones.

Randomness: a seeded request draws from its own generator, so it is reproducible; the draws differ from
those of a non-speculative run, so a seeded sample is *distributed* like, not equal to, its
non-speculative twin. Greedy output is the same token for token.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from engine.engine_config import SpecConfig
from engine.errors import InvalidRequestError
from engine.sampler import Sampler, SamplingRow, compute_logprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence


class NgramProposer:
    """Prompt lookup: drafts are the tokens that followed the latest earlier match of the suffix.

    Args:
        min_n: shortest suffix matched.
        max_n: longest suffix matched (tried first: a longer match predicts better).
    """

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``token_ids`` (none when the suffix occurs nowhere before)."""
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        arr = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(arr) - 1), self.min_n - 1, -1):
            # windows start at 0 .. L-1-n: every one has a next token, and none is the suffix itself
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)     # [L - n, n]
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start:start + k].tolist()
        return []


@dataclasses.dataclass
class Verdict:
    """What a verify step gives one sequence: the tokens to append (accepted drafts + one from the target
    model) and their logprobs (None where the request did not ask)."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]

    @property
    def num_accepted(self) -> int:
        """Drafts accepted (the last token is the target model's own)."""
        return len(self.token_ids) - 1


class SpecDecoder:
    """Proposes drafts for the scheduler, verifies them for the engine, keeps the acceptance counters.

    Args:
        config: the deployment's knobs (:meth:`engine.engine_config.EngineConfig.spec_config`).
        max_model_len: the engine's context bound (drafts never reach past it).
        proposer: anything with ``propose(token_ids, k) -> list[int]`` (default: :class:`NgramProposer`).
    """

    def __init__(self, config: SpecConfig, max_model_len: int, proposer=None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.num_drafts = 0            # verify steps (sequence-steps that carried drafts)
        self.num_draft_tokens = 0      # drafts proposed and scored
        self.num_accepted_tokens = 0   # of which accepted

    def num_tokens_for(self, params: SamplingParams) -> int:
        """The request's ``k`` (its own, else the deployment's; 0 when speculation is off)."""
        if self.config.method is None:
            return 0
        k = params.num_speculative_tokens
        return self.config.num_speculative_tokens if k is None else k

    def validate(self, params: SamplingParams) -> None:
        """Refuse a request that asks for speculation on a deployment that has none."""
        if self.config.method is None and params.num_speculative_tokens:
            raise InvalidRequestError("num_speculative_tokens: speculative decoding is off on this deployment")

    def propose(self, seq: Sequence, num_running: int, budget: int) -> list[int]:
        """Drafts for a decode of ``seq`` in a step that started with ``num_running`` sequences and has
        ``budget`` tokens left after the decode itself."""
        cap = self.config.disable_by_batch_size
        if cap is not None and num_running > cap:
            return []
        k = min(self.num_tokens_for(seq.params), budget,
                seq.params.max_tokens - seq.num_output_tokens - 1,  # the target's own token is the last
                self.max_model_len - seq.num_tokens)
        return self.proposer.propose(seq.token_ids, k)[:k] if k > 0 else []

    @torch.inference_mode()
    def verify(self, sampler: Sampler, logits: torch.Tensor, items: list[ScheduledSeq]) -> list[Verdict]:
        """logits [R, V]: ``1 + len(drafts)`` rows per item, in order -> one :class:`Verdict` per item."""
        rows = [row for s in items for row in _rows(s)]
        assert logits.shape[0] == len(rows), (logits.shape, len(rows))
        if all(r.params.greedy and not r.params.needs_history and r.params.logprobs is None for r in rows):
            raw = x = logits.float()
        else:
            raw, x = sampler.processed(logits, rows)
        targets = x.argmax(-1).tolist()
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        probs: dict[int, torch.Tensor] = {}
        if sampled:
            p = _normalised(Sampler.target_probs(x[torch.tensor(sampled, device=x.device)],
                                                 [rows[i] for i in sampled]))
            probs = dict(zip(sampled, p, strict=True))
        verdicts, offset, chosen = [], 0, list(targets)
        for s in items:
            k = len(s.draft_token_ids)
            span = range(offset, offset + k + 1)
            tokens = (_accept_greedy(s.draft_token_ids, targets[offset:offset + k + 1]) if s.seq.params.greedy
                      else _accept_sampled(s.draft_token_ids, [probs[i] for i in span],
                                           s.seq.generator or sampler.generator))
            chosen[offset:offset + len(tokens)] = tokens
            verdicts.append(Verdict(tokens, []))
            self._count(k, len(tokens) - 1)
            offset += k + 1
        lps = compute_logprobs(raw, rows, chosen)
        offset = 0
        for s, v in zip(items, verdicts, strict=True):
            v.logprobs = lps[offset:offset + len(v.token_ids)]
            offset += len(s.draft_token_ids) + 1
        return verdicts

    def rollback(self, block_manager, seq: Sequence, num_accepted: int) -> None:
        """After a verify: the accepted drafts' K/V count as computed; blocks holding only rejected drafts'
        K/V go back to the pool (their slots in the kept blocks are overwritten by the next tokens)."""
        seq.num_computed_tokens += num_accepted
        block_manager.trim(seq)
        block_manager.cache_full_blocks(seq)

    def _count(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any verify)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


def _rows(s: ScheduledSeq) -> list[SamplingRow]:
    """One sampling row per verify position; row ``i`` follows the history plus the first ``i`` drafts."""
    seq, params = s.seq, s.seq.params
    hist = params.needs_history
    out = seq.output_token_ids if hist else []
    return [SamplingRow(params, seq.request.prompt_token_ids, out + s.draft_token_ids[:i] if hist else [],
                        seq.generator) for i in range(len(s.draft_token_ids) + 1)]


def _normalised(probs: torch.Tensor) -> torch.Tensor:
    """Rows summing to 1 (min-p leaves them short)."""
    return probs / probs.sum(-1, keepdim=True)


def _accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """Drafts while each is the argmax, then the argmax where they part (or after the last draft)."""
    j = 0
    while j < len(drafts) and drafts[j] == targets[j]:
        j += 1
    return targets[:j + 1]


def _accept_sampled(drafts: list[int], probs: list[torch.Tensor], generator: torch.Generator | None) -> list[int]:
    """Rejection sampling against a one-hot draft: accept ``d`` with probability ``p(d)``; on rejection
    sample from ``p`` without ``d`` (the residual ``max(p - q, 0)`` renormalised); after the last accepted
    draft sample the bonus token from the next row's ``p``."""
    u = torch.rand(len(drafts), generator=generator, device=probs[0].device).tolist() if drafts else []
    for i, d in enumerate(drafts):
        if u[i] < float(probs[i][d]):
            continue
        residual = probs[i].clone()
        residual[d] = 0.0
        return drafts[:i] + [_draw(residual, generator)]
    return drafts + [_draw(probs[len(drafts)], generator)]


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """A token with probability proportional to ``weights`` [V] (the sampler's exponential race)."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return int((weights / noise).argmax())
