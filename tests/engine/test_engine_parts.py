"""The engine's seams: injected parts, the executor, multi-row (verify) steps, one writer of sequence state."""

from __future__ import annotations

import pytest
import torch

from engine.block_manager import BlockManager
from engine.engine_config import CacheConfig, EngineConfig, SchedulerConfig
from engine.executor import InProcessExecutor, ModelOutput
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from engine.output_processor import OutputProcessor
from engine.parts import EngineParts
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from tests.engine.engine_helpers import make_seq, random_prompts, tiny_model
from tests.engine.test_llm import GREEDY, cpu_config, dense_logits


class CountingExecutor(InProcessExecutor):
    """The default executor, counting steps and rows (what a TP executor would wrap)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.steps = 0

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        self.steps += 1
        return super().execute(sched)


def test_injected_parts_are_used_and_defaults_unchanged():
    made = {}

    def scheduler(cfg: SchedulerConfig, bm: BlockManager) -> Scheduler:
        made["scheduler"] = (cfg, bm)
        return Scheduler(cfg, bm)

    parts = EngineParts(executor=CountingExecutor, scheduler=scheduler)
    model = tiny_model()
    engine = LLMEngine(model, None, cpu_config(), parts=parts)
    llm = LLM(tiny_model(), engine_config=cpu_config())
    prompts = random_prompts([5, 17, 33], seed=4)
    plain = llm.generate(prompts, GREEDY)
    engine.stream_outputs = False
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert [final[f"r{i}"].outputs[0].token_ids for i in range(3)] == [o.outputs[0].token_ids for o in plain]
    assert isinstance(engine.executor, CountingExecutor) and engine.executor.steps > 0
    assert made["scheduler"][1] is engine.block_manager and made["scheduler"][0].max_num_batched_tokens == 32


def test_component_configs_validate_on_construction():
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(block_size=0)
    with pytest.raises(ValueError, match="max_waiting"):
        SchedulerConfig(max_waiting=-1)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=0)
    assert EngineConfig(block_size=8).cache_config().block_size == 8
    with pytest.raises(ValueError, match="cuda_one_pass_decode_tokens"):
        EngineConfig(cuda_one_pass_decode_tokens=-1)


@torch.inference_mode()
def test_verify_step_returns_one_row_per_query_token_after_context():
    """A sequence with 3 draft tokens behind 9 computed ones: 4 logits rows equal to the dense model's."""
    model = tiny_model("qwen2-bias-tied")
    runner = ModelRunner(model, cpu_config(), max_model_len=128)
    runner.init_kv_cache()
    bm = BlockManager(runner.kv.num_blocks, 4)
    a, b = random_prompts([10, 6], seed=5)
    drafts = [11, 12, 13]
    sa, sb = make_seq(a, seq_id=0), make_seq(b, seq_id=1)
    assert bm.admit(sa, [], 9) and bm.admit(sb, [], 6)
    runner.execute(SchedulerOutput([ScheduledSeq(sa, 0, 9), ScheduledSeq(sb, 0, 5)], [], []))
    sa.num_computed_tokens, sb.num_computed_tokens = 9, 5
    assert bm.allocate_slots(sa, 1 + len(drafts)) and bm.allocate_slots(sb, 1)
    step = [ScheduledSeq(sa, 9, 1, list(drafts)), ScheduledSeq(sb, 5, 1)]
    logits, sampling = runner.execute(SchedulerOutput(step, [], []))
    assert [s.seq.seq_id for s in sampling] == [1, 0]        # the single-token decode row comes first
    assert logits.shape[0] == 1 + 4
    ref_a = dense_logits(model, a + drafts)[9:]               # positions 9..12 predict the next tokens
    ref_b = dense_logits(model, b)[5:]
    for got, ref in ((logits[1:], ref_a), (logits[:1], ref_b)):
        err = float((got - ref).abs().max() / ref.abs().max())
        assert err < 1e-4, err


def test_output_processor_decides_without_writing_the_sequence():
    seq = make_seq([1, 2, 3], params=SamplingParams(max_tokens=1, stop_token_ids=[9]))
    op = OutputProcessor(None, [0], max_model_len=64)
    seq.append_token(9)
    assert op.check_finish(seq, 9) == ("stop", 9)
    assert seq.finish_reason is None and seq.token_ids == [1, 2, 3, 9]
    other = make_seq([1, 2, 3], seq_id=1, params=SamplingParams(max_tokens=1))
    op.append_token(other, 4, None)  # the compatibility entry point still appends and finishes
    assert other.token_ids == [1, 2, 3, 4] and other.finish_reason == "length"
