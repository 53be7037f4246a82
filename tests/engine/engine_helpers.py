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
