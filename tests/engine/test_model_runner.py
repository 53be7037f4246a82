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
from engine.llm import LLM
from engine.model_runner import GREEDY_GRAPH_MAX_BATCH, LaunchedStep, ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq, SchedulerOutput
from engine.sequence import PLACEHOLDER
from tests.engine.engine_helpers import make_seq, prefilled, random_prompts, rows_in_order, tiny_model, verify_step

BLOCKS_PER_SEQ = 8


@pytest.fixture
def runner():
    cfg = EngineConfig(device="cpu", num_kv_blocks=4 * BLOCKS_PER_SEQ + 1, max_model_len=BLOCKS_PER_SEQ * 16,
                       max_num_seqs=4, cuda_graph_spec_tokens=(3, 5), speculative_disable_by_batch_size=4,
                       cuda_graph_mixed_tokens=256)
    r = ModelRunner(tiny_model("qwen2-bias-tied"), cfg, cfg.max_model_len)
    r.init_kv_cache()
    assert r._static_inputs(4, 4) == (3, 5)
    return r


@torch.inference_mode()
def static_logits(runner: ModelRunner, step, b: int, k: int) -> torch.Tensor:
    """The step staged into the (b, k) graph's buffers and run eagerly over them."""
    rows, _ = runner._stage(step.scheduled, b, k)
    ids, pos, backend = runner._static_step(b, k)
    assert ids.shape == (b * (k + 1),)
    return runner._static_forward(ids, pos, backend, b, k)[rows]


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
    the previous launch sampled on the device, in the decode graph (its first op: one gather over dev64) and in
    the eager batch; both give the logits of the same step with the real tokens, and the graph (4 rows, up to
    GREEDY_GRAPH_MAX_BATCH) leaves its sampling rows' greedy tokens where the next launch gathers from."""
    seqs = prefilled(runner, [17, 45, 122], 97, BLOCKS_PER_SEQ, seed=9)
    step = verify_step(seqs, [[], [], []])
    want = rows_in_order(*runner.execute(step), seqs)
    runner._alloc_sampled()                     # the sampled row inside the graphs' buffers (as on CUDA)
    real = [s.token_ids[-1] for s in seqs]
    prev = LaunchedStep([ScheduledSeq(seqs[2], 0, 1), ScheduledSeq(seqs[0], 0, 1)], torch.zeros(2), None)
    runner._sampled[:2] = torch.tensor([real[2], real[0]])  # rows of the previous launch: seq 2, then seq 0
    for s in (seqs[0], seqs[2]):
        s.token_ids[-1] = PLACEHOLDER
    assert runner.prepare(step, prev).input_ids.tolist() == real    # eager: an index_copy_ from _sampled
    rows, _ = runner._stage(step.scheduled, 4, 0, prev)
    ids, pos, backend = runner._static_step(4, 0)
    assert rows == slice(0, 3)
    got = runner._static_forward(ids, pos, backend, 4, 0)[rows]      # what the decode graph runs
    assert ids[:3].tolist() == real and ids[3].item() >= 0  # a padding row reads a valid id
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert runner._sampled[:3].tolist() == got.argmax(-1).tolist()


def mixed_step(runner) -> tuple[SchedulerOutput, list]:
    """Two decodes (sequences 0, 1) and two prompt chunks: sequence 2's last 30 prompt tokens after 40 computed
    ones (it samples), sequence 3's first 32 of 100 (it does not); the chunks' slots never written before."""
    seqs = prefilled(runner, [30, 50], 97, BLOCKS_PER_SEQ, seed=3)
    for i, ids in zip((2, 3), random_prompts([70, 100], 97, seed=4), strict=True):
        seq = make_seq(ids, seq_id=i)
        seq.block_table = list(range(1 + i * BLOCKS_PER_SEQ, 1 + (i + 1) * BLOCKS_PER_SEQ))
        seqs.append(seq)
    runner.execute(SchedulerOutput([ScheduledSeq(seqs[2], 0, 40)], [], []))
    step = SchedulerOutput([ScheduledSeq(seqs[0], 29, 1), ScheduledSeq(seqs[2], 40, 30),
                            ScheduledSeq(seqs[1], 49, 1), ScheduledSeq(seqs[3], 0, 32)], [], [])
    return step, seqs


@torch.inference_mode()
@pytest.mark.parametrize("overlapped", [False, True])
def test_mixed_steps_run_in_a_decode_graph_with_prompt_tokens_as_rows(runner, overlapped):
    """A step mixing prompt chunks into its decodes, staged into a mixed bucket (every prompt token a decode row
    over its sequence up to itself, the sampling rows first, logits of the first max-batch rows only), gives the
    eager step's logits and stores the same K/V in the same slots — the chunk's slots were empty, so a row that
    read a K/V before its step stored it would differ. Overlapped: the decodes' last tokens are placeholders
    gathered from the previous launch."""
    step, seqs = mixed_step(runner)
    before = [(k.clone(), v.clone()) for k, v in zip(runner.kv.k, runner.kv.v, strict=True)]
    want = rows_in_order(*runner.execute(step), seqs[:3])            # eager: varlen prefill path
    eager_kv = [(k.clone(), v.clone()) for k, v in zip(runner.kv.k, runner.kv.v, strict=True)]
    for (k, v), (k0, v0) in zip(zip(runner.kv.k, runner.kv.v, strict=True), before, strict=True):
        k.copy_(k0)
        v.copy_(v0)
    assert runner._mixed_bucket(step.scheduled) == 68                # 2 + 30 + 32 rows, above the 4-row batch
    prev = None
    if overlapped:
        runner._alloc_sampled()
        real = [seqs[0].token_ids[-1], seqs[1].token_ids[-1]]
        prev = LaunchedStep([ScheduledSeq(seqs[1], 0, 1), ScheduledSeq(seqs[0], 0, 1)], torch.zeros(2), None)
        runner._sampled[:2] = torch.tensor(real[::-1])
        for s in seqs[:2]:
            s.token_ids[-1] = PLACEHOLDER
    rows, sampling = runner._stage(step.scheduled, 68, 0, prev)
    assert [s.seq.seq_id for s in sampling] == [0, 1, 2] and rows == slice(0, 3)
    ids, pos, backend = runner._static_step(68, 0)
    logits = runner._static_forward(ids, pos, backend, 68, 0)
    assert logits.shape == (4, 97)                                   # the mixed bucket's first max-batch rows
    if overlapped:
        assert ids[:2].tolist() == real
    torch.testing.assert_close(logits[rows], want, rtol=1e-4, atol=1e-4)
    for (k, v), (ek, ev) in zip(zip(runner.kv.k, runner.kv.v, strict=True), eager_kv, strict=True):
        torch.testing.assert_close(k, ek, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, ev, rtol=1e-5, atol=1e-5)


def test_which_mixed_steps_a_decode_graph_takes(runner):
    """Mixed steps beyond the limits run eagerly: drafts, more prompt tokens than cuda_graph_mixed_tokens, a
    chunk whose rows would read long contexts (per row: its position), more sequences than the largest batch."""
    step, seqs = mixed_step(runner)
    take = runner._mixed_bucket
    assert take(step.scheduled) == 68
    assert take(step.scheduled[:2]) == 68 and take([step.scheduled[1]]) == 68  # 31 and 30 rows: above 4
    assert take([ScheduledSeq(seqs[3], 0, 3)]) == 4                  # 3 rows: a batch bucket
    assert take(step.scheduled + [ScheduledSeq(seqs[3], 32, 8)]) is None  # 5 sequences > max batch 4
    assert take([ScheduledSeq(seqs[2], 40, 1, [5, 6]), step.scheduled[1]]) is None  # drafts
    runner._mixed_tokens = 61
    assert take(step.scheduled) is None                              # 62 prompt tokens
    runner._mixed_tokens = 256
    seqs[3].token_ids += [1] * 4000                                  # a late chunk of a long prompt
    assert take([ScheduledSeq(seqs[3], 3000, 64)]) is None           # 64 rows reading ~3,000 tokens each
    assert take([ScheduledSeq(seqs[3], 200, 64)]) == 68              # ~230 each: under MIXED_MEAN_CONTEXT
    runner._mixed_tokens = 0
    assert take(step.scheduled) is None


def test_mixed_buckets():
    from engine.model_runner import graph_buckets

    assert graph_buckets(4) == [1, 2, 4]
    assert graph_buckets(4, 256) == [1, 2, 4, 68, 132, 196, 260]
    assert graph_buckets(256, 100)[-3:] == [256, 320, 384]  # 256 + 100 rows fit 384
    assert graph_buckets(256, 2048)[35:] == [320, 384, 448, 512, 576, 640, 704, 768, 1024, 1280, 1536, 1792, 2048,
                                             2304]
    assert EngineConfig(device="cpu").cuda_graph_mixed_tokens == 0  # opt-in: slower served on an H100
    with pytest.raises(ValueError, match="cuda_graph_mixed_tokens"):
        EngineConfig(device="cpu", cuda_graph_mixed_tokens=-1)


class _EagerGraph:
    """Stands in for a captured decode graph on the CPU: ``replay`` runs what the graph would have captured
    (:meth:`ModelRunner._static_forward` over the static buffers) and writes its logits where the graph's go."""

    def __init__(self, runner: ModelRunner, b: int) -> None:
        self.runner, self.b = runner, b
        self.args = runner._static_step(b, 0)
        self.args[2].meta.slot_mapping.fill_(-1)   # as the capture's warm-up: nothing stored
        runner._decode_in.lens.fill_(1)
        self.out = runner._static_forward(*self.args, b, 0).clone()
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.out.copy_(self.runner._static_forward(*self.args, self.b, 0))


@torch.inference_mode()
def test_the_overlapped_loop_through_decode_graphs_gives_the_eager_tokens(monkeypatch):
    """The overlapped loop with its decode steps through (stand-in) decode graphs — ids gathered in the graph,
    the greedy tokens of steps up to GREEDY_GRAPH_MAX_BATCH rows taken in the graph and not again by ``launch``
    — generates the greedy tokens of the same engine without graphs."""
    prompts = random_prompts([5, 17, 33], 97, seed=8)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cfg = dict(device="cpu", max_model_len=128, max_num_seqs=4, async_scheduling=True, cpu_fused_decode=False)
    plain = LLM(tiny_model("qwen2-bias-tied", seed=2), engine_config=EngineConfig(**cfg))
    want = [[o.outputs[0].token_ids for o in plain.generate([p], params)] for p in prompts]
    want.append([o.outputs[0].token_ids for o in plain.generate(prompts, params)])
    llm = LLM(tiny_model("qwen2-bias-tied", seed=2), engine_config=EngineConfig(**cfg))
    runner = llm.engine.runner
    runner._static_inputs(4, 4)
    graphs = {b: _EagerGraph(runner, b) for b in runner._decode_buckets}
    runner._graphs = {(b, 0): (g, g.out) for b, g in graphs.items()}
    runner._alloc_sampled()
    argmaxes, launches = [], [0]
    real_argmax, real_launch = torch.argmax, runner.launch
    monkeypatch.setattr(torch, "argmax", lambda *a, **kw: argmaxes.append(a[0].shape) or real_argmax(*a, **kw))

    def launch(*a, **kw):
        launches[0] += 1
        return real_launch(*a, **kw)

    monkeypatch.setattr(runner, "launch", launch)
    got = [[o.outputs[0].token_ids for o in llm.generate([p], params)] for p in prompts]
    got.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert got == want
    replays = sum(g.replays for g in graphs.values())
    assert 0 < replays == runner.graph_steps < launches[0] and max(graphs) <= GREEDY_GRAPH_MAX_BATCH
    # one argmax per graph forward (inside it) and per eager launch (the prefills): none after a graph's
    assert len(argmaxes) == replays + (launches[0] - runner.graph_steps)
