"""Requests and the sequences they run as.

A :class:`Request` is what a caller submitted (prompt, parameters, salt, priority); it owns ``n``
:class:`Sequence` objects, one per completion. Only the first sequence runs the prompt; when its prefill
finishes the engine forks the other ``n - 1`` from it, sharing every KV block (copy-on-write for the
last, partly filled one).

Who writes what (one writer per kind of state): the *output* state of a sequence (``token_ids`` beyond the
prompt, ``logprobs``, ``finish_reason`` / ``stop_reason``) changes only through :meth:`Sequence.append_token`
and :meth:`Sequence.finish`, called by ``LLMEngine`` alone (the output processor decides a finish, the
engine applies it); the *scheduling* state (``status``, ``num_computed_tokens``, block table and hashes)
is written by the scheduler and the block manager it drives.
"""

from __future__ import annotations

import enum

import torch

from engine.outputs import RequestMetrics
from engine.sampling_params import SamplingParams

# a sampled token not yet read back from the device (the overlapped loop, docs/engine.md "Overlapped steps")
PLACEHOLDER = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """One submitted prompt and the state shared by its completions."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float, cache_salt: str | None = None, priority: int = 0,
                 tenant: str | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.cache_salt = cache_salt
        self.priority = priority
        # fair-share key of the scheduler; the server's per-tenant salt identifies the tenant by default
        self.tenant = tenant if tenant is not None else cache_salt
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.seqs: list[Sequence] = []
        self.num_cached_tokens = 0
        self.forked = params.n == 1
        self.holds_waiting_slot = True  # counts against EngineConfig.max_waiting until first scheduled
        # argmax with nothing else to compute: the sampler's fast path
        self.plain_greedy = params.greedy and params.logprobs is None and not params.needs_history
        self.overlappable = False  # set by the engine: may run in overlapped steps (LLMEngine.step)

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1 == self.params.n:  # the common case, without a generator
            return seqs[0].status is SequenceStatus.FINISHED
        return len(seqs) == self.params.n and all(s.finished for s in seqs)


class Sequence:
    """Tokens, KV block table and progress of one completion.

    ``token_ids`` holds prompt + output; the first ``num_computed_tokens`` of them have their K/V in
    the blocks of ``block_table`` (block i holds positions ``[i * block_size, (i + 1) * block_size)``).
    Under the overlapped loop the last ``num_pending`` entries are :data:`PLACEHOLDER`: tokens a launched
    step samples on the device, which the scheduler already counts (so the next step can feed them) and
    the engine fills in one step later; outputs and stop checks see only the resolved tokens.
    """

    def __init__(self, seq_id: int, request: Request, index: int, token_ids: list[int],
                 generator: torch.Generator | None) -> None:
        self.seq_id = seq_id
        self.request = request
        self.index = index
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []   # chained hashes of the full blocks of token_ids
        self.num_hashed_blocks = 0            # leading blocks registered in the prefix cache
        self.status = SequenceStatus.WAITING
        self.generator = generator
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list[dict[int, float]] = []
        self.num_pending = 0                  # trailing PLACEHOLDER tokens (sampled, not yet read back)

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_resolved_tokens(self) -> int:
        """Tokens known on the host (``num_tokens`` less the pending placeholders)."""
        return len(self.token_ids) - self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:self.num_resolved_tokens]

    @property
    def num_output_tokens(self) -> int:
        return self.num_resolved_tokens - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token: int, logprobs: dict[int, float] | None = None) -> None:
        """Add one generated token (and its logprobs, when asked for)."""
        self.token_ids.append(token)
        if logprobs is not None:
            self.logprobs.append(logprobs)

    def append_placeholder(self) -> None:
        """Count a token that a launched step samples on the device (filled in by :meth:`resolve_token`)."""
        self.token_ids.append(PLACEHOLDER)
        self.num_pending += 1

    def resolve_token(self, token: int) -> None:
        """Fill in the oldest placeholder with the token read back from the device."""
        assert self.num_pending, "no placeholder to resolve"
        self.token_ids[len(self.token_ids) - self.num_pending] = token
        self.num_pending -= 1

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        """Record why the sequence ended ("stop", "length", "abort"); the scheduler then frees it. Tokens
        still pending are dropped: a step launched past the end yields nothing."""
        self.finish_reason, self.stop_reason = reason, stop_reason
        if self.num_pending:
            del self.token_ids[-self.num_pending:]
            self.num_pending = 0

    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: lower priority value first, then arrival (vLLM's convention)."""
        return (self.request.priority, self.request.metrics.arrival_time, self.seq_id)

    def reset_for_recompute(self) -> None:
        """Forget the KV cache (preemption by recompute): prompt + output are prefilled again."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.num_hashed_blocks = 0
        self.status = SequenceStatus.WAITING
