"""Asynchronous front end: per-request token streams over an engine stepping in a background thread.

``generate()`` validates and admits the request synchronously (bad input raises
:class:`~engine.errors.InvalidRequestError`, a full waiting queue
:class:`~engine.errors.EngineOverloadedError`,
both before any model work) and returns an async iterator of :class:`RequestOutput` deltas. The engine
thread owns the :class:`LLMEngine`; the event loop talks to it only through a thread-safe inbox, and
outputs come back through ``loop.call_soon_threadsafe``, so the loop never waits on a model forward
(which releases the GIL). Leaving the ``async for`` early, or cancelling the consuming task, aborts the
request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator
from pathlib import Path

from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.errors import EngineError, InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.metrics import EngineStats, MetricsListener
from engine.model import LlamaForCausalLM
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.sequence import Request
from engine.tokenizer import Tokenizer


class AsyncLLM:
    """Serve many concurrent requests from asyncio code."""

    def __init__(self, model_dir_or_model: str | Path | LLMEngine, engine_config: EngineConfig | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        if isinstance(model_dir_or_model, LLMEngine):
            self.engine = model_dir_or_model
        elif isinstance(model_dir_or_model, LlamaForCausalLM):
            self.engine = LLMEngine(model_dir_or_model, tokenizer, engine_config)
        else:
            self.engine = LLMEngine.from_pretrained(model_dir_or_model, engine_config)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None
        self._stats = self.engine.stats()

    @classmethod
    def from_model(cls, model: LlamaForCausalLM, tokenizer: Tokenizer | None,
                   engine_config: EngineConfig | None = None) -> AsyncLLM:
        """Build from an already loaded model and its tokenizer."""
        return cls(LLMEngine(model, tokenizer, engine_config))

    # ---- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine thread (``generate`` also starts it lazily)."""
        self._ensure_started()

    async def shutdown(self) -> None:
        """Stop the engine thread; unfinished streams end with an EngineError."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        for q in list(self._streams.values()):
            q.put_nowait(EngineError("the engine was shut down"))
        self._streams.clear()

    async def __aenter__(self) -> AsyncLLM:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    # ---- public API -------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.model_config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def stats(self) -> EngineStats:
        """Gauges and counters as of the last engine step."""
        return self._stats

    def add_metrics_listener(self, listener: MetricsListener) -> None:
        """Receive per-request and per-step metrics (called from the engine thread)."""
        self.engine.listeners.append(listener)

    def generate(self, prompt: str | list[int], params: SamplingParams | None, request_id: str, *,
                 cache_salt: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Admit a request and return its stream of outputs (each carrying deltas since the previous).

        Must be called from a running event loop. Raises InvalidRequestError / EngineOverloadedError
        immediately, before any model work.
        """
        self._ensure_started()
        if self._error is not None:
            raise EngineError(f"the engine loop failed: {self._error!r}")
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string")
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        request = self.engine.make_request(request_id, prompt, params or SamplingParams(),
                                           cache_salt=cache_salt, priority=priority)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._send(("add", request))
        return self._stream(request_id, stream)

    async def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished); its stream ends with finish_reason "abort"."""
        done = asyncio.get_running_loop().create_future()
        self._send(("abort", request_id, done))
        await done

    async def wait_idle(self) -> None:
        """Return once the engine thread has processed everything sent so far (tests, draining)."""
        done = asyncio.get_running_loop().create_future()
        self._send(("sync", done))
        await done

    # ---- event-loop side --------------------------------------------------------------------------
    async def _stream(self, request_id: str, stream: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished and not self._stopping:
                self._send(("abort", request_id, None))  # consumer left or was cancelled

    def _ensure_started(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="cipherlm-engine", daemon=True)
        self._thread.start()

    def _send(self, msg: tuple) -> None:
        self._inbox.put(msg)
        self._wake.set()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            rid = out.request_id
            stream = self._streams.pop(rid, None) if out.finished else self._streams.get(rid)
            if stream is not None:
                stream.put_nowait(out)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(EngineError(f"the engine loop failed: {exc!r}"))

    # ---- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                outputs = self._drain_inbox()
                if self.engine.has_unfinished_requests():
                    outputs += self.engine.step()
                self._stats = self.engine.stats()
                if outputs:
                    self._loop.call_soon_threadsafe(self._deliver, outputs)
                if not self.engine.has_unfinished_requests() and self._inbox.empty():
                    self._wake.wait(0.5)
                    self._wake.clear()
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the streams
            self._error = exc
            self._loop.call_soon_threadsafe(self._fail_all, exc)

    def _drain_inbox(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return outputs
            if msg[0] == "add":
                self._add(msg[1])
            elif msg[0] == "abort":
                out = self.engine.abort_request(msg[1])
                if out is not None:
                    outputs.append(out)
                self._resolve(msg[2])
            else:
                self._resolve(msg[1])

    def _add(self, request: Request) -> None:
        try:
            self.engine.enqueue(request)
        except InvalidRequestError as exc:
            self._loop.call_soon_threadsafe(self._deliver_error, request.request_id, exc)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(exc)

    def _resolve(self, fut: asyncio.Future | None) -> None:
        if fut is not None:
            self._loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))
