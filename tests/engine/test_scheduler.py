"""Scheduler: token budget, chunked prefill, decode-first batches, preemption by recompute, priority."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.engine_config import EngineConfig
from engine.scheduler import Scheduler
from tests.engine.engine_helpers import make_seq


def finish_step(sched: Scheduler, out, new_token: int = 5) -> None:
    """Apply a step's progress as the engine would (every sampling sequence gets ``new_token``)."""
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_tokens
        sched.bm.cache_full_blocks(s.seq)
        if s.samples:
            s.seq.token_ids.append(new_token)


def make(budget=16, blocks=64, bs=4, max_seqs=8, chunked=True) -> Scheduler:
    cfg = EngineConfig(device="cpu", max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                       enable_chunked_prefill=chunked, num_kv_blocks=blocks, block_size=bs)
    return Scheduler(cfg, BlockManager(blocks, bs))


def test_long_prompt_is_chunked_within_budget():
    sched = make(budget=16)
    seq = make_seq(list(range(40)))
    sched.add(seq)
    chunks = []
    while seq.num_output_tokens == 0:
        out = sched.schedule()
        assert out.num_tokens <= 16
        chunks.append(out.scheduled[0].num_tokens)
        finish_step(sched, out)
    assert chunks == [16, 16, 8]


def test_decodes_first_then_prefill_fills_the_budget():
    sched = make(budget=16)
    a = make_seq(list(range(6)), seq_id=0, arrival=0)
    sched.add(a)
    finish_step(sched, sched.schedule())          # a: prefill done, one token sampled
    b = make_seq(list(range(30)), seq_id=1, arrival=1)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq.seq_id, s.num_tokens) for s in out.scheduled] == [(0, 1), (1, 15)]
    assert out.scheduled[0].samples and not out.scheduled[1].samples


def test_max_num_seqs_bounds_the_running_set():
    sched = make(budget=64, max_seqs=2)
    for i in range(3):
        sched.add(make_seq([1, 2, 3], seq_id=i, arrival=i))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and len(sched.waiting) == 1


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    sched = make(budget=16, chunked=False)
    a = make_seq(list(range(10)), seq_id=0, arrival=0)
    b = make_seq(list(range(10)), seq_id=1, arrival=1)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0]   # b's 10 tokens do not fit the 6 left


def test_preemption_by_recompute_when_blocks_run_out():
    sched = make(budget=64, blocks=4, bs=4)
    a = make_seq(list(range(7)), seq_id=0, arrival=0)   # 2 blocks
    b = make_seq(list(range(7)), seq_id=1, arrival=1)   # 2 blocks -> pool full
    b.token_ids[0] = 50                                  # no prefix sharing
    sched.add(a)
    sched.add(b)
    finish_step(sched, sched.schedule())
    finish_step(sched, sched.schedule())   # both at 9 tokens: position 8 needs a third block each
    out = sched.schedule()
    assert [p.seq_id for p in out.preempted] == [1]       # the later arrival is preempted
    assert [s.seq.seq_id for s in out.scheduled] == [0]
    assert b.num_computed_tokens == 0 and b.block_table == [] and sched.waiting == [b]
    assert b.num_tokens == 9                              # its generated tokens are kept for recompute
    assert sched.num_preemptions == 1


def test_priority_orders_the_waiting_queue():
    sched = make(budget=64, max_seqs=1)
    late_urgent = make_seq([1, 2], seq_id=0, arrival=5, priority=-1)
    early = make_seq([1, 2], seq_id=1, arrival=0, priority=0)
    sched.add(early)
    sched.add(late_urgent)
    assert sched.schedule().scheduled[0].seq is late_urgent


def test_prefix_hit_skips_computed_tokens():
    sched = make(budget=64)
    a = make_seq(list(range(12)), seq_id=0, arrival=0)
    sched.add(a)
    finish_step(sched, sched.schedule())
    b = make_seq(list(range(12)), seq_id=1, arrival=1)
    sched.add(b)
    out = sched.schedule()
    sb = [s for s in out.scheduled if s.seq is b][0]
    assert (sb.start, sb.num_tokens) == (8, 4)


def _delayed(policy: str, delay: int = 3, max_seqs: int = 16) -> Scheduler:
    cfg = EngineConfig(device="cpu", max_num_batched_tokens=64, max_num_seqs=max_seqs, num_kv_blocks=64,
                       block_size=4, scheduling_policy=policy, admission_delay_steps=delay)
    return Scheduler(cfg, BlockManager(64, 4))


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_new_prompts_wait_up_to_the_admission_delay_while_others_decode(policy):
    sched = _delayed(policy)
    a = make_seq(list(range(6)), seq_id=0, arrival=0)
    sched.add(a)
    out = sched.schedule()                          # nothing decodes: admitted at once
    assert [s.seq.seq_id for s in out.scheduled] == [0]
    finish_step(sched, out)
    sched.add(make_seq(list(range(50, 59)), seq_id=1, arrival=1))  # one waiting: under 16 // 8
    steps = []
    for _ in range(5):
        out = sched.schedule()
        steps.append([(s.seq.seq_id, s.num_tokens) for s in out.scheduled])
        finish_step(sched, out)
    # three decode-only steps, then b joins; then both decode
    assert steps == [[(0, 1)]] * 3 + [[(0, 1), (1, 9)], [(0, 1), (1, 1)]]


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_enough_waiting_prompts_are_admitted_without_delay(policy):
    sched = _delayed(policy, delay=5, max_seqs=16)  # 16 // 8 = 2 waiting prompts are enough
    sched.add(make_seq(list(range(6)), seq_id=0, arrival=0))
    finish_step(sched, sched.schedule())
    sched.add(make_seq([1, 2, 3], seq_id=1, arrival=1))
    assert [s.seq.seq_id for s in sched.schedule().scheduled] == [0]
    sched.add(make_seq([4, 5, 6], seq_id=2, arrival=2))
    assert sorted(s.seq.seq_id for s in sched.schedule().scheduled) == [0, 1, 2]


def test_admission_delay_is_opt_in():
    assert EngineConfig(device="cpu").scheduler_config().admission_delay_steps == 0
    assert EngineConfig(device="cuda").admission_delay_steps == 0     # not yet measured on a GPU: opt-in
    assert EngineConfig(device="cpu", admission_delay_steps=2).scheduler_config().admission_delay_steps == 2
    with pytest.raises(ValueError, match="admission_delay_steps"):
        EngineConfig(device="cpu", admission_delay_steps=-1).scheduler_config()
