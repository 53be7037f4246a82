"""The engine core in its own process: :class:`LLMEngine` stepping behind a pipe (vLLM v1's EngineCore).

The API process (``engine.core_client.ProcessAsyncLLM``) keeps the event loop, tokenization and SSE
framing; this process keeps the model, the scheduler, sampling and detokenization, so neither waits on
the other's interpreter. Per step the core sends **one** message holding every request's progress as
plain tuples (deltas only: the client rebuilds the cumulative token ids and text), the step's gauges, the
finished requests' latency records and the acknowledgements of control messages -- one pickle per step,
never one per token per request.

Messages, client → core: ``("add", Request)``, ``("abort", request_id, token)``, ``("sync", token)``,
``("stop",)``. Core → client: ``("ready", CoreInfo)`` once, then ``("step", StepBatch)``; ``("failed",
repr)`` if building the engine or a step raised (the client fails every stream with it).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import socket
import struct
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.errors import InvalidRequestError
from engine.metrics import EngineStats, RequestStats
from engine.outputs import RequestMetrics, RequestOutput
from engine.tokenizer import Tokenizer

IDLE_POLL_S = 0.5  # an idle core blocks on the pipe this long between checks of its parent
MAX_DEFERRED_FRAMES = 512  # step batches queued for a reader that is behind (~10 MB at 256 rows) before sends wait

# One completion's progress in a step: (index, delta_text, delta_token_ids, logprobs, finish_reason,
# stop_reason); one request's: (request_id, finished, num_cached_tokens, metrics-if-finished, completions).
CompletionDelta = tuple[int, str, list[int], list | None, str | None, str | int | None]
RequestDelta = tuple[str, bool, int, RequestMetrics | None, list[CompletionDelta]]


@dataclasses.dataclass
class CoreSpec:
    """How the core builds its engine: a model folder / .gguf file, or an already loaded model."""

    config: EngineConfig
    path: str | None = None
    model: Any = None            # LlamaForCausalLM (pickled to the child: CPU tensors, shared memory)
    tokenizer: Tokenizer | None = None
    # () -> EngineParts, a module-level function (it is pickled to the child): injected parts, e.g. the
    # model-free executor with which bench/serve_api_cpu.py measures the API process alone
    parts: Any = None
    coalesce_streams: int = 0  # the engine's delta_coalescing (ProcessAsyncLLM.load_coalescing at the start)

    def build(self):
        from engine.llm_engine import LLMEngine

        parts = self.parts() if self.parts is not None else None
        if self.path is not None:
            return LLMEngine.from_pretrained(Path(self.path), self.config, parts)
        return LLMEngine(self.model, self.tokenizer, self.config, parts)


@dataclasses.dataclass
class CoreInfo:
    """What the API process needs to validate and tokenize without asking the core."""

    model_config: ModelConfig
    tokenizer: Tokenizer | None
    max_model_len: int
    stats: EngineStats


@dataclasses.dataclass
class StepBatch:
    """Everything one core iteration produced.

    Attributes:
        outputs: per request that progressed, its deltas.
        stats: gauges after the step (None: no step ran).
        finished: latency records of the requests that ended.
        acks: tokens of the abort / sync messages handled before the step.
        adds_seen: "add" messages handled so far; with ``num_unscheduled`` the client bounds its queue.
        num_unscheduled: admitted requests not yet scheduled.
        add_errors: (request_id, error) of adds the engine refused.
    """

    outputs: list[RequestDelta]
    stats: EngineStats | None
    finished: list[RequestStats]
    acks: list[int]
    adds_seen: int
    num_unscheduled: int
    add_errors: list[tuple[str, Exception]]


def encode(out: RequestOutput) -> RequestDelta:
    """A request output without its cumulative fields (the client has the earlier deltas)."""
    comps = [(c.index, c.delta_text, c.delta_token_ids, c.logprobs, c.finish_reason, c.stop_reason)
             for c in out.outputs]
    return out.request_id, out.finished, out.num_cached_tokens, out.metrics if out.finished else None, comps


class _Collector:
    """The core's metrics listener: keeps finished-request records for the next batch."""

    def __init__(self) -> None:
        self.finished: list[RequestStats] = []

    def on_request_finished(self, stats: RequestStats) -> None:
        self.finished.append(stats)

    def on_step(self, stats: EngineStats) -> None:
        pass


class _Outbox:
    """The core's writes to the pipe, which never wait for the API process.

    A message goes straight into the socket when it takes the whole frame (the common case: no thread, no
    GIL handoff); when the API process is behind and the socket's buffer (~200 KB, about ten 256-row step
    batches) is full, the rest of that frame and every later one go to a writer thread, in order, and the
    core keeps stepping. Before, ``conn.send`` blocked the core until the API read: a burst of new HTTP
    requests in the API process (hundreds of users finishing together) held the engine's steps up. Frames
    are multiprocessing's (``engine.core_client._frame`` reads them). Where the pipe is no socket (Windows)
    every message is a plain blocking ``conn.send``."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._sock: socket.socket | None = None
        if hasattr(socket, "MSG_DONTWAIT"):
            fd = os.dup(conn.fileno())
            try:
                self._sock = socket.socket(fileno=fd)
            except OSError:  # not a socket (a one-way pipe): blocking sends
                os.close(fd)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0          # frames queued for the writer thread, not yet fully written
        self._thread: threading.Thread | None = None
        self.deferred = 0          # frames the socket did not take at once (the API process was behind)

    def send(self, msg: tuple) -> None:
        if self._sock is None:
            self.conn.send(msg)
            return
        data = ForkingPickler.dumps(msg)
        n = len(data)
        frame = (struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)) + bytes(data)
        with self._lock:
            if not self._pending:
                try:
                    sent = self._sock.send(frame, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                if sent == len(frame):
                    return
                frame = frame[sent:]
            self._pending += 1
            self.deferred += 1
        while self._pending > MAX_DEFERRED_FRAMES:  # a reader gone quiet: bound the core's memory
            time.sleep(0.001)
        if self._thread is None:
            self._thread = threading.Thread(target=self._write, name="cipherlm-core-out", daemon=True)
            self._thread.start()
        self._queue.put(frame)

    def _write(self) -> None:
        while (frame := self._queue.get()) is not None:
            try:
                self._sock.sendall(frame)
            except OSError:
                return  # the API process is gone; the core's next receive sees it
            with self._lock:
                self._pending -= 1

    def close(self) -> None:
        """Write out what is queued (before a final message or the process's exit)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class EngineCore:
    """The loop of the core process: handle control messages, step, send one batch."""

    def __init__(self, engine, conn: Connection) -> None:
        self.engine, self.conn = engine, conn
        self.outbox = _Outbox(conn)
        engine.output_processor.cumulative = False  # the client rebuilds token_ids and text from the deltas
        engine.emit_deltas = True  # streamed progress comes as wire tuples (finished requests: RequestOutput)
        self.collector = _Collector()
        engine.listeners.append(self.collector)
        self.adds_seen = 0
        self.stopping = False

    def run(self) -> None:
        while not self.stopping:
            acks, errors, outputs = self._drain(block=not self.engine.has_unfinished_requests())
            if self.engine.has_unfinished_requests() and not self.stopping:
                outputs += self.engine.step()
            stats = self.engine.stats() if outputs or acks or errors or self.collector.finished else None
            if stats is not None or acks:
                self._send(outputs, stats, acks, errors)

    def _send(self, outputs: list, stats, acks: list[int], errors) -> None:
        finished, self.collector.finished = self.collector.finished, []
        deltas = [o if type(o) is tuple else encode(o) for o in outputs]  # tuples: emit_deltas' own
        batch = StepBatch(deltas, stats, finished, acks, self.adds_seen, self.engine.num_waiting_requests,
                          errors)
        self.outbox.send(("step", batch))

    def _drain(self, block: bool) -> tuple[list[int], list, list[RequestOutput]]:
        """Handle every waiting message (waiting for one when idle); abort outputs join the step's."""
        acks: list[int] = []
        errors: list[tuple[str, Exception]] = []
        outputs: list[RequestOutput] = []
        if block and not self.conn.poll(IDLE_POLL_S):
            return acks, errors, outputs
        while self.conn.poll():
            msg = self.conn.recv()
            kind = msg[0]
            if kind == "add":
                self._add(msg[1], errors)
            elif kind == "abort":
                out = self.engine.abort_request(msg[1])
                if out is not None:
                    outputs.append(out)
                acks.append(msg[2])
            elif kind == "coalesce":  # ProcessAsyncLLM.load_coalescing, set after the start
                self.engine.delta_coalescing = msg[1]
            elif kind == "sync":
                acks.append(msg[1])
            elif kind == "stop":
                self.stopping = True
                break
        return acks, errors, outputs

    def _add(self, request, errors: list) -> None:
        self.adds_seen += 1
        engine = self.engine
        with engine._admission:  # the client admitted it; count it as the engine's make_request would
            engine._num_unscheduled += 1
        try:
            engine.enqueue(request)
        except InvalidRequestError as exc:
            errors.append((request.request_id, exc))


def _exit_now() -> None:
    """Leave without the interpreter's teardown (torch's takes ~1 s; a stopped core has nothing to
    flush but its streams), so a SIGTERM drain is not held up by the core's exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def core_main(conn: Connection, spec: CoreSpec) -> None:
    """Entry point of the core process."""
    try:
        engine = spec.build()
        if engine.tokenizer is not None:
            from engine import structured

            structured.bind_process_model(engine.tokenizer, engine.model_config)
        conn.send(("ready", CoreInfo(engine.model_config, engine.tokenizer, engine.max_model_len,
                                     engine.stats())))
        engine.delta_coalescing = spec.coalesce_streams
        core = EngineCore(engine, conn)
        try:
            core.run()
        finally:
            core.outbox.close()  # every step batch written before a "failed" message or the exit
        conn.close()
        _exit_now()
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return  # the API process went away: nothing to report to
    except BaseException as exc:  # noqa: BLE001 - the client must learn why every stream ends
        try:
            conn.send(("failed", repr(exc)))
        except (OSError, ValueError):
            pass
    finally:
        conn.close()
