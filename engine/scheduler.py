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
from engine.engine_config import EngineConfig
from engine.sequence import Sequence, SequenceStatus


@dataclasses.dataclass
class ScheduledSeq:
    """A sequence and the tokens of it computed in this step: ``token_ids[start:start + num_tokens]``."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """This step reaches the sequence's last token, so it yields the next one."""
        return self.start + self.num_tokens == self.seq.num_tokens


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

    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
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
