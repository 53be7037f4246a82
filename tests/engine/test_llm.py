"""End to end: the paged, batched, chunked engine against the single-sequence reference."""

from __future__ import annotations

import pytest
import torch

from engine.block_manager import BlockManager
from engine.engine_config import EngineConfig
from engine.errors import InvalidRequestError
from engine.kv_cache import PagedAttention
from engine.llm import LLM
from engine.model import DenseKVCache, greedy_generate
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq, SchedulerOutput
from tests.engine.engine_helpers import make_seq, random_prompts, tiny_model
from tests.engine.hf_tiny import VARIANTS

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LENGTHS = [5, 17, 33, 1, 40, 64, 9]


def cpu_config(**kw) -> EngineConfig:
    base = dict(device="cpu", block_size=4, num_kv_blocks=128, max_num_batched_tokens=32, max_model_len=128)
    return EngineConfig(**{**base, **kw})


CONFIGS = {
    "chunked": {},
    "big-budget-block16": dict(block_size=16, num_kv_blocks=32, max_num_batched_tokens=512),
    "preempting": dict(num_kv_blocks=34),                      # too few blocks: forces recompute
    "no-prefix-cache": dict(enable_prefix_caching=False, max_num_batched_tokens=7),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_batched_paged_chunked_greedy_equals_reference(variant, config):
    model = tiny_model(variant)
    prompts = random_prompts(LENGTHS, seed=1)
    prompts.append(prompts[4][:30] + [1, 2, 3])                # shares a prefix with prompt 4
    refs = [greedy_generate(model, p, GREEDY.max_tokens) for p in prompts]
    llm = LLM(tiny_model(variant), engine_config=cpu_config(**CONFIGS[config]))
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
    if config == "preempting":
        assert llm.engine.scheduler.num_preemptions > 0


def dense_logits(model, ids: list[int]) -> torch.Tensor:
    cache = DenseKVCache(model.config, len(ids))
    return model.logits(model(torch.tensor(ids), torch.arange(len(ids)), cache))


@pytest.mark.parametrize("cpu_decode", [False, True])
@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias-tied"])
@torch.inference_mode()
def test_paged_logits_match_reference(variant, cpu_decode):
    """A mixed step (one decode + two prefill chunks, one behind a prefix hit) vs the dense model."""
    model = tiny_model(variant)
    runner = ModelRunner(model, cpu_config(), max_model_len=128)
    runner.init_kv_cache()
    bm = BlockManager(runner.kv.num_blocks, 4)
    a, b, c = random_prompts([23, 30, 11], seed=2)
    c = a[:16] + c
    seqs = [make_seq(p, seq_id=i) for i, p in enumerate([a, b, c])]
    # step 1: a[:22] and b[:13] as prefill chunks
    for seq, n in zip(seqs[:2], (22, 13), strict=False):
        assert bm.admit(seq, [], n)
    step1 = [ScheduledSeq(seqs[0], 0, 22), ScheduledSeq(seqs[1], 0, 13)]
    rows1 = _forward(runner, step1, cpu_decode)
    for s in step1:
        s.seq.num_computed_tokens += s.num_tokens
        bm.cache_full_blocks(s.seq)
    # step 2: a's last token as a decode, the rest of b, and c behind a 16-token prefix hit on a
    hits = bm.match_prefix(seqs[2])
    assert len(hits) == 4
    assert bm.allocate_slots(seqs[0], 1) and bm.allocate_slots(seqs[1], 17)
    assert bm.admit(seqs[2], hits, len(c) - 16)
    step2 = [ScheduledSeq(seqs[0], 22, 1), ScheduledSeq(seqs[1], 13, 17),
             ScheduledSeq(seqs[2], 16, len(c) - 16)]
    rows2 = _forward(runner, step2, cpu_decode)
    got = {0: torch.cat([rows1[0], rows2[0]]), 1: torch.cat([rows1[1], rows2[1]]), 2: rows2[2]}
    for i, p in enumerate([a, b, c]):
        ref = dense_logits(model, p)[16:] if i == 2 else dense_logits(model, p)
        err = float((got[i] - ref).abs().max() / ref.abs().max())
        assert err < 1e-4, (i, err)


def _forward(runner: ModelRunner, scheduled: list[ScheduledSeq], cpu_decode: bool) -> dict[int, torch.Tensor]:
    """Logits of every row of a step, split per sequence id."""
    inputs = runner.prepare(SchedulerOutput(scheduled, [], []))
    backend = PagedAttention(runner.kv, inputs.meta, 16, cpu_decode=cpu_decode)
    h = runner.model(inputs.input_ids, inputs.positions, backend)
    logits = runner.model.logits(h)
    order = [s for s in scheduled if s.num_tokens == 1] + [s for s in scheduled if s.num_tokens != 1]
    out, row = {}, 0
    for s in order:
        out[s.seq.seq_id] = logits[row:row + s.num_tokens]
        row += s.num_tokens
    return out


def test_prefix_cache_hit_changes_no_output():
    llm = LLM(tiny_model(), engine_config=cpu_config())
    prompt = random_prompts([45], seed=3)[0]
    first = llm.generate([prompt], GREEDY)[0]
    second = llm.generate([prompt], GREEDY)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 44
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_two_salts_with_the_same_prompt_never_share_blocks():
    llm = LLM(tiny_model(), engine_config=cpu_config(max_num_batched_tokens=128))
    prompt = random_prompts([45], seed=3)[0]
    engine = llm.engine
    a = engine.add_request("a", prompt, GREEDY, cache_salt="tenant-a")
    b = engine.add_request("b", prompt, GREEDY, cache_salt="tenant-b")
    engine.step()
    tables = [set(r.seqs[0].block_table) for r in (a, b)]
    assert tables[0] and tables[1] and not tables[0] & tables[1]
    while engine.has_unfinished_requests():
        engine.step()
    again = llm.generate([prompt], GREEDY, cache_salt="tenant-b")[0]
    other = llm.generate([prompt], GREEDY, cache_salt="tenant-c")[0]
    assert again.num_cached_tokens == 44 and other.num_cached_tokens == 0
    assert again.outputs[0].token_ids == other.outputs[0].token_ids


def test_n_completions_share_the_prompt_and_seed_reproduces():
    llm = LLM(tiny_model(), engine_config=cpu_config())
    prompt = random_prompts([22], seed=4)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    out1 = llm.generate([prompt], params)[0]
    assert [c.index for c in out1.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out1.outputs}) > 1
    out2 = llm.generate([prompt, random_prompts([7], seed=5)[0]], [params, GREEDY])[0]
    assert [c.token_ids for c in out2.outputs] == [c.token_ids for c in out1.outputs]
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_stop_token_ids_and_max_tokens():
    model = tiny_model()
    prompt = random_prompts([10], seed=6)[0]
    ref = greedy_generate(model, prompt, 12)
    llm = LLM(tiny_model(), engine_config=cpu_config())
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[ref[4]]))[0]
    first = ref.index(ref[4])
    assert out.outputs[0].token_ids == ref[:first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == ref[4]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == ref[:3] and out.outputs[0].finish_reason == "length"


def test_invalid_requests_are_rejected():
    llm = LLM(tiny_model(), engine_config=cpu_config(max_model_len=32))
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(InvalidRequestError, match="maximum model length"):
        llm.generate([list(range(32))], GREEDY)
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate([[1, 2, 1000]], GREEDY)
    for bad in (dict(top_p=0), dict(temperature=-1), dict(n=0), dict(max_tokens=0), dict(logprobs=99),
                dict(stop=[""]), dict(presence_penalty=3.0), dict(top_k=1.5)):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)


@pytest.mark.model
@pytest.mark.slow
def test_smollm2_batched_greedy_equals_reference_and_stop_strings(default_model_dir):
    from engine.loader import load_model
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(default_model_dir)
    model = load_model(default_model_dir)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
    ids = [tok.encode(p) for p in prompts]
    refs = [greedy_generate(model, p, 16) for p in ids]
    cfg = cpu_config(block_size=16, num_kv_blocks=64, max_num_batched_tokens=16, max_model_len=512)
    llm = LLM(model, tok, cfg)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == refs
    full = outs[0].outputs[0].text
    assert full == tok.decode(refs[0])
    stop = full.strip().split()[1]
    cut = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=16, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full[:full.index(stop)]


def test_gc_freeze_after_start_up_is_the_gpu_default():
    import gc

    assert not EngineConfig(device="cpu").resolved_gc_freeze()
    assert EngineConfig(device="cuda").resolved_gc_freeze()
    assert not EngineConfig(device="cuda", gc_freeze=False).resolved_gc_freeze()
    gc.unfreeze()
    try:
        LLM(tiny_model(), engine_config=cpu_config())
        assert gc.get_freeze_count() == 0
        llm = LLM(tiny_model(), engine_config=cpu_config(gc_freeze=True))
        assert gc.get_freeze_count() > 0
        out = llm.generate([[1, 2, 3]], GREEDY)[0]
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    finally:
        gc.unfreeze()
