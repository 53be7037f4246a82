"""Tensor parallelism on the CPU (gloo, rank processes): the same logits and tokens as one process.

The real default model has 9 query heads and 3 KV heads: N = 2 does not divide them (a typed error says
so and names N = 3), so the real-model check runs at N = 3 and the N = 2 check runs on tiny random models
with divisible heads (4 / 2), one of them with q/k/v bias, a tied head and a vocabulary (97) that needs
padding across the ranks.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.errors import ParallelConfigError
from engine.executor import ModelOutput, make_executor
from engine.llm_engine import LLMEngine
from engine.parts import EngineParts
from engine.sampling_params import SamplingParams
from engine.tp_linear import check_tensor_parallel, local_config, shard_state, valid_sizes
from tests.engine.engine_helpers import random_prompts, tiny_model

SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64)


class RecordingExecutor:
    """Wraps the engine's executor and keeps every step's logits (to compare two engines step by step)."""

    def __init__(self, model, config, max_len) -> None:
        self.inner = make_executor(model, config, max_len)
        self.device = self.inner.device
        self.logits: list[torch.Tensor] = []

    def init_kv_cache(self) -> int:
        return self.inner.init_kv_cache()

    def execute(self, sched) -> ModelOutput:
        out = self.inner.execute(sched)
        self.logits.append(out.logits.clone())
        return out

    def shutdown(self) -> None:
        self.inner.shutdown()


def run_engine(model, tok, prompts, params, **cfg) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Token ids of every prompt's completion and the logits of every step."""
    config = EngineConfig(device="cpu", num_kv_blocks=64, **cfg)
    engine = LLMEngine(model, tok, config, parts=EngineParts(executor=RecordingExecutor))
    try:
        engine.stream_outputs = False
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        final = {}
        while engine.has_unfinished_requests():
            final.update({o.request_id: o for o in engine.step() if o.finished})
        return [final[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))], engine.executor.logits
    finally:
        engine.shutdown()


def assert_same_run(one, tp, rtol: float) -> None:
    (tokens1, logits1), (tokens_n, logits_n) = one, tp
    assert tokens_n == tokens1
    assert len(logits_n) == len(logits1)
    for a, b in zip(logits1, logits_n, strict=True):
        assert a.shape == b.shape
        assert ((a - b).abs().max() / a.abs().max()).item() < rtol


def test_sizes_that_do_not_divide_the_heads_are_refused_by_name():
    smollm2 = ModelConfig(**SMOLLM2_SHAPE)
    assert valid_sizes(smollm2) == [1, 3]
    with pytest.raises(ParallelConfigError, match=r"9 query heads, 3 KV heads.*\[1, 3\]"):
        check_tensor_parallel(smollm2, 2)
    with pytest.raises(ParallelConfigError, match=">= 1"):
        EngineConfig(device="cpu", tensor_parallel_size=0)
    with pytest.raises(ParallelConfigError, match="weight_format"):
        EngineConfig(device="cpu", tensor_parallel_size=3, weight_format="int8")
    with pytest.raises(ParallelConfigError, match="does not divide"):  # before any process starts
        make_executor(tiny_model(), EngineConfig(device="cpu", tensor_parallel_size=3), 64)


def test_shards_cover_the_weights_once():
    model = tiny_model("qwen2-bias-tied")
    cfg, state = model.config, dict(model.state_dict())
    shards = [shard_state(state, cfg, r, 2) for r in range(2)]
    local = local_config(cfg, 2)
    assert (local.num_attention_heads, local.num_key_value_heads, local.vocab_size) == (2, 1, 49)
    q = "model.layers.0.self_attn.q_proj"
    assert torch.equal(torch.cat([s[f"{q}.weight"] for s in shards]), state[f"{q}.weight"])
    assert torch.equal(torch.cat([s[f"{q}.bias"] for s in shards]), state[f"{q}.bias"])
    o = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([s[o] for s in shards], dim=1), state[o])
    emb = torch.cat([s["model.embed_tokens.weight"] for s in shards])  # [98, hidden]: one padding row
    assert torch.equal(emb[:97], state["model.embed_tokens.weight"]) and not emb[97].any()
    norm = "model.norm.weight"
    assert all(torch.equal(s[norm], state[norm]) for s in shards)


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias-tied"])
def test_two_ranks_match_one_process_on_tiny_models(variant):
    prompts = random_prompts([5, 19, 33, 2], seed=7)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cfg = dict(block_size=4, max_num_batched_tokens=32, max_model_len=64)  # chunked prefill mixed with decodes
    one = run_engine(tiny_model(variant), None, prompts, params, **cfg)
    two = run_engine(tiny_model(variant), None, prompts, params, tensor_parallel_size=2, **cfg)
    assert_same_run(one, two, rtol=1e-5)


PROMPTS = ["What is the capital of France?", "Why is the sky blue?", "Give me a tip for learning to code."]


def test_three_ranks_match_one_process_on_smollm2(default_model_dir):
    from engine.loader import load_model
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(default_model_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=10)
    model = load_model(default_model_dir)  # one load: the shards are copies, taken before the run below
    three = run_engine(model, tok, prompts, params, tensor_parallel_size=3)
    one = run_engine(model, tok, prompts, params)
    assert_same_run(one, three, rtol=1e-4)
    assert any(len(t) == 10 for t in one[0])  # real continuations, not an immediate stop


def _tp_in_a_daemon(out) -> None:
    prompts = random_prompts([6, 11], seed=2)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out.put(run_engine(tiny_model(), None, prompts, params, tensor_parallel_size=2, block_size=4)[0])


def test_ranks_start_from_a_daemon_process():
    """The engine core runs in a daemonic process (``engine_process``); its ranks must still start."""
    mp = torch.multiprocessing.get_context("spawn")
    out = mp.Queue()
    proc = mp.Process(target=_tp_in_a_daemon, args=(out,), daemon=True)
    proc.start()
    prompts = random_prompts([6, 11], seed=2)
    want = run_engine(tiny_model(), None, prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                      block_size=4)[0]
    proc.join(timeout=120)  # a rank that cannot start fails the child at once, not after the timeout
    assert proc.exitcode == 0 and out.get(timeout=5) == want
