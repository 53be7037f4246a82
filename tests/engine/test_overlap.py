"""The overlapped loop (``EngineConfig.async_scheduling``) gives the synchronous loop's tokens.

On the CPU the same code paths run as on CUDA except the graph replay (the graph's staging with a device
gather is checked in tests/engine/test_model_runner.py): placeholders counted by the scheduler, tokens
gathered from the previous launch, read back one step late, finishes found one step late (stop tokens,
EOS, max_tokens, max_model_len), preemption while a token is in flight, aborts, prefix caching, and steps
that must run synchronously (sampling, logprobs, n > 1) between overlapped ones.
"""

from __future__ import annotations

import pytest

from engine.engine_config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.sequence import PLACEHOLDER
from tests.engine.engine_helpers import random_prompts, tiny_model

LENGTHS = [5, 17, 33, 1, 40, 64, 9, 23]


def cpu_config(**kw) -> EngineConfig:
    base = dict(device="cpu", block_size=4, num_kv_blocks=128, max_num_batched_tokens=32, max_model_len=128,
                max_num_seqs=4)
    return EngineConfig(**{**base, **kw})


def counting_launches(llm: LLM) -> list[int]:
    """Count the executor's launches (overlapped steps) of ``llm``."""
    count, launch = [0], llm.engine.executor.launch

    def counted(sched, prev):
        count[0] += 1
        return launch(sched, prev)

    llm.engine.executor.launch = counted
    return count


def run(overlap: bool, prompts, params, variant: str = "llama-gqa", **kw):
    llm = LLM(tiny_model(variant), engine_config=cpu_config(async_scheduling=overlap, **kw))
    assert llm.engine.overlap is overlap
    launches = counting_launches(llm) if overlap else [0]
    outs = llm.generate(prompts, params)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks  # every block back
    got = [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]
    return got, llm, launches[0]


def stop_params(prompts, variant: str) -> list[SamplingParams]:
    """Per prompt: greedy with a mix of limits; every other one stops at a token the sync run emits mid-way."""
    free, _, _ = run(False, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), variant)
    params = []
    for i, out in enumerate(free):
        tokens = out[0][0]
        stop = [tokens[3 + i % 5]] if i % 2 else []
        limit = (1, 2, 24, 7, 13, 24, 3, 20, 11)[i % 9]
        params.append(SamplingParams(temperature=0, max_tokens=limit, stop_token_ids=stop, ignore_eos=i % 3 != 0))
    return params


CONFIGS = {
    "chunked": {},
    "preempting": dict(num_kv_blocks=30, max_num_seqs=8),            # too few blocks: recompute mid-flight
    "no-prefix-cache": dict(enable_prefix_caching=False, max_num_batched_tokens=7),
    "fcfs": dict(scheduling_policy="fcfs"),
    "short-model-len": dict(max_model_len=48),                        # finishes by length at the model's end
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias-tied"])
def test_overlapped_loop_gives_the_sync_tokens(variant, config):
    prompts = random_prompts([n for n in LENGTHS if n < 40] if config == "short-model-len" else LENGTHS, seed=3)
    prompts.append(prompts[2][:28] + [1, 2, 3])                      # shares full blocks with prompt 2
    params = stop_params(prompts, variant)
    want, sync_llm, _ = run(False, prompts, params, variant, **CONFIGS[config])
    got, llm, launches = run(True, prompts, params, variant, **CONFIGS[config])
    assert got == want
    assert launches > 10                                              # the overlapped path ran
    assert any(o[0][1] == "stop" for o in got) and any(o[0][1] == "length" for o in got)
    if config == "preempting":
        assert llm.engine.scheduler.num_preemptions > 0
    if config != "no-prefix-cache":  # the same blocks were registered: no placeholder hashed
        assert llm.engine.block_manager._cached.keys() == sync_llm.engine.block_manager._cached.keys()


def test_sync_steps_between_overlapped_ones_keep_every_request_exact():
    """Sampled (seeded), logprobs and n = 2 requests force synchronous steps among overlapped greedy ones."""
    prompts = random_prompts(LENGTHS, seed=4)
    params = [SamplingParams(temperature=0, max_tokens=15, ignore_eos=True) for _ in prompts]
    params[1] = SamplingParams(temperature=0.8, seed=11, max_tokens=6, ignore_eos=True)
    params[4] = SamplingParams(temperature=0, max_tokens=9, logprobs=2, ignore_eos=True)
    params[6] = SamplingParams(temperature=0, n=2, max_tokens=5, ignore_eos=True)
    want, _, _ = run(False, prompts, params)
    got, _, launches = run(True, prompts, params)
    assert got == want and launches > 5


def _overlapped_engine(prompts, params) -> LLMEngine:
    """An overlapped-loop engine on the tiny model with ``prompts`` added as requests "0", "1", ..."""
    engine = LLMEngine(tiny_model(), None, cpu_config(async_scheduling=True))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    return engine


def test_streamed_outputs_never_show_a_placeholder():
    """Streaming deltas of the overlapped loop add up to the sync tokens, with no placeholder in any delta."""
    prompts = random_prompts([6, 30, 12], seed=5)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want, _, _ = run(False, prompts, params)
    engine = _overlapped_engine(prompts, params)
    streamed: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            delta = out.outputs[0].delta_token_ids
            assert PLACEHOLDER not in delta and PLACEHOLDER not in out.outputs[0].token_ids
            streamed[out.request_id] += delta
    assert [streamed[str(i)] for i in range(len(prompts))] == [w[0][0] for w in want]


def test_abort_while_a_token_is_in_flight():
    prompts = random_prompts([8, 8, 8], seed=6)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want, _, _ = run(False, prompts, params)
    engine = _overlapped_engine(prompts, params)
    for _ in range(5):
        engine.step()
    seq = engine.requests["1"].seqs[0]
    assert seq.num_pending == 1                                   # launched, not read back
    out = engine.abort_request("1")
    assert out.outputs[0].finish_reason == "abort" and PLACEHOLDER not in out.outputs[0].token_ids
    assert out.outputs[0].token_ids == want[1][0][0][:len(out.outputs[0].token_ids)]
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert [final[k].outputs[0].token_ids for k in ("0", "2")] == [want[0][0][0], want[2][0][0]]
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_async_scheduling_is_the_gpu_default():
    assert not EngineConfig(device="cpu").resolved_async_scheduling()
    assert EngineConfig(device="cpu", async_scheduling=True).resolved_async_scheduling()
    assert EngineConfig(device="cuda", async_scheduling=None).resolved_async_scheduling()
    assert EngineConfig(device="cuda:1").resolved_async_scheduling()
    assert not EngineConfig(device="cuda", async_scheduling=False).resolved_async_scheduling()


@pytest.mark.parametrize("overlap", [True, False])
def test_a_prompt_arriving_while_others_decode_waits_the_admission_delay(overlap):
    """admission_delay_steps: a prompt added mid-decode is held back that many steps, then
    runs to the tokens it gets alone."""
    first, late = random_prompts([9, 7], seed=6)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want, _, _ = run(False, [late], params)
    engine = LLMEngine(tiny_model(), None, cpu_config(async_scheduling=overlap, admission_delay_steps=3,
                                                      max_num_seqs=16))
    engine.add_request("first", first, params)
    for _ in range(3):  # its prefill, then decodes
        engine.step()
    engine.add_request("late", late, params)
    waited = 0
    while engine.scheduler.waiting:
        engine.step()
        waited += 1
    assert waited == 4 and engine.scheduler.num_deferrals == 3  # three steps held back, the fourth admits
    final = {}
    while engine.has_unfinished_requests():
        final |= {o.request_id: o for o in engine.step() if o.finished}
    assert final["late"].outputs[0].token_ids == want[0][0][0]
