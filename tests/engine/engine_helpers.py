"""Helpers shared by the engine tests: tiny models, sequences, random prompts."""

from __future__ import annotations

import torch

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Request, Sequence
from tests.engine.hf_tiny import hf_tiny, ours_from_hf


def tiny_model(variant: str = "llama-gqa", seed: int = 0):
    """Our model on random tiny weights (fp32, CPU)."""
    return ours_from_hf(hf_tiny(variant, seed))


def random_prompts(lengths: list[int], vocab: int = 97, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def make_seq(tokens: list[int], seq_id: int = 0, salt: str | None = None, priority: int = 0,
             arrival: float = 0.0, params: SamplingParams | None = None) -> Sequence:
    """A bare sequence (no engine) for block-manager and scheduler tests."""
    req = Request(f"r{seq_id}", tokens, params or SamplingParams(), arrival, salt, priority)
    seq = Sequence(seq_id, req, 0, tokens, None)
    req.seqs.append(seq)
    return seq


def run_to_computed(bm: BlockManager, seq: Sequence) -> None:
    """Pretend a forward computed the whole sequence: admit, mark computed, register full blocks."""
    hits = bm.match_prefix(seq)
    assert bm.admit(seq, hits, seq.num_tokens - len(hits) * bm.block_size)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def prefilled(runner, lengths: list[int], vocab: int, blocks_per_seq: int, seed: int = 0) -> list[Sequence]:
    """Sequences of random prompts of the given lengths, each with ``blocks_per_seq`` blocks of its own and the
    K/V of all but its last token computed by ``runner`` (one eager step): ready for a decode or verify."""
    from engine.scheduler import ScheduledSeq, SchedulerOutput

    seqs = []
    for i, ids in enumerate(random_prompts(lengths, vocab, seed)):
        seq = make_seq(ids, seq_id=i)
        seq.block_table = list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))
        seqs.append(seq)
    runner.execute(SchedulerOutput([ScheduledSeq(s, 0, s.num_tokens - 1) for s in seqs], [], []))
    return seqs


def verify_step(seqs: list[Sequence], drafts: list[list[int]]):
    """A step that scores every sequence's last token and its drafts (no drafts: a plain decode)."""
    from engine.scheduler import ScheduledSeq, SchedulerOutput

    return SchedulerOutput([ScheduledSeq(s, s.num_tokens - 1, 1, d) for s, d in zip(seqs, drafts, strict=True)],
                           [], [])


def rows_in_order(logits, sampling, seqs: list[Sequence]):
    """A step's logits rows regrouped in ``seqs`` order (the eager runner puts plain decodes first)."""
    import torch

    parts, row = {}, 0
    for s in sampling:
        parts[s.seq.seq_id] = logits[row:row + s.num_logits_rows]
        row += s.num_logits_rows
    assert row == logits.shape[0] and sorted(parts) == sorted(s.seq_id for s in seqs)
    return torch.cat([parts[s.seq_id] for s in seqs])
