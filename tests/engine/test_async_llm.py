"""AsyncLLM: streaming, admission errors, the bounded waiting queue, cancellation, metrics."""

from __future__ import annotations

import asyncio

import pytest

from engine.async_llm import AsyncLLM
from engine.engine_config import EngineConfig
from engine.errors import EngineOverloadedError, InvalidRequestError
from engine.llm import LLM
from engine.metrics import EngineStats, RequestStats
from engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import random_prompts, tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def config(**kw) -> EngineConfig:
    base = dict(device="cpu", block_size=4, num_kv_blocks=256, max_num_batched_tokens=64, max_model_len=1024)
    return EngineConfig(**{**base, **kw})


async def collect(stream) -> list:
    return [out async for out in stream]


async def test_streams_match_offline_generation():
    prompts = random_prompts([7, 19, 3], seed=9)
    offline = LLM(tiny_model(), engine_config=config()).generate(prompts, GREEDY)
    expected = [o.outputs[0].token_ids for o in offline]
    async with AsyncLLM.from_model(tiny_model(), None, config()) as llm:
        streams = [llm.generate(p, GREEDY, f"r{i}") for i, p in enumerate(prompts)]
        results = await asyncio.gather(*(collect(s) for s in streams))
    for outs, exp in zip(results, expected, strict=False):
        deltas = [t for o in outs for t in o.outputs[0].delta_token_ids]
        assert deltas == exp == outs[-1].outputs[0].token_ids
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        m = outs[-1].metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time


async def test_bad_requests_raise_before_any_work():
    async with AsyncLLM.from_model(tiny_model(), None, config(max_model_len=32)) as llm:
        with pytest.raises(InvalidRequestError):
            llm.generate([], GREEDY, "empty")
        with pytest.raises(InvalidRequestError, match="maximum model length"):
            llm.generate(list(range(40)), GREEDY, "long")
        with pytest.raises(InvalidRequestError):
            llm.generate([1, 2], SamplingParams(temperature=0, max_tokens=2), "dup")
            llm.generate([1, 2], GREEDY, "dup")
        assert llm.engine.num_waiting_requests <= 1


async def test_full_waiting_queue_rejects_with_retry_after():
    cfg = config(max_num_seqs=1, max_waiting=2)
    endless = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    async with AsyncLLM.from_model(tiny_model(), None, cfg) as llm:
        first = llm.generate([1, 2, 3], endless, "running")
        await first.__anext__()                       # it runs, so the next two wait (max_num_seqs=1)
        waiting = [llm.generate([4, 5], GREEDY, f"w{i}") for i in range(2)]
        with pytest.raises(EngineOverloadedError, match="waiting queue is full") as info:
            llm.generate([6, 7], GREEDY, "rejected")
        assert info.value.retry_after > 0
        await llm.abort("running")
        rest = [out async for out in first]
        assert rest[-1].outputs[0].finish_reason == "abort"
        for w in waiting:
            assert (await collect(w))[-1].outputs[0].finish_reason == "length"
        await collect(llm.generate([6, 7], GREEDY, "accepted-now"))


async def test_cancelled_consumer_frees_blocks():
    endless = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    async with AsyncLLM.from_model(tiny_model(), None, config()) as llm:
        started = asyncio.Event()

        async def consume():
            async for _ in llm.generate(random_prompts([30])[0], endless, "victim"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        assert llm.engine.block_manager.num_free_blocks < llm.engine.num_blocks
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await llm.wait_idle()
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
        assert not llm.engine.has_unfinished_requests()


async def test_breaking_out_of_the_stream_aborts():
    endless = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    async with AsyncLLM.from_model(tiny_model(), None, config()) as llm:
        stream = llm.generate([1, 2, 3, 4, 5], endless, "leaver")
        async for _ in stream:
            break
        await stream.aclose()
        await llm.wait_idle()
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


class Recorder:
    def __init__(self):
        self.requests: list[RequestStats] = []
        self.steps: list[EngineStats] = []

    def on_request_finished(self, stats):
        self.requests.append(stats)

    def on_step(self, stats):
        self.steps.append(stats)


async def test_metrics_listener_and_stats():
    rec = Recorder()
    async with AsyncLLM.from_model(tiny_model(), None, config()) as llm:
        llm.add_metrics_listener(rec)
        prompt = random_prompts([20], seed=4)[0]
        await collect(llm.generate(prompt, GREEDY, "a"))
        await collect(llm.generate(prompt, GREEDY, "b", cache_salt=None))
        stats = llm.stats()
    a, b = rec.requests
    assert (a.prompt_tokens, a.generation_tokens, a.cached_tokens) == (20, 10, 0)
    assert b.cached_tokens == 16 and len(b.itl) == 9
    assert a.ttft is not None and a.tpot is not None and a.queue_time is not None and a.e2e_latency >= a.ttft
    assert stats.prefix_cache_hits == 16 and stats.prefix_cache_queries == 40
    # per request one prefill step (a: 20 prompt tokens; b: the 4 past its cached blocks), then 9 decode steps
    assert (stats.steps_total, stats.prefill_steps_total, stats.step_tokens_total) == (20, 2, 20 + 9 + 4 + 9)
    assert stats.step_seconds_total > 0 and stats.graph_steps_total == 0  # CPU: every step eager
    assert rec.steps and 0.0 <= rec.steps[-1].kv_cache_usage <= 1.0
