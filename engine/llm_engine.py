"""The synchronous engine: admission, one step at a time, outputs.

``LLMEngine`` ties the pieces in request-path order: requests are validated and queued here, the
:class:`~engine.scheduler.Scheduler` picks each step's batch over the
:class:`~engine.block_manager.BlockManager`'s blocks, the :class:`~engine.executor.Executor` runs it
(in process: a :class:`~engine.model_runner.ModelRunner`), the :class:`~engine.sampler.Sampler` picks
tokens and the :class:`~engine.output_processor.OutputProcessor` turns them into text and
:class:`RequestOutput` deltas. Every part comes from an :class:`~engine.parts.EngineParts` factory, so
tests and new features (tensor parallelism, speculative decoding) can swap one without touching the rest.
The engine is the only writer of a sequence's output state (tokens, logprobs, finish reason).

Overlapped steps (``EngineConfig.async_scheduling``, on by default for GPU engines): a step whose requests
are all plain greedy is *launched* (its sampled tokens stay on the device, each sequence gets a placeholder token so
the scheduler can schedule its next step at once) and the previous launched step is *resolved* only then
(its tokens read back, stop checks, outputs), so the host schedules and stages step n + 1 while the GPU
still runs step n. Outputs therefore come one step later; the tokens are the same. Any other step (sampling,
logprobs, penalties, speculation, forks) resolves what is in flight first and runs synchronously.

Not thread-safe, except :meth:`make_request` (validation and admission), which the async front end
calls from the event loop while the engine thread steps.
"""

from __future__ import annotations

import gc
import itertools
import threading
import time
from pathlib import Path

import torch

from engine.engine_config import EngineConfig
from engine.errors import EngineOverloadedError, InvalidRequestError
from engine.metrics import EngineStats, MetricsListener, request_stats
from engine.model import LlamaForCausalLM
from engine.outputs import RequestOutput
from engine.parts import EngineParts
from engine.sampler import SamplerOutput, SamplingRow
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq, SchedulerOutput
from engine.sequence import Request, Sequence
from engine.tokenizer import Tokenizer

_INT = {int}  # validate(): plain ints take the check through C loops


class LLMEngine:
    """Continuous-batching engine over one model."""

    def __init__(self, model: LlamaForCausalLM, tokenizer: Tokenizer | None,
                 config: EngineConfig | None = None, parts: EngineParts | None = None) -> None:
        self.config = config = config or EngineConfig()
        parts = parts or EngineParts()
        self.model_config = model.config
        self.tokenizer = tokenizer
        if config.num_threads and config.resolved_device() == "cpu":
            torch.set_num_threads(config.num_threads)
        max_len = config.max_model_len or self.model_config.max_position_embeddings
        self.executor = parts.executor(model, config, max_len)
        self.device = self.executor.device
        self.num_blocks = self.executor.init_kv_cache()
        self.max_model_len = min(max_len, self.num_blocks * config.block_size)
        self.block_manager = parts.block_manager(self.num_blocks, config.cache_config())
        self.scheduler = parts.scheduler(config.scheduler_config(), self.block_manager)
        self.sampler = parts.sampler(torch.Generator(self.device).manual_seed(config.seed))
        self.spec = parts.spec_decoder(config.spec_config(), self.max_model_len)
        # no speculation configured, or more running sequences than speculate: the scheduler skips the
        # per-decode proposer call (~1 µs a row at 256 running)
        self.scheduler.proposer = self.spec.propose if self.spec.config.method is not None else None
        self.scheduler.proposer_max_running = self.spec.config.disable_by_batch_size
        eos = set(self.model_config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.output_processor = parts.output_processor(tokenizer, sorted(eos), self.max_model_len)
        self.requests: dict[str, Request] = {}
        self.stream_outputs = True  # False: step() returns finished requests only (offline use)
        # True (the engine core process): an unfinished request's streamed output is its wire delta tuple
        # (OutputProcessor.delta), not a RequestOutput; finished and aborted requests stay RequestOutputs
        self.emit_deltas = False
        # with emit_deltas: requests per extra token a streamed delta waits for (0: off): with R requests in
        # the engine, an unfinished request's delta goes out once 1 + R // this many new tokens are in (its
        # first one at once); the core process's copy of the server's stream_coalesce_streams, so that a
        # held token costs neither the core's delta building and pickling nor the API's reading
        self.delta_coalescing = 0
        self.listeners: list[MetricsListener] = []
        self._seq_ids = itertools.count()
        self._admission = threading.Lock()
        self._num_unscheduled = 0  # admitted requests not yet scheduled (the bounded waiting queue)
        self._token_times: dict[str, list[float]] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # steps by kind (decode-only steps can replay a CUDA graph; a step with prompt tokens runs eagerly)
        # and their host wall time: what an operator reads to see why served tokens/s trail the offline engine
        self.steps_total = self.prefill_steps_total = self.step_tokens_total = 0
        self.step_seconds_total = 0.0
        # the overlapped loop: needs an executor that can launch a step without reading its tokens back
        self.overlap = config.resolved_async_scheduling() and hasattr(self.executor, "launch")
        self._in_flight = None  # the launched step whose tokens are not yet read back (LaunchedStep)
        if config.resolved_gc_freeze():  # full collections stop walking the start-up heap (see the field)
            gc.collect()
            gc.freeze()

    @property
    def runner(self):
        """The in-process executor's ModelRunner (benchmarks and GPU tests look inside it)."""
        return self.executor.runner  # type: ignore[attr-defined]

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig | None = None,
                        parts: EngineParts | None = None) -> LLMEngine:
        """Load a model folder or .gguf file and its tokenizer."""
        from engine.loader import load_model

        path = Path(path)
        tok = Tokenizer.from_gguf(path) if path.suffix == ".gguf" else Tokenizer.from_folder(path)
        cfg = config or EngineConfig()
        return cls(load_model(path, weight_format=cfg.weight_format, group_size=cfg.weight_group_size), tok, cfg,
                   parts)

    # ---- admission (thread-safe) ------------------------------------------------------------------
    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                     cache_salt: str | None = None, priority: int = 0,
                     arrival_time: float | None = None) -> Request:
        """Validate, tokenize and reserve a waiting-queue place; raise before any heavy work."""
        ids = self.validate(prompt, params)
        with self._admission:
            if self._num_unscheduled >= self.config.max_waiting:
                raise EngineOverloadedError(
                    f"the engine's waiting queue is full ({self.config.max_waiting} requests); retry later",
                    retry_after=1.0)
            self._num_unscheduled += 1
        return Request(request_id, ids, params, arrival_time or time.time(), cache_salt, priority)

    def validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Token ids of a valid prompt; InvalidRequestError otherwise."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer: pass token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            fast = not ids or (set(map(type, ids)) == _INT and min(ids) >= 0 and max(ids) < vocab)  # C loops
            if not fast and not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        else:
            raise InvalidRequestError(
                f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise InvalidRequestError("prompt is empty")
        self.spec.validate(params)
        if not self.config.enable_chunked_prefill and len(ids) > self.config.max_num_batched_tokens:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; without chunked prefill at most "
                f"{self.config.max_num_batched_tokens} (max_num_batched_tokens) fit a step")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; the maximum model length is {self.max_model_len} "
                "(prompt plus at least one generated token)")
        return ids

    # ---- engine-thread API ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    cache_salt: str | None = None, priority: int = 0) -> Request:
        """Validate and queue a request (synchronous use)."""
        return self.enqueue(self.make_request(request_id, prompt, params, cache_salt=cache_salt,
                                              priority=priority))

    def enqueue(self, request: Request) -> Request:
        """Queue a request built by :meth:`make_request`."""
        if request.request_id in self.requests:
            self._release_admission(request)
            raise InvalidRequestError(f"request id {request.request_id!r} is already running")
        seed = request.params.seed
        gen = None if seed is None else torch.Generator(self.device).manual_seed(seed)
        seq = Sequence(next(self._seq_ids), request, 0, request.prompt_token_ids, gen)
        request.seqs.append(seq)
        params = request.params
        k = params.num_speculative_tokens
        k = self.config.num_speculative_tokens if k is None else k
        # overlapped steps sample by argmax on the device and read tokens back one step late
        request.overlappable = request.plain_greedy and params.n == 1 and not (k and self.config.speculative_method)
        self.requests[request.request_id] = request
        self._token_times[request.request_id] = []
        self.scheduler.add(seq)
        return request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; returns its final output (finish_reason "abort")."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.finished:
                seq.finish("abort")
                self.scheduler.finish(seq)
        request.forked = True
        while len(request.seqs) < request.params.n:  # unforked completions end as aborted too
            child = Sequence(next(self._seq_ids), request, len(request.seqs), request.prompt_token_ids, None)
            child.finish("abort")
            self.scheduler.finish(child)
            request.seqs.append(child)
        return self._finish_request(request)

    @property
    def num_waiting_requests(self) -> int:
        """Admitted requests not yet scheduled (what ``max_waiting`` bounds)."""
        return self._num_unscheduled

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one step; return outputs of the requests that progressed.

        With :attr:`overlap` on, a step of overlappable requests is launched and the step launched before
        it is resolved: the outputs returned are that earlier step's (see the module docstring). With
        :attr:`emit_deltas` on, unfinished requests' outputs are wire delta tuples (the core process's).
        """
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        try:
            return self._step(sched)
        finally:
            if sched.scheduled:  # one pass over the rows: a decode computes one token, a prompt chunk more
                n = sched.num_tokens
                self.steps_total += 1
                self.step_tokens_total += n
                self.prefill_steps_total += n > len(sched.scheduled)
            self.step_seconds_total += time.perf_counter() - t0

    def _step(self, sched: SchedulerOutput) -> list[RequestOutput]:
        if not self.overlap:
            return self._run_sync(sched, [])
        prev, self._in_flight = self._in_flight, None
        if sched.scheduled and all(s.seq.request.overlappable and not s.draft_token_ids for s in sched.scheduled):
            self._mark_all(sched)
            self._in_flight = self.executor.launch(sched, prev)
            self.scheduler.commit_step(sched)
            for s in self._in_flight.sampling:
                self._add_placeholder(s.seq)
            outputs = self._resolve(prev) if prev is not None else []
            self._notify()
            return outputs
        if prev is None:
            return self._run_sync(sched, [])
        outputs = self._resolve(prev)  # placeholders become tokens before a synchronous step reads them
        sched.scheduled = [s for s in sched.scheduled if not s.seq.finished]
        return self._run_sync(sched, outputs)

    def _run_sync(self, sched: SchedulerOutput, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Run a scheduled step and sample it before returning (the synchronous loop)."""
        if not sched.scheduled:
            return outputs
        self._mark_all(sched)
        result = self.executor.execute(sched)
        self.scheduler.commit_step(sched)
        outputs += self._process_samples(result.logits, result.sampling)
        self._notify()
        return outputs

    def _mark_all(self, sched: SchedulerOutput) -> None:
        now = time.time()
        for s in sched.scheduled:
            self._mark_scheduled(s.seq.request, now)

    def _notify(self) -> None:
        if self.listeners:
            stats = self.stats()
            for listener in self.listeners:
                listener.on_step(stats)

    def _add_placeholder(self, seq: Sequence) -> None:
        """Let the scheduler run ``seq``'s next step before this step's token is read back, unless that token
        is its last by length (then it waits: the step after would run past its end)."""
        n = len(seq.token_ids)  # placeholders included: outputs once this step's token is in = n - prompt + 1
        if n - seq.num_prompt_tokens + 1 < seq.request.params.max_tokens and n + 1 < self.max_model_len:
            seq.append_placeholder()

    def _resolve(self, launched) -> list[RequestOutput]:
        """Read a launched step's tokens back (waiting for its GPU work) and apply them: placeholders filled in,
        stop checks, outputs. Sequences that finished or were aborted meanwhile drop their token."""
        emitted = [(s.seq, [tok], [None], False)
                   for s, tok in zip(launched.sampling, launched.token_ids(), strict=True) if not s.seq.finished]
        return self._emit(emitted)

    def shutdown(self) -> None:
        """Release the executor (a tensor-parallel one stops its rank processes)."""
        self.executor.shutdown()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len({s.request.request_id for s in self.scheduler.running}),
            num_waiting=len({s.request.request_id for s in self.scheduler.waiting}),
            kv_cache_usage=bm.usage, num_kv_blocks=bm.num_blocks, prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits, num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            steps_total=self.steps_total, prefill_steps_total=self.prefill_steps_total,
            step_tokens_total=self.step_tokens_total, step_seconds_total=self.step_seconds_total,
            graph_steps_total=getattr(self.executor, "graph_steps", 0),
            spec_num_drafts=self.spec.num_drafts, spec_num_draft_tokens=self.spec.num_draft_tokens,
            spec_num_accepted_tokens=self.spec.num_accepted_tokens)

    # ---- internals --------------------------------------------------------------------------------
    def _process_samples(self, logits: torch.Tensor, sampling: list[ScheduledSeq]) -> list[RequestOutput]:
        if not any(s.draft_token_ids for s in sampling):  # no verify rows: one logits row per sequence
            return self._emit(self._sample_plain(logits, sampling))
        plain, plain_rows, verify, verify_rows = self._split_rows(sampling)
        emitted: list[tuple[Sequence, list[int], list[dict[int, float] | None], bool]] = []
        if plain:
            emitted += self._sample_plain(logits if not verify else logits[self._index(plain_rows, logits)],
                                          plain)
        if verify:
            verdicts = self.spec.verify(self.sampler, logits[self._index(verify_rows, logits)], verify)
            emitted += [(s.seq, v.token_ids, v.logprobs, True) for s, v in zip(verify, verdicts, strict=True)]
        return self._emit(emitted)

    def _emit(self, emitted: list[tuple[Sequence, list[int], list[dict[int, float] | None], bool]]
              ) -> list[RequestOutput]:
        """Append each sequence's new tokens; build the outputs of the requests they touched."""
        now = time.time()
        touched: dict[str, Request] = {}
        for seq, tokens, lps, speculated in emitted:
            if speculated or len(tokens) != 1:
                self._append_all(seq, tokens, lps, speculated)
            else:  # the common case: one token
                self._append(seq, tokens[0], lps[0])
                self.generation_tokens_total += 1
            touched[seq.request.request_id] = seq.request
        outputs = []
        hold = 1 + len(self.requests) // self.delta_coalescing if self.delta_coalescing else 1
        for request in touched.values():
            self._token_times[request.request_id].append(now)
            request.metrics.first_token_time = request.metrics.first_token_time or now
            request.metrics.last_token_time = now
            if request.finished:
                outputs.append(self._finish_request(request))
            elif self.emit_deltas:
                if hold == 1 or self.output_processor.due(request, hold):
                    outputs.append(self.output_processor.delta(request))
            elif self.stream_outputs:
                outputs.append(self.output_processor.build(request))
        return outputs

    @staticmethod
    def _split_rows(sampling: list[ScheduledSeq]):
        """Plain samples and verify steps apart, with the logits rows of each."""
        plain, plain_rows, verify, verify_rows, row = [], [], [], [], 0
        for s in sampling:
            n = s.num_logits_rows
            if s.draft_token_ids:
                verify.append(s)
                verify_rows += range(row, row + n)
            else:
                plain.append(s)
                plain_rows += range(row, row + n)
            row += n
        return plain, plain_rows, verify, verify_rows

    @staticmethod
    def _index(rows: list[int], logits: torch.Tensor) -> torch.Tensor:
        return torch.tensor(rows, device=logits.device)

    def _sample_plain(self, logits: torch.Tensor, sampling: list[ScheduledSeq]):
        """One token per sequence (forks included) from its one logits row."""
        rows, seqs = self._sampling_rows(sampling)
        if len(rows) != logits.shape[0] or rows != list(range(len(rows))):
            logits = logits[torch.tensor(rows, device=logits.device)]
        result = self._sample(logits, seqs)
        return [(seq, [tok], [lp], False)
                for seq, tok, lp in zip(seqs, result.token_ids, result.logprobs, strict=True)]

    def _append_all(self, seq: Sequence, tokens: list[int], lps: list[dict[int, float] | None],
                    speculated: bool) -> None:
        """Append a step's tokens until one finishes the sequence; after a verify, roll the KV back."""
        appended = 0
        for tok, lp in zip(tokens, lps, strict=True):
            self._append(seq, tok, lp)
            appended += 1
            if seq.finished:
                break
        self.generation_tokens_total += appended
        if speculated and not seq.finished:
            self.spec.rollback(self.block_manager, seq, appended - 1)

    def _sampling_rows(self, sampling: list[ScheduledSeq]) -> tuple[list[int], list[Sequence]]:
        """Logits row of every sequence to sample: a new request's n - 1 forks share its parent's row."""
        if all(s.seq.request.forked for s in sampling) and not any(s.draft_token_ids for s in sampling):
            return list(range(len(sampling))), [s.seq for s in sampling]  # row i: sequence i, no forks
        rows: list[int] = []
        seqs: list[Sequence] = []
        row = 0
        for s in sampling:
            for seq in [s.seq] + self._fork(s.seq):
                rows.append(row)
                seqs.append(seq)
            row += s.num_logits_rows
        return rows, seqs

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """One token per row; plain greedy batches (no processor, penalty or logprobs) take the argmax."""
        if all(q.request.plain_greedy for q in seqs):
            return SamplerOutput(logits.argmax(-1).tolist(), [None] * len(seqs))
        return self.sampler(logits, [SamplingRow(q.params, q.request.prompt_token_ids,
                                                 q.output_token_ids if q.params.needs_history else [],
                                                 q.generator) for q in seqs])

    def _append(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> None:
        """The one place a sequence's output grows or ends (a pending placeholder is filled in first)."""
        if seq.num_pending:
            seq.resolve_token(token)
        else:
            seq.append_token(token, logprobs)
        verdict = self.output_processor.check_finish(seq, token)
        if verdict is not None:
            seq.finish(*verdict)
            self.scheduler.finish(seq)
        elif seq.num_computed_tokens >= (seq.num_hashed_blocks + 1) * self.block_manager.block_size:
            self.block_manager.cache_full_blocks(seq)  # blocks whose last token was a placeholder until now

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """On a request's first sample, create its other n - 1 completions sharing the parent's blocks."""
        request = parent.request
        if request.forked:
            return []
        request.forked = True
        children = []
        for index in range(1, request.params.n):
            seed = request.params.seed
            gen = None if seed is None else torch.Generator(self.device).manual_seed(seed + index)
            child = Sequence(next(self._seq_ids), request, index, parent.token_ids, gen)
            self.block_manager.fork(parent, child)
            self.scheduler.add_running(child)
            request.seqs.append(child)
            children.append(child)
        return children

    def _mark_scheduled(self, request: Request, now: float) -> None:
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = now
            request.num_cached_tokens = request.seqs[0].num_computed_tokens
            self.prompt_tokens_total += len(request.prompt_token_ids)
            self._release_admission(request)

    def _release_admission(self, request: Request) -> None:
        if request.holds_waiting_slot:
            request.holds_waiting_slot = False
            with self._admission:
                self._num_unscheduled -= 1

    def _finish_request(self, request: Request) -> RequestOutput:
        out = self.output_processor.build(request)
        m = request.metrics
        m.finished_time = time.time()
        self._release_admission(request)
        for seq in request.seqs:
            self.output_processor.forget(seq)
        del self.requests[request.request_id]
        times = self._token_times.pop(request.request_id, [])
        if self.listeners:
            stats = request_stats(request.request_id, request.seqs[0].finish_reason,
                                  len(request.prompt_token_ids),
                                  sum(s.num_output_tokens for s in request.seqs), request.num_cached_tokens,
                                  m.arrival_time, m.first_scheduled_time, times, m.finished_time)
            for listener in self.listeners:
                listener.on_request_finished(stats)
        return out
