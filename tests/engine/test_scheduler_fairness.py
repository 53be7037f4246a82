"""The fair scheduling policy: a long prefill cannot keep decodes or other tenants' prompts out of a step.

Each policy test runs the same scenario under ``fcfs`` (the original policy) as well, to show the
scenario does starve there: the tests would fail on the old scheduler.
"""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.engine_config import EngineConfig, SchedulerConfig
from engine.fair_share import FairShare
from engine.scheduler import Scheduler
from tests.engine.engine_helpers import make_seq
from tests.engine.test_scheduler import finish_step

BUDGET = 64


def make(policy="fair", budget=BUDGET, blocks=512, bs=4, max_seqs=16, quantum=None) -> Scheduler:
    cfg = EngineConfig(device="cpu", max_num_batched_tokens=budget, max_num_seqs=max_seqs, num_kv_blocks=blocks,
                       block_size=bs, scheduling_policy=policy, prefill_quantum=quantum)
    return Scheduler(cfg, BlockManager(blocks, bs))


def prompt(n: int, base: int) -> list[int]:
    """Distinct tokens per ``base`` so no two prompts share prefix blocks."""
    return [base * 1000 + i for i in range(n)]


def steps_until_first_token(sched: Scheduler, seq, limit: int = 100) -> int:
    for step in range(1, limit + 1):
        finish_step(sched, sched.schedule())
        if seq.num_output_tokens:
            return step
    return limit + 1


def add(sched: Scheduler, n: int, seq_id: int, tenant: str, arrival: float, priority: int = 0):
    seq = make_seq(prompt(n, seq_id + 1), seq_id=seq_id, salt=tenant, arrival=arrival, priority=priority)
    sched.add(seq)
    return seq


@pytest.mark.parametrize("policy, bound", [("fair", 1), ("fcfs", None)])
def test_short_prompt_of_another_tenant_runs_in_the_next_step(policy, bound):
    sched = make(policy)
    for i in range(4):                         # tenant A: four long prompts queued first
        add(sched, 10 * BUDGET, i, "A", arrival=i)
    finish_step(sched, sched.schedule())       # A's prefill is running
    short = add(sched, 5, 10, "B", arrival=10)
    steps = steps_until_first_token(sched, short)
    if bound is None:
        assert steps > 30                      # the old policy: behind all of A's 2,560 prompt tokens
    else:
        assert steps == bound


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_short_prompt_of_the_same_tenant_gets_into_a_long_prefill_step(policy):
    sched = make(policy)
    add(sched, 10 * BUDGET, 0, None, arrival=0)
    finish_step(sched, sched.schedule())
    short = add(sched, 5, 1, None, arrival=1)  # tenant-less use (offline LLM) is one tenant
    steps = steps_until_first_token(sched, short)
    assert steps == 1 if policy == "fair" else steps >= 9


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_decodes_run_in_every_step_next_to_long_prefills(policy):
    sched = make(policy)
    add(sched, 20 * BUDGET, 0, "A", arrival=0)             # admitted first: first in the running list
    finish_step(sched, sched.schedule())
    decoding = [add(sched, 3, 1 + i, "B", arrival=1 + i) for i in range(3)]
    finish_step(sched, sched.schedule())                   # fair: B's prompts prefilled, now decoding
    for _ in range(10):
        out = sched.schedule()
        ids = {s.seq.seq_id for s in out.scheduled}
        assert out.num_tokens <= BUDGET
        finish_step(sched, out)
        if policy == "fcfs":                               # the old policy: A's prefill takes it all
            assert ids == {0}
        else:
            assert all(d.seq_id in ids for d in decoding) and 0 in ids


def test_a_lone_long_prompt_still_gets_whole_steps():
    sched = make(quantum=8)
    seq = add(sched, 5 * BUDGET, 0, "A", arrival=0)
    chunks = []
    while not seq.num_output_tokens:
        out = sched.schedule()
        chunks.append(out.num_tokens)
        finish_step(sched, out)
    assert chunks == [BUDGET] * 5              # the quantum caps the first pass only: no lost budget


def test_quantum_caps_each_prefill_when_others_wait():
    sched = make(quantum=8)
    for i in range(3):
        add(sched, 10 * BUDGET, i, f"T{i}", arrival=i)
    out = sched.schedule()
    got = sorted(s.num_tokens for s in out.scheduled)
    assert sum(got) == BUDGET and got[:2] == [8, 8]   # two capped at the quantum, the first topped up


def test_backlogged_tenants_share_prefill_tokens_equally():
    sched = make()
    for i in range(4):
        add(sched, 40 * BUDGET, i, "A", arrival=i)        # A queued first and deeper
    for i in range(2):
        add(sched, 40 * BUDGET, 10 + i, "B", arrival=10 + i)
    served = {"A": 0, "B": 0}
    for _ in range(40):
        out = sched.schedule()
        for s in out.scheduled:
            served[s.seq.request.tenant] += s.num_tokens
        finish_step(sched, out)
        assert abs(served["A"] - served["B"]) <= BUDGET
    assert served["A"] + served["B"] == 40 * BUDGET


def test_an_idle_tenant_does_not_bank_credit():
    sched = make()
    add(sched, 100 * BUDGET, 0, "A", arrival=0)
    for _ in range(20):                                  # A alone for 20 full steps
        finish_step(sched, sched.schedule())
    add(sched, 100 * BUDGET, 1, "B", arrival=1)
    for _ in range(10):
        out = sched.schedule()
        per = {s.seq.request.tenant: s.num_tokens for s in out.scheduled}
        assert per.get("A", 0) >= sched.config.quantum  # B does not take 20 steps to "catch up"
        finish_step(sched, out)


def test_priority_still_goes_first():
    sched = make(max_seqs=1)
    add(sched, 5, 0, "A", arrival=0)                    # least served and earliest...
    urgent = add(sched, 5, 1, "B", arrival=1, priority=-1)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [urgent]   # ...but B's priority wins the one slot


def test_fair_policy_preempts_the_latest_arrival_when_blocks_run_out():
    sched = make(budget=64, blocks=4, bs=4)
    a = add(sched, 7, 0, "A", arrival=0)
    b = add(sched, 7, 1, "B", arrival=1)
    finish_step(sched, sched.schedule())
    finish_step(sched, sched.schedule())   # both at 9 tokens: position 8 needs a third block each
    out = sched.schedule()
    assert out.preempted == [b] and [s.seq for s in out.scheduled] == [a]
    assert sched.waiting == [b] and b.num_computed_tokens == 0


def test_fair_share_clock_and_pruning():
    fs = FairShare()
    fs.activate(["A"])
    fs.charge("A", 100)
    fs.end_step(["A"])
    assert fs.clock == 100
    fs.activate(["A", "B"])                 # B arrives: starts at the clock, not at 0
    assert fs.rank("B") == 100
    fs.charge("B", 10)
    fs.end_step(["B"])                      # A went idle without debt: forgotten
    assert "A" not in fs.served and fs.clock == 110


def test_config_rejects_unknown_policy_and_bad_quantum():
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(scheduling_policy="lottery")
    with pytest.raises(ValueError, match="prefill_quantum"):
        EngineConfig(prefill_quantum=0)
    assert SchedulerConfig(max_num_batched_tokens=2048).quantum == 512


def test_step_budget_default_depends_on_the_device():
    assert EngineConfig(device="cpu").max_num_batched_tokens == 512     # short CPU steps: bounded TTFT
    assert EngineConfig(device="cuda").max_num_batched_tokens == 2048
    assert EngineConfig(device="cpu", max_num_batched_tokens=2048).max_num_batched_tokens == 2048
    assert EngineConfig(device="cpu").scheduler_config().quantum == 128


def test_engine_under_both_policies_generates_the_same_tokens_and_fair_answers_b_first():
    """Real engine, tiny model: the policy changes who runs when, never what a request generates."""
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from tests.engine.engine_helpers import random_prompts, tiny_model

    model = tiny_model()
    long_a, short_b = random_prompts([200, 6], seed=3)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    results = {}
    for policy in ("fcfs", "fair"):
        eng = LLMEngine(model, None, EngineConfig(device="cpu", block_size=4, num_kv_blocks=256,
                                                  max_num_batched_tokens=32, scheduling_policy=policy))
        eng.add_request("a", long_a, params, cache_salt="A")
        eng.step()                                   # A's prefill is running when B arrives
        eng.add_request("b", short_b, params, cache_salt="B")
        order, tokens = [], {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.outputs[0].token_ids and out.request_id not in order:
                    order.append(out.request_id)
                tokens[out.request_id] = out.outputs[0].token_ids
        results[policy] = (order, tokens)
    assert results["fcfs"][0] == ["a", "b"] and results["fair"][0] == ["b", "a"]
    assert results["fair"][1] == results["fcfs"][1]
