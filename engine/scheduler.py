"""Iteration-level scheduler: which sequences run in the next step, and how many tokens each.

Each step has a token budget (``max_num_batched_tokens``). Two policies (``scheduling_policy``):

* ``fair`` (default). Decodes first (one token each). Then the prefill budget is handed out by tenant,
  least-served tenant first (:class:`~engine.fair_share.FairShare`): the tenant's running (partly
  prefilled) sequences before its waiting ones, each taking at most ``prefill_quantum`` tokens, one
  chunk per sequence, until the budget or the candidates run out; budget still left then goes back to
  the capped prefills in the same order, so a lone long prompt still gets whole steps. A short prompt of
  any tenant therefore runs in the next step, whatever another tenant has queued.
* ``fcfs`` (the original). Running sequences first (a decode takes one token, an unfinished prefill the
  rest of its prompt up to the budget), then waiting sequences in (priority, arrival) order.

Under both, waiting prompts are chunked to fit what is left of the budget, and when the KV pool cannot
hold a running sequence's next tokens, the running sequence that would be served last is preempted: its
blocks are freed and it waits to be recomputed (its prefix blocks usually survive in the prefix cache, so
recompute is cheap). A step that preempted admits nothing new.

Speculative decoding (``fair`` only): a decode whose sequence gets drafts from ``proposer``
(:class:`engine.spec_decode.SpecDecoder`) is scheduled with them — budget and KV slots for ``1 + k``
tokens, taken only if free, never by preempting — and the engine rolls the KV back after the verify.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Hashable

from engine.block_manager import BlockManager
from engine.engine_config import EngineConfig, SchedulerConfig
from engine.fair_share import FairShare
from engine.sequence import Sequence, SequenceStatus


@dataclasses.dataclass(slots=True)
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
        self.shares = FairShare()
        self.deferred_steps = 0  # consecutive steps that held new prompts back (admission_delay_steps)
        self.num_deferrals = 0   # such steps in all
        # (seq, num_running, budget) -> draft tokens of a decode (engine.spec_decode); None: no speculation
        self.proposer: Callable[[Sequence, int, int], list[int]] | None = None
        # the proposer drafts nothing in a step that starts with more running sequences than this
        # (SpecConfig.disable_by_batch_size): such a step skips its per-decode call (None: always call)
        self.proposer_max_running: int | None = None

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
        bm, bs = self.bm, self.bm.block_size
        for s in sched.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_tokens
            if seq.num_computed_tokens >= (seq.num_hashed_blocks + 1) * bs:  # else no new full block
                bm.cache_full_blocks(seq)

    def schedule(self) -> SchedulerOutput:
        """Pick the next step's batch."""
        if self.config.scheduling_policy == "fair":
            return _FairStep(self).run()
        budget = self.config.max_num_batched_tokens
        scheduled, preempted = self._schedule_running(budget)
        budget -= sum(s.num_tokens for s in scheduled)
        if not preempted and self.may_admit(scheduled):
            scheduled += self._schedule_waiting(budget)
        return SchedulerOutput(scheduled, self.bm.take_copies(), preempted)

    def may_admit(self, decodes: list[ScheduledSeq]) -> bool:
        """Whether this step admits waiting prompts (``admission_delay_steps``): at once unless sequences are
        decoding in a step that would otherwise stay decode-only (one CUDA graph replay); then after that many
        steps, or once ``max_num_seqs // 8`` prompts wait, all of them together."""
        delay = self.config.admission_delay_steps
        if (not delay or not self.waiting or not decodes or self.deferred_steps >= delay
                or len(self.waiting) >= max(1, self.config.max_num_seqs // 8)
                or any(s.num_query_tokens != 1 for s in decodes)
                or any(q.num_tokens - q.num_computed_tokens > 1 for q in self.running)):
            self.deferred_steps = 0
            return True
        self.deferred_steps += 1
        self.num_deferrals += 1
        return False

    def _schedule_running(self, budget: int) -> tuple[list[ScheduledSeq], list[Sequence]]:
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n == 0:  # its last token is in flight (overlapped loop): nothing to compute
                i += 1
                continue
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


def _tenant(seq: Sequence) -> Hashable:
    return seq.request.tenant


class _FairStep:
    """One step of the ``fair`` policy (see the module docstring); build, :meth:`run`, discard."""

    def __init__(self, sched: Scheduler) -> None:
        self.s = sched
        self.budget = sched.config.max_num_batched_tokens
        self.scheduled: list[ScheduledSeq] = []
        self.taken: set[int] = set()        # seq_ids scheduled this step (never preemption victims)
        self.preempted: list[Sequence] = []
        self.admitting = True                # False once admission failed or anything was preempted
        self.num_running = len(sched.running)  # the load speculation is switched off by

    def run(self) -> SchedulerOutput:
        s = self.s
        busy = {_tenant(q) for q in s.running} | {_tenant(q) for q in s.waiting}
        s.shares.activate(busy)
        self._decodes()
        self.admitting = self.admitting and s.may_admit(self.scheduled)
        capped = self._prefill_pass()
        self._top_up(capped)
        s.shares.end_step(busy)
        return SchedulerOutput(self.scheduled, s.bm.take_copies(), self.preempted)

    def _add(self, seq: Sequence, n: int, drafts: list[int] | None = None) -> ScheduledSeq:
        item = ScheduledSeq(seq, seq.num_computed_tokens, n, drafts or [])
        self.scheduled.append(item)
        self.taken.add(seq.seq_id)
        self.budget -= item.num_query_tokens
        self.s.shares.charge(_tenant(seq), item.num_query_tokens)
        return item

    def _decodes(self) -> None:
        """Every running sequence with one token to compute (a decode) goes first, with its drafts when it
        speculates (their slots are taken only if free: drafts never preempt anyone)."""
        cap, bm = self.s.proposer_max_running, self.s.bm
        speculating = self.s.proposer is not None and (cap is None or self.num_running <= cap)
        plain: dict[Hashable, int] = {}  # decodes without drafts per tenant: charged once, after the loop
        try:
            for seq in list(self.s.running):
                if self.budget == 0:
                    return
                if seq.status is not SequenceStatus.RUNNING or len(seq.token_ids) - seq.num_computed_tokens != 1:
                    continue
                drafts = self._drafts(seq) if speculating else None
                if drafts and bm.allocate_slots(seq, 1 + len(drafts)):
                    self._add(seq, 1, drafts)
                elif bm.allocate_slots(seq, 1) or self._allocate(seq, 1):  # the second preempts for room
                    self.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, 1))
                    self.taken.add(seq.seq_id)
                    self.budget -= 1
                    tenant = seq.request.tenant
                    plain[tenant] = plain.get(tenant, 0) + 1
        finally:
            for tenant, tokens in plain.items():
                self.s.shares.charge(tenant, tokens)

    def _drafts(self, seq: Sequence) -> list[int]:
        proposer = self.s.proposer
        return proposer(seq, self.num_running, self.budget - 1) if proposer is not None else []

    def _allocate(self, seq: Sequence, n: int) -> bool:
        """Blocks for ``n`` more tokens of a running ``seq``, preempting the running sequence that would
        be served last (possibly ``seq`` itself: then False)."""
        while not self.s.bm.allocate_slots(seq, n):
            victim = max((q for q in self.s.running if q.seq_id not in self.taken), key=Sequence.sort_key)
            self.s._preempt(victim)
            self.preempted.append(victim)
            self.admitting = False
            if victim is seq:
                return False
        return True

    def _queues(self) -> dict[Hashable, list[Sequence]]:
        """Prefill candidates per tenant: its partly prefilled running sequences, then its waiting ones."""
        queues: dict[Hashable, list[Sequence]] = {}
        for seq in self.s.running:
            if seq.seq_id not in self.taken and seq.num_tokens > seq.num_computed_tokens:
                queues.setdefault(_tenant(seq), []).append(seq)
        if self.admitting and len(self.s.running) < self.s.config.max_num_seqs:
            for seq in self.s.waiting:
                queues.setdefault(_tenant(seq), []).append(seq)
        return queues

    @staticmethod
    def _running_only(queues: dict[Hashable, list[Sequence]]) -> dict[Hashable, list[Sequence]]:
        """Once admission has stopped for the step, waiting candidates are dead weight: drop them."""
        kept = {t: [q for q in qs if q.status is SequenceStatus.RUNNING] for t, qs in queues.items()}
        return {t: qs for t, qs in kept.items() if qs}

    def _prefill_pass(self) -> list[ScheduledSeq]:
        """Hand the budget out one chunk at a time to the least-served tenant; return the capped chunks."""
        queues = self._queues()
        shares, capped = self.s.shares, []
        while self.budget > 0 and queues:
            tenant = min(queues, key=lambda t: (queues[t][0].request.priority, shares.rank(t),
                                                queues[t][0].sort_key()))
            seq = queues[tenant].pop(0)
            if not queues[tenant]:
                del queues[tenant]
            admitting = self.admitting
            item = self._prefill(seq)
            if item is not None and item.start + item.num_tokens < seq.num_tokens:
                capped.append(item)
            if admitting and not self.admitting:
                queues = self._running_only(queues)
        return capped

    def _chunk(self, remaining: int) -> int:
        cfg = self.s.config
        cap = cfg.quantum if cfg.enable_chunked_prefill else remaining
        return min(remaining, cap, self.budget)

    def _prefill(self, seq: Sequence) -> ScheduledSeq | None:
        """Schedule one chunk of ``seq`` (running: continue its prefill; waiting: admit it)."""
        if seq.status is SequenceStatus.RUNNING:
            n = self._chunk(seq.num_tokens - seq.num_computed_tokens)
            return self._add(seq, n) if self._allocate(seq, n) else None
        return self._admit(seq)

    def _admit(self, seq: Sequence) -> ScheduledSeq | None:
        s = self.s
        if len(s.running) >= s.config.max_num_seqs:
            self.admitting = False
        if not self.admitting:
            return None
        hits = s.bm.match_prefix(seq)
        remaining = seq.num_tokens - len(hits) * s.bm.block_size
        n = self._chunk(remaining)
        # without chunking a prompt runs whole or waits; no blocks: stop admitting (no queue-jumping)
        if (n < remaining and not s.config.enable_chunked_prefill) or not s.bm.admit(seq, hits, n):
            self.admitting = False
            return None
        s.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        s.running.append(seq)
        return self._add(seq, n)

    def _top_up(self, capped: list[ScheduledSeq]) -> None:
        """Budget nobody else wanted goes back to the capped prefills (no preemption for it)."""
        for item in capped:
            if self.budget == 0:
                return
            seq = item.seq
            extra = min(seq.num_tokens - item.start - item.num_tokens, self.budget)
            if self.s.bm.allocate_slots(seq, item.num_tokens + extra):
                item.num_tokens += extra
                self.budget -= extra
                self.s.shares.charge(_tenant(seq), extra)
