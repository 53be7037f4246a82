"""The CUDA graphs' static-batch layouts, run eagerly on the CPU through the kernels' torch references.

A graph replays a fixed (bucket, k) step: decode batches of one row per sequence, verify batches of k + 1
rows per sequence with padding rows and padding sequences. Capturing needs CUDA, but the layout itself (ids,
positions, slots, widened block tables, constant cu_seqlens, the sampled rows) is plain tensors: here it is
filled by the runner's own staging code and run through the same forward on the CPU, and must give the
eager step's logits (tests/engine/test_spec_decode_gpu.py replays the captured graphs on a GPU).
"""

from __future__ import annotations

import pytest
import torch

from engine.engine_config import EngineConfig
from engine.model_runner import LaunchedStep, ModelRunner
from engine.scheduler import ScheduledSeq
from engine.sequence import PLACEHOLDER
from tests.engine.engine_helpers import prefilled, rows_in_order, tiny_model, verify_step

BLOCKS_PER_SEQ = 8


@pytest.fixture
def runner():
    cfg = EngineConfig(device="cpu", num_kv_blocks=4 * BLOCKS_PER_SEQ + 1, max_model_len=BLOCKS_PER_SEQ * 16,
                       max_num_seqs=4, cuda_graph_spec_tokens=(3, 5), speculative_disable_by_batch_size=4)
    r = ModelRunner(tiny_model("qwen2-bias-tied"), cfg, cfg.max_model_len)
    r.init_kv_cache()
    assert r._static_inputs(4, 4) == (3, 5)
    return r


@torch.inference_mode()
def static_logits(runner: ModelRunner, step, b: int, k: int) -> torch.Tensor:
    """The step staged into the (b, k) graph's buffers and run eagerly over them."""
    rows = runner._stage(step.scheduled, b, k)
    ids, pos, backend = runner._static_step(b, k)
    assert ids.shape == (b * (k + 1),)
    return runner.model.logits(runner.model(ids, pos, backend))[rows]


@pytest.mark.parametrize("lengths, drafts, key", [
    ([30, 50, 70, 90], [[4, 5, 6]] * 4, (4, 3)),             # full: no padding
    ([30], [[8, 9]], (1, 3)),                                # a padding row after the drafts
    ([21, 64, 100], [[5, 6, 7, 8, 9], [9], []], (4, 5)),     # mixed: a plain decode, a padding sequence
    ([17, 45, 122], [[], [], []], (4, 0)),                   # a decode batch
])
def test_static_layout_gives_the_eager_logits(runner, lengths, drafts, key):
    seqs = prefilled(runner, lengths, 97, BLOCKS_PER_SEQ, seed=len(lengths))
    step = verify_step(seqs, drafts)
    assert runner._graph_for(step.scheduled) is None  # nothing captured on the CPU: the step runs eagerly
    want = rows_in_order(*runner.execute(step), seqs)
    got = static_logits(runner, step, *key)
    assert got.shape == want.shape == (sum(1 + len(d) for d in drafts), 97)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_padding_sequences_store_nothing(runner):
    """Padding rows and sequences have slot -1: the pool holds only the real rows' K/V after a staged step."""
    seqs = prefilled(runner, [40], 97, BLOCKS_PER_SEQ)
    before = [t.clone() for t in runner.kv.k]
    step = verify_step(seqs, [[1, 2]])
    static_logits(runner, step, 4, 5)
    bs = runner.block_size
    written = {seqs[0].block_table[p // bs] * bs + p % bs for p in range(39, 42)}  # last token + 2 drafts
    for old, new in zip(before, runner.kv.k, strict=True):
        changed = (old != new).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
        assert set(changed) == written


def test_verify_graph_draft_counts_from_the_config():
    assert EngineConfig(device="cpu").verify_graph_tokens() == ()                 # k = 0: only requests that ask
    assert EngineConfig(device="cpu", num_speculative_tokens=5).verify_graph_tokens() == (5,)
    assert EngineConfig(device="cpu", cuda_graph_spec_tokens=[7, 3, 3]).verify_graph_tokens() == (3, 7)
    assert EngineConfig(device="cpu", num_speculative_tokens=5, cuda_graph_spec_tokens=()).verify_graph_tokens() == ()
    assert EngineConfig(device="cpu", speculative_method=None, cuda_graph_spec_tokens=(3,)).verify_graph_tokens() == ()
    for bad in [(0,), (17,), (2.5,)]:
        with pytest.raises(ValueError, match="cuda_graph_spec_tokens"):
            EngineConfig(device="cpu", cuda_graph_spec_tokens=bad)


@torch.inference_mode()
def test_placeholder_inputs_are_gathered_from_the_previous_launch(runner):
    """The overlapped loop's decode inputs: sequences whose last token is a placeholder read it from the tokens
    the previous launch sampled on the device, in the graph staging (one gather over dev64) and in the eager
    batch; both give the logits of the same step with the real tokens."""
    seqs = prefilled(runner, [17, 45, 122], 97, BLOCKS_PER_SEQ, seed=9)
    step = verify_step(seqs, [[], [], []])
    want = rows_in_order(*runner.execute(step), seqs)
    runner._alloc_sampled()                     # the sampled row inside the graphs' buffers (as on CUDA)
    real = [s.token_ids[-1] for s in seqs]
    prev = LaunchedStep([ScheduledSeq(seqs[2], 0, 1), ScheduledSeq(seqs[0], 0, 1)], torch.zeros(2), None)
    runner._sampled[:2] = torch.tensor([real[2], real[0]])  # rows of the previous launch: seq 2, then seq 0
    for s in (seqs[0], seqs[2]):
        s.token_ids[-1] = PLACEHOLDER
    rows = runner._stage(step.scheduled, 4, 0, prev)
    ids, pos, backend = runner._static_step(4, 0)
    assert ids[:3].tolist() == real and ids[3].item() >= 0  # a padding row reads a valid id
    got = runner.model.logits(runner.model(ids, pos, backend))[rows]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert runner.prepare(step, prev).input_ids.tolist() == real
