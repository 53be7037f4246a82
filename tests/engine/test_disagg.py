"""Prefill/decode disaggregation: two engine processes, KV moved block by block through shared memory."""

from __future__ import annotations

import torch

from engine.block_manager import BlockManager
from engine.disagg import Router, prompt_block_hashes
from engine.engine_config import EngineConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import make_seq, random_prompts, tiny_model

ENGINE = dict(block_size=4, num_kv_blocks=96, max_num_batched_tokens=32, max_model_len=96, threads=1)


def test_prompt_hashes_are_the_block_managers():
    prompt = random_prompts([23], seed=3)[0]
    seq = make_seq(prompt, salt="tenant-a")
    assert prompt_block_hashes(prompt, 4, "tenant-a") == BlockManager(8, 4).update_hashes(seq)
    assert prompt_block_hashes(prompt, 4, "tenant-b") != prompt_block_hashes(prompt, 4, "tenant-a")


def test_adopted_blocks_are_prefix_hits():
    bm = BlockManager(8, 4)
    prompt = random_prompts([9], seed=1)[0]
    hashes = prompt_block_hashes(prompt, 4, None)
    adopted = [bm.adopt_cached(h) for h in hashes]
    assert all(write for _, write in adopted) and bm.num_free_blocks == 8  # cached, not held
    assert bm.adopt_cached(hashes[0]) == (adopted[0][0], False)            # already there: no copy
    assert bm.match_prefix(make_seq(prompt)) == [b for b, _ in adopted]


def context_sensitive_tiny():
    """A tiny random model whose next token depends on the context: sharper scores, louder values
    (at random init the residual stream drowns the attention and a dropped K/V hardly shows)."""
    model = tiny_model("llama-gqa")
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
            layer.self_attn.v_proj.weight.mul_(6)
    return model


def test_disaggregated_greedy_output_equals_colocated():
    model = context_sensitive_tiny()
    prompts = random_prompts([5, 19, 33, 2, 26], seed=11)
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=0)
    work = [(0.0, f"r{i}", p, params) for i, p in enumerate(prompts)]
    config = EngineConfig(device="cpu", **{k: v for k, v in ENGINE.items() if k != "threads"})
    want = LLM(context_sensitive_tiny(), engine_config=config).generate(prompts, params, cache_salt="t")
    with Router(model, ENGINE) as split:
        got = split.run(work, salt="t")
        hits = split.prefix_hits()
    for i, p in enumerate(prompts):
        g = got[f"r{i}"]
        assert g.token_ids == want[i].outputs[0].token_ids and len(g.token_ids) == 9
        # the tokens of a tiny random model hardly depend on the context: its logprobs do
        for t, lp, ref in zip(g.token_ids, g.logprobs, want[i].outputs[0].logprobs, strict=True):
            assert abs(lp[t] - ref[t]) < 1e-4, (abs(lp[t] - ref[t]))
        assert g.kv_blocks == len(p) // 4
    # the decode instance found every transferred block: it computed only the partial tails
    assert hits["decode"][0] == sum(len(p) // 4 * 4 for p in prompts)

