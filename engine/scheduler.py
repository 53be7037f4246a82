"""Iteration-level scheduler: which sequences run in the next step, and how many tokens each.

Each step has a token budget (``max_num_batched_tokens``). Running sequences come first (a decode takes
one token, an unfinished prefill takes the rest of its prompt up to the budget), then waiting sequences
in (priority, arrival) order, their prompts chunked to fit what is left of the budget. When the KV pool
cannot hold a running sequence's next token, the running sequence that would be served last is
preempted: its blocks are freed and it waits to be recomputed (its prefix blocks usually survive in the
prefix cache, so recompute is cheap).
"""

from __future__ import annotations

import bisect
import dataclasses

from engine.block_manager import BlockManager
from engine.engine_config import EngineConfig, SchedulerConfig
from engine.sequence import Sequence, SequenceStatus


@dataclasses.dataclass
class ScheduledSeq:
    """A sequence and the tokens of it computed in this step.

    The step's query tokens are ``token_ids[start:start + num_tokens]`` followed by ``draft_token_ids``
    (speculative tokens not yet part of the sequence: a verify step scores them all in one forward).
    A step that reaches the sequence's last token yields ``1 + len(draft_token_ids)`` logits rows, the
    last ones of its query; any other step (a prefill chunk) yields none.
    """

    seq: Sequence
    start: int
    num_tokens: int
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def samples(self) -> bool:
        """This step reaches the sequence's last token, so it yields the next one(s)."""
        return self.start + self.num_tokens == self.seq.num_tokens

    @property
    def num_query_tokens(self) -> int:
        """Tokens this step computes for the sequence (its rows in the flat batch)."""
        return self.num_tokens + len(self.draft_token_ids)

    @property
    def num_logits_rows(self) -> int:
        """Rows of logits this step returns for the sequence: 1 + drafts when it samples, else 0."""
        return 1 + len(self.draft_token_ids) if self.samples else 0

    def query_token_ids(self) -> list[int]:
        """The token ids the step feeds the model for this sequence."""
        return self.seq.token_ids[self.start:self.start + self.num_tokens] + self.draft_token_ids


@dataclasses.dataclass
class SchedulerOutput:
    """One step's batch: the work, the copy-on-write block copies to apply first, what was preempted."""

    scheduled: list[ScheduledSeq]
    copies: list[tuple[int, int]]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    """Continuous batching over a :class:`BlockManager`."""

    def __init__(self, config: SchedulerConfig | EngineConfig, block_manager: BlockManager) -> None:
        self.config = config.scheduler_config() if isinstance(config, EngineConfig) else config
        self.bm = block_manager
        self.waiting: list[Sequence] = []   # sorted by Sequence.sort_key
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a sequence (a new one, or a preempted one that keeps its place by arrival)."""
        seq.status = SequenceStatus.WAITING
        keys = [s.sort_key() for s in self.waiting]
        self.waiting.insert(bisect.bisect(keys, seq.sort_key()), seq)

    def add_running(self, seq: Sequence) -> None:
        """Run a sequence whose blocks were already set up (a fork)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Take a finished (or aborted) sequence out and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED

    def commit_step(self, sched: SchedulerOutput) -> None:
        """After the forward: the step's tokens have K/V now; register their full blocks for reuse."""
        for s in sched.scheduled:
            s.seq.num_computed_tokens += s.num_tokens
            self.bm.cache_full_blocks(s.seq)

    def schedule(self) -> SchedulerOutput:
        """Pick the next step's batch."""
        budget = self.config.max_num_batched_tokens
        scheduled, preempted = self._schedule_running(budget)
        budget -= sum(s.num_tokens for s in scheduled)
        if not preempted:
            scheduled += self._schedule_waiting(budget)
        return SchedulerOutput(scheduled, self.bm.take_copies(), preempted)

    def _schedule_running(self, budget: int) -> tuple[list[ScheduledSeq], list[Sequence]]:
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.bm.allocate_slots(seq, n):
                victim = max(self.running[i:], key=Sequence.sort_key)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq in preempted:
                continue  # running[i] is now the next sequence
            scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budget -= n
            i += 1
        return scheduled, preempted

    def _schedule_waiting(self, budget: int) -> list[ScheduledSeq]:
        scheduled: list[ScheduledSeq] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits = self.bm.match_prefix(seq)
            remaining = seq.num_tokens - len(hits) * self.bm.block_size
            n = min(remaining, budget)
            if n < remaining and not self.config.enable_chunked_prefill:
                break
            if not self.bm.admit(seq, hits, n):
                break
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budget -= n
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.reset_for_recompute()
        self.num_preemptions += 1
        self.add(seq)
