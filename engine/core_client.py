"""``ProcessAsyncLLM``: :class:`~engine.async_llm.AsyncLLM`'s interface over an engine core in its own process.

The engine core (``engine.engine_core``) runs the model, scheduler, sampler and detokenizer in a spawned
process; this side validates and admits requests (same errors, same moment: before any model work),
writes them down a pipe and reads the core's one message per engine step **in the event loop**
(``add_reader``/``add_writer`` on the non-blocking pipe, multiprocessing's framing: no reader or sender
thread, so no GIL handed between threads per request and per step, which cost the API process about a
fifth of its CPU and held batches up behind a busy loop by a switch interval). A step's batch
costs the loop one append per request that moved (its raw delta) and one wake-up per waiting stream; the
stream's consumer turns everything queued since its last wake-up into **one** :class:`RequestOutput`
(cumulative ids and text rebuilt there), so a consumer that fell behind (a slow socket, a busy loop at
hundreds of users) gets its steps coalesced into one output -- one SSE chunk per wake-up, not per token.

Leaving the ``async for`` early (or cancelling) aborts the request in the core and frees its KV blocks;
``shutdown`` stops the core and ends unfinished streams with an EngineError; a core that dies fails
every stream with an EngineError and refuses new requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import struct
import threading
import time
from collections.abc import AsyncIterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.engine_core import CompletionDelta, CoreInfo, CoreSpec, RequestDelta, StepBatch, core_main
from engine.errors import EngineError, EngineOverloadedError, InvalidRequestError
from engine.metrics import EngineStats, MetricsListener
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.sequence import Request
from engine.tokenizer import Tokenizer

START_TIMEOUT_S = 600.0  # loading a large checkpoint onto a GPU takes minutes
STOP_TIMEOUT_S = 30.0


class _Validator:
    """What :meth:`LLMEngine.validate` reads, filled from the core's :class:`CoreInfo`."""

    def __init__(self, info: CoreInfo, config: EngineConfig) -> None:
        from engine.parts import EngineParts

        self.tokenizer, self.model_config, self.config = info.tokenizer, info.model_config, config
        self.max_model_len = info.max_model_len
        self.spec = EngineParts().spec_decoder(config.spec_config(), info.max_model_len)

    def validate(self, prompt, params) -> list[int]:
        from engine.llm_engine import LLMEngine

        return LLMEngine.validate(self, prompt, params)  # type: ignore[arg-type]


class _Progress:
    """The cumulative state of one request on the client side (the core sends deltas only)."""

    __slots__ = ("prompt", "ids", "text")

    def __init__(self, prompt: list[int]) -> None:
        self.prompt = prompt
        self.ids: dict[int, list[int]] = {}
        self.text: dict[int, str] = {}

    def rebuild(self, deltas: list[RequestDelta]) -> RequestOutput:
        """One output for the steps in ``deltas`` (oldest first): their deltas joined, the last one's state."""
        rid, finished, cached, metrics, comps = deltas[-1]
        if len(deltas) > 1:
            comps = _join(deltas)
        outs = []
        for index, dtext, dids, lps, reason, stop in comps:
            ids = self.ids.setdefault(index, [])
            ids.extend(dids)
            text = self.text[index] = self.text.get(index, "") + dtext
            outs.append(CompletionOutput(index, list(ids), text, dtext, dids, lps, reason, stop))
        return RequestOutput(rid, self.prompt, outs, finished, cached, metrics)


def _join(deltas: list[RequestDelta]) -> list[CompletionDelta]:
    """Several steps' completion deltas as one per completion (texts, ids and logprobs concatenated)."""
    joined: dict[int, list] = {}
    for delta in deltas:
        for index, dtext, dids, lps, reason, stop in delta[4]:
            j = joined.get(index)
            if j is None:
                joined[index] = [index, dtext, list(dids), None if lps is None else list(lps), reason, stop]
                continue
            j[1] += dtext
            j[2] += dids
            if lps is not None:
                j[3] = (j[3] or []) + lps
            j[4], j[5] = reason, stop
    return [tuple(j) for j in joined.values()]


class _Stream:
    """One request's inbox on the client side: raw step deltas (or an exception) appended by the loop's
    batch handler, taken all at once by the consumer; at most one wake-up per batch, and with
    ``min_tokens`` > 1 (``OutputStream.coalesce``) none until that many new tokens, a finish or an error
    are in (the first output never waits)."""

    __slots__ = ("items", "waiter", "progress", "min_tokens", "pending", "delivered", "ready")

    def __init__(self, progress: _Progress) -> None:
        self.items: list = []
        self.waiter: asyncio.Future | None = None
        self.progress = progress
        self.min_tokens = 1
        self.pending = 0          # new tokens in ``items`` (counted only when min_tokens > 1)
        self.delivered = False    # the consumer has taken an output
        self.ready = False        # ``items`` holds something worth a wake-up

    def put(self, item) -> None:
        """Queue a step's delta (or an error); wake the consumer unless fewer than ``min_tokens`` new tokens
        have come since it last took."""
        self.items.append(item)
        need = self.min_tokens
        if need > 1 and self.delivered and type(item) is tuple and not item[1]:
            comps = item[4]  # one completion (n = 1) is the common case: no generator per delta
            self.pending += len(comps[0][2]) if len(comps) == 1 else sum(len(c[2]) for c in comps)
            if self.pending < need:
                return  # not worth a wake-up yet
        self.ready = True
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list:
        while not self.ready:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items, self.items = self.items, []
        self.pending, self.delivered, self.ready = 0, True, False
        return items


class OutputStream:
    """What :meth:`ProcessAsyncLLM.generate` returns: an async iterator of :class:`RequestOutput` (close it
    to abort the request) that can also be ended from outside with an error (:meth:`interrupt`), which is
    how the server ends its streams at the end of a drain without racing a future against every item."""

    def __init__(self, agen: AsyncIterator[RequestOutput], stream: _Stream) -> None:
        self._agen, self._stream = agen, stream

    def __aiter__(self) -> OutputStream:
        return self

    def __anext__(self):
        return self._agen.__anext__()

    def aclose(self):
        return self._agen.aclose()

    def interrupt(self, exc: BaseException) -> None:
        """End the stream with ``exc`` after the outputs already received."""
        self._stream.put(exc)

    def coalesce(self, min_tokens: int) -> None:
        """After the first output, wake the consumer only once ``min_tokens`` new tokens (summed over the
        completions), a finish or an error have come (the server's ``stream_interval``)."""
        self._stream.min_tokens = max(1, int(min_tokens))


def merge_outputs(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """``new`` with the deltas of ``old`` (an output its consumer has not taken yet) in front."""
    before = {c.index: c for c in old.outputs}
    for c in new.outputs:
        prev = before.get(c.index)
        if prev is None:
            continue
        c.delta_text = prev.delta_text + c.delta_text
        c.delta_token_ids = prev.delta_token_ids + c.delta_token_ids
        if prev.logprobs is not None or c.logprobs is not None:
            c.logprobs = (prev.logprobs or []) + (c.logprobs or [])
    return new


class ProcessAsyncLLM:
    """Serve many concurrent requests from asyncio code; the engine steps in a child process."""

    def __init__(self, model_dir_or_model, engine_config: EngineConfig | None = None,
                 tokenizer: Tokenizer | None = None, *, parts=None) -> None:
        self.config = engine_config or EngineConfig()
        if isinstance(model_dir_or_model, (str, Path)):
            self._spec = CoreSpec(self.config, path=str(model_dir_or_model), parts=parts)
        else:
            self._spec = CoreSpec(self.config, model=model_dir_or_model, tokenizer=tokenizer, parts=parts)
        self._info: CoreInfo | None = None
        self._validator: _Validator | None = None
        self._load_coalescing = 0
        self._proc = None
        self._conn = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._rbuf = bytearray()   # bytes read from the pipe, not yet a whole message
        self._wbuf = bytearray()   # framed messages the pipe did not take yet (the loop writes them)
        self._reading = False      # the pipe is registered with the loop's add_reader
        self._waiters: dict[int, asyncio.Future] = {}
        self._tokens = itertools.count()
        self._listeners: list[MetricsListener] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._error: str | None = None
        self._adds_sent = 0
        self._adds_seen = 0
        self._num_unscheduled = 0
        self._stats: EngineStats | None = None

    @property
    def load_coalescing(self) -> int:
        """Streams per extra token a streamed output waits for (0: off; the server's
        ``stream_coalesce_streams``): with R requests in the engine, a request's progress is sent once
        1 + R // this many new tokens are in (its first output, a finish, an error: at once), so the API's
        per-chunk cost (framing, socket write) stops growing with users. The core process holds the tokens
        (``LLMEngine.delta_coalescing``): a held token costs neither the core's delta building and pickling
        nor this process's reading and queueing."""
        return self._load_coalescing

    @load_coalescing.setter
    def load_coalescing(self, per: int) -> None:
        self._load_coalescing = per = max(0, int(per))
        self._spec.coalesce_streams = per
        if self._info is not None and self._error is None:  # a running core learns it before later adds
            self._send(("coalesce", per))

    @classmethod
    def from_model(cls, model, tokenizer: Tokenizer | None,
                   engine_config: EngineConfig | None = None) -> ProcessAsyncLLM:
        """Build from an already loaded (CPU) model and its tokenizer; the core gets a copy."""
        return cls(model, engine_config, tokenizer)

    # ---- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn the core and wait until its engine is built (raises EngineError if that fails)."""
        if self._proc is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stopping, self._error = False, None
        ctx = mp.get_context("spawn")  # never fork a process that holds CUDA or threads
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=core_main, args=(child, self._spec), name="cipherlm-engine-core",
                                 daemon=True)
        self._proc.start()
        child.close()
        msg = await asyncio.to_thread(self._first_message)
        if msg[0] != "ready":
            await self._reap()
            raise EngineError(f"the engine core failed to start: {msg[1]}")
        self._info = msg[1]
        self._stats = self._info.stats
        self._validator = _Validator(self._info, self.config)
        self._rbuf.clear()
        self._wbuf.clear()
        try:
            self._loop.add_reader(self._conn.fileno(), self._on_readable)
            self._reading = True
            os.set_blocking(self._conn.fileno(), False)  # the loop reads and writes; it must never block
        except NotImplementedError:  # a loop without add_reader (Windows' proactor): two threads
            threading.Thread(target=self._sender, name="cipherlm-core-send", daemon=True).start()
            threading.Thread(target=self._reader, name="cipherlm-core-recv", daemon=True).start()

    def _first_message(self) -> tuple:
        if not self._conn.poll(START_TIMEOUT_S):
            return ("failed", f"no answer in {START_TIMEOUT_S:.0f} s")
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            return ("failed", f"the process exited (code {self._proc.exitcode})")

    async def shutdown(self) -> None:
        """Stop the core; unfinished streams end with an EngineError."""
        if self._proc is None:
            return
        self._stopping = True
        self._send(("stop",))
        self._outbox.put(None)  # ends the sender thread (where there is one) after the stop message
        await self._reap()
        self._stop_reading()
        self._fail_all("the engine was shut down")

    async def _reap(self) -> None:
        proc, self._proc = self._proc, None
        await asyncio.to_thread(proc.join, STOP_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            await asyncio.to_thread(proc.join)

    async def __aenter__(self) -> ProcessAsyncLLM:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    # ---- public API -------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._started().tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self._started().model_config

    @property
    def max_model_len(self) -> int:
        return self._started().max_model_len

    @property
    def healthy(self) -> bool:
        """The core runs and has not failed (``/health/ready`` turns 503 otherwise)."""
        return self._proc is not None and self._error is None and self._proc.is_alive()

    def stats(self) -> EngineStats:
        """Gauges and counters as of the core's last step."""
        return self._stats if self._stats is not None else self._started().stats

    def add_metrics_listener(self, listener: MetricsListener) -> None:
        """Receive per-request and per-step metrics (called on the event loop as each step's batch arrives)."""
        self._listeners.append(listener)

    def generate(self, prompt: str | list[int], params: SamplingParams | None, request_id: str, *,
                 cache_salt: str | None = None, priority: int = 0) -> OutputStream:
        """Admit a request and return its stream of outputs (deltas since the previous one).

        Raises InvalidRequestError / EngineOverloadedError immediately, before any model work."""
        self._started()
        if self._error is not None:
            raise EngineError(f"the engine loop failed: {self._error}")
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string")
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        ids = self._validator.validate(prompt, params)
        if self._num_unscheduled + self._adds_sent - self._adds_seen >= self.config.max_waiting:
            raise EngineOverloadedError(
                f"the engine's waiting queue is full ({self.config.max_waiting} requests); retry later",
                retry_after=1.0)
        request = Request(request_id, ids, params, time.time(), cache_salt, priority)
        stream = _Stream(_Progress(request.prompt_token_ids))
        self._streams[request_id] = stream
        self._adds_sent += 1
        self._send(("add", request))
        return OutputStream(self._stream(request_id, stream), stream)

    async def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished); its stream ends with finish_reason "abort"."""
        await self._control(("abort", request_id))

    async def wait_idle(self) -> None:
        """Return once the core has handled everything sent so far."""
        await self._control(("sync",))

    # ---- event-loop side --------------------------------------------------------------------------
    def _started(self) -> CoreInfo:
        if self._info is None:
            raise EngineError("the engine is not started (await start() first)")
        return self._info

    async def _control(self, msg: tuple) -> None:
        if self._proc is None or self._error is not None:
            return
        token = next(self._tokens)
        fut = self._loop.create_future()
        self._waiters[token] = fut
        self._send((*msg, token))
        await fut

    async def _stream(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                items = await stream.take()
                deltas = []
                for item in items:  # the steps queued since the last wake-up, then maybe an error
                    if isinstance(item, BaseException):
                        if deltas:
                            yield stream.progress.rebuild(deltas)
                        raise item
                    deltas.append(item)
                out = stream.progress.rebuild(deltas)
                finished = out.finished
                yield out
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not finished and not self._stopping and self._error is None:
                self._send(("abort", request_id, -1))  # consumer left or was cancelled

    def _on_batch(self, batch: StepBatch) -> None:
        self._adds_seen, self._num_unscheduled = batch.adds_seen, batch.num_unscheduled
        streams = self._streams
        for rid, exc in batch.add_errors:
            stream = streams.get(rid)
            if stream is not None:
                stream.put(exc)
        for delta in batch.outputs:  # delta: (request_id, finished, ...); rebuilt by the consumer
            stream = streams.get(delta[0])
            if stream is None:
                continue  # its consumer left: the abort is on its way
            if delta[1]:
                del streams[delta[0]]
            stream.put(delta)  # under load the core sent it once it had 1 + R // load_coalescing tokens
        for token in batch.acks:
            fut = self._waiters.pop(token, None)
            if fut is not None and not fut.done():
                fut.set_result(None)

    def _fail_all(self, why: str) -> None:
        for stream in self._streams.values():
            stream.put(EngineError(why))
        self._streams.clear()
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()

    def _on_core_lost(self, why: str) -> None:
        self._error = why
        self._fail_all(f"the engine loop failed: {why}")

    # ---- threads ----------------------------------------------------------------------------------
    def _sender(self) -> None:
        conn = self._conn
        while (msg := self._outbox.get()) is not None:
            try:
                conn.send(msg)
            except (OSError, ValueError):
                return  # the core is gone; the reader reports it

    def _on_readable(self) -> None:
        """The pipe has bytes: take what is there (never blocks) and handle every whole message in it."""
        try:
            data = os.read(self._conn.fileno(), 1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._stop_reading()
            if not self._stopping:
                self._on_core_lost("the engine core exited")
            return
        buf = self._rbuf
        buf += data
        pos = 0
        while (found := _frame(buf, pos)) is not None:
            start, end = found
            msg = pickle.loads(buf[start:end])
            pos = end
            if msg[0] == "failed":
                self._stop_reading()
                if not self._stopping:
                    self._on_core_lost(msg[1])
                return
            self._notify(msg[1])
            self._on_batch(msg[1])
        del buf[:pos]

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            with contextlib.suppress(OSError, ValueError):
                self._loop.remove_reader(self._conn.fileno())
                self._loop.remove_writer(self._conn.fileno())
            self._conn.close()

    def _send(self, msg: tuple) -> None:
        """A message to the core: written by the loop itself (no sender thread to hand the GIL to per
        request), what the pipe does not take now is written when it is writable again."""
        if not self._reading:
            self._outbox.put(msg)  # the thread layout, or the pipe is already closed (then dropped)
            return
        data = ForkingPickler.dumps(msg)
        header = struct.pack("!i", len(data)) if len(data) <= 0x7FFFFFFF else struct.pack("!iQ", -1, len(data))
        pending = bool(self._wbuf)
        self._wbuf += header
        self._wbuf += data
        if not pending:
            self._on_writable()

    def _on_writable(self) -> None:
        fd = self._conn.fileno()
        try:
            sent = os.write(fd, self._wbuf)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._wbuf.clear()  # the core is gone; the reader reports it
            return
        del self._wbuf[:sent]
        if self._wbuf:
            self._loop.add_writer(fd, self._on_writable)
        else:
            self._loop.remove_writer(fd)

    def _reader(self) -> None:
        """The fallback for loops without ``add_reader``: a thread that hands each batch to the loop."""
        conn, loop = self._conn, self._loop
        why = "the engine core exited"
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "failed":
                why = msg[1]
                break
            batch: StepBatch = msg[1]
            self._notify(batch)
            loop.call_soon_threadsafe(self._on_batch, batch)
        conn.close()
        if not self._stopping:
            loop.call_soon_threadsafe(self._on_core_lost, why)

    def _notify(self, batch: StepBatch) -> None:
        if batch.stats is not None:
            self._stats = batch.stats
        for listener in self._listeners:
            for stats in batch.finished:
                listener.on_request_finished(stats)
            if batch.stats is not None:
                listener.on_step(batch.stats)


def _frame(buf: bytearray, pos: int) -> tuple[int, int] | None:
    """Where the message at ``pos`` lies in ``buf`` (``multiprocessing.Connection``'s framing: a signed
    4-byte big-endian size, or -1 and an 8-byte size), or None while it is incomplete."""
    if len(buf) - pos < 4:
        return None
    (size,) = struct.unpack_from("!i", buf, pos)
    start = pos + 4
    if size == -1:
        if len(buf) - pos < 12:
            return None
        (size,) = struct.unpack_from("!Q", buf, start)
        start += 8
    end = start + size
    return (start, end) if end <= len(buf) else None
