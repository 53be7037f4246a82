"""Speculative verify steps through CUDA graphs (skipped without CUDA).

Random weights in SmolLM2-135M's shape (30 layers, hidden 576, 9 heads / 3 KV heads of 64, vocab 49152).
"""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.llm import LLM
from engine.model import LlamaForCausalLM
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq
from tests.engine.engine_helpers import make_seq, prefilled, random_prompts, rows_in_order, verify_step

pytestmark = pytest.mark.gpu

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                      tie_word_embeddings=True, max_position_embeddings=2048)
BLOCKS_PER_SEQ = 16  # 256 tokens of context per test sequence


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    import gc

    gc.collect()
    torch.cuda.empty_cache()


def random_model(seed: int = 0) -> LlamaForCausalLM:
    """N(0, 0.02) weights, norms 1, built on the GPU (the runner casts to its dtype)."""
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(SMOLLM2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    return model


@pytest.fixture(scope="module")
def runner():
    cfg = EngineConfig(device="cuda", num_kv_blocks=8 * BLOCKS_PER_SEQ + 1, max_model_len=BLOCKS_PER_SEQ * 16,
                       max_num_seqs=8, cuda_graph_max_batch=8, cuda_graph_spec_tokens=(3, 7),
                       speculative_disable_by_batch_size=8)
    r = ModelRunner(random_model(), cfg, cfg.max_model_len)
    r.init_kv_cache()
    return r


def verify(runner: ModelRunner, seqs, drafts: list[list[int]], eager: bool) -> torch.Tensor:
    logits = rows_in_order(*runner.execute(verify_step(seqs, drafts), eager=eager), seqs)
    assert logits.shape == (sum(1 + len(d) for d in drafts), SMOLLM2.vocab_size)
    return logits.clone()


def test_verify_graphs_are_captured_for_the_configured_shapes(runner):
    assert {key for key in runner._graphs if key[1]} == {(b, k) for k in (3, 7) for b in (1, 2, 4, 8)}
    step = lambda n, d: [ScheduledSeq(make_seq([1, 2, 3]), 2, 1, [5] * d) for _ in range(n)]  # noqa: E731
    assert runner._graph_for(step(3, 2)) == (4, 3)
    assert runner._graph_for(step(1, 5)) == (1, 7)
    assert runner._graph_for(step(2, 0)) == (2, 0)   # no drafts: the decode graph
    assert runner._graph_for(step(9, 1)) is None     # more sequences than the largest verify bucket: eager
    assert runner._graph_for(step(1, 8)) is None     # more drafts than any captured k: eager


@torch.inference_mode()
def test_verify_graph_bit_exact_on_the_captured_shape(runner):
    """4 sequences x 3 drafts: the graph runs the eager step's shapes (same kernels, same GEMM sizes)."""
    seqs = prefilled(runner, [40, 97, 130, 200], SMOLLM2.vocab_size, BLOCKS_PER_SEQ, seed=1)
    drafts = [[7, 8, 9], [1, 2, 3], [4, 4, 4], [100, 2000, 30000]]
    eager = verify(runner, seqs, drafts, eager=True)
    graph = verify(runner, seqs, drafts, eager=False)
    assert not eager.isnan().any()
    assert torch.equal(graph, eager)


@torch.inference_mode()
def fp32_logits(runner: ModelRunner, seqs, drafts: list[list[int]]) -> torch.Tensor:
    """Every verify row's logits from the reference forward in fp32 on the runner's weights (dense cache)."""
    import copy

    from engine.model import DenseKVCache

    model = copy.deepcopy(runner.model.base).float()
    rows = []
    for s, d in zip(seqs, drafts, strict=True):
        ids = torch.tensor(s.token_ids + d, device="cuda")
        h = model(ids, torch.arange(len(ids), device="cuda"), DenseKVCache(SMOLLM2, len(ids), device="cuda"))
        rows.append(model.logits(h[-1 - len(d):]))
    return torch.cat(rows)


@torch.inference_mode()
@pytest.mark.parametrize("lengths, drafts", [
    ([50], [[3, 3]]),                                             # bucket (1, 3), one padding row
    ([33, 150, 64], [[5, 6, 7], [9], []]),                        # mixed: a plain decode pads 3 rows
    ([20, 70, 120, 170, 230], [[1] * 7, [2] * 4, [], [3], [4] * 6]),  # bucket (8, 7): 3 padding sequences
])
def test_padded_verify_graph_as_accurate_as_eager(runner, lengths, drafts):
    """Padding changes the GEMM row counts (cuBLAS may pick other kernels), and a plain decode in a verify
    graph goes through the varlen attention kernel where the eager step runs the split-K decode kernel: bf16
    rounding differs, so the rows need not be bit-exact (on an H200 the drafted rows were, and a plain
    decode row was 1.2e-2 away, run 1 of session 11). Against fp32 logits of the same weights the graph is
    as accurate as the eager step: no row further off than twice the eager step's worst row."""
    seqs = prefilled(runner, lengths, SMOLLM2.vocab_size, BLOCKS_PER_SEQ, seed=len(lengths))
    eager = verify(runner, seqs, drafts, eager=True)
    graph = verify(runner, seqs, drafts, eager=False)
    want = fp32_logits(runner, seqs, drafts)
    rel = lambda x: (x - want).norm(dim=-1) / want.norm(dim=-1)  # noqa: E731
    assert float(rel(graph).max()) <= 2 * float(rel(eager).max()), (rel(graph), rel(eager))
    assert float(rel(eager).max()) < 0.1  # and the bf16 step itself is near fp32


def test_greedy_speculative_equals_plain_greedy_with_verify_graphs():
    """fp32 on the GPU (bf16 rounding differs between a 1-row decode and a (1 + k)-row verify, which can flip
    near-tied argmaxes of random weights): n-gram speculation with verify graphs, 8 sequences at once, every
    other one not speculating and lengths staggered (mixed batches, shrinking buckets), gives the plain
    engine's greedy tokens; a mixed batch replayed a verify graph."""
    base = random_prompts([24, 40, 17, 33, 29, 50, 21, 36], SMOLLM2.vocab_size, seed=3)
    prompts = [p + p[:12] + p for p in base]  # quoted text: the n-gram proposer finds matches
    # odd requests do not speculate (and end early)
    params = [SamplingParams(temperature=0, max_tokens=10 if i % 2 else 24 + 6 * i, ignore_eos=True,
                             num_speculative_tokens=0 if i % 2 else None) for i in range(len(prompts))]
    outs = {}
    for k in (0, 4):
        cfg = EngineConfig(device="cuda", dtype="float32", num_kv_blocks=512, max_model_len=512, max_num_seqs=8,
                           cuda_graph_max_batch=8, num_speculative_tokens=k, speculative_disable_by_batch_size=8)
        llm = LLM(random_model(seed=5), engine_config=cfg)
        runner, replays = llm.engine.runner, []

        def counting(scheduled, b, kk, orig=runner._run_graph, replays=replays):
            with_drafts = sum(bool(s.draft_token_ids) for s in scheduled)
            replays.append((kk, with_drafts < len(scheduled)))
            return orig(scheduled, b, kk)

        runner._run_graph = counting
        outs[k] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if k:
            assert (8, 4) in runner._graphs
            assert llm.engine.spec.num_draft_tokens > 0
            assert (4, True) in replays, replays  # a verify graph ran a batch with plain decodes in it
        del llm, runner, counting
    assert outs[4] == outs[0]
