"""OpenAI-compatible plaintext endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Request path (cheap checks first, the engine last)::

    auth (401) → privacy mode (403) → draining (503) → requests/min + concurrency (429)
      → grammar compile, in a thread (response_format / guided_*; cached)
      → body checks + tokenize (400) → tokens/min (429) → record fallback → engine admission (429)
      → stream (SSE) or collect → usage + metrics → release the concurrency slot

A client that disconnects cancels its engine requests: streamed responses are cancelled by Starlette
(closing the engine's generators, which aborts them); non-streamed ones watch for the disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine import openai_api
from engine.core_client import merge_outputs
from engine.errors import EngineError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from server.errors import APIError, InvalidRequestError, NotFoundError, from_engine_error
from server.limits import TenantLimiter
from server.routers.deps import (
    PlaintextCallDep,
    admit_request,
    charge_tokens,
    get_metrics,
    record_fallback,
)
from server.routers.openai_format import ChunkBuilder, ResponseMeta, full_response, sse
from server.routers.openai_schemas import ChatCompletionRequest, CompletionRequest
from server.settings import Settings, SettingsDep
from server.tenants import Tenant, TenantDep

router = APIRouter(tags=["openai"])
log = logging.getLogger("cipherlm.server")


def served_model_name(settings: Settings, engine: Any = None) -> str:
    """The model's public name: ``served_model_name``, else the folder/file stem, else the engine's."""
    if settings.served_model_name:
        return settings.served_model_name
    if settings.model:
        return Path(settings.model).stem if settings.model.endswith(".gguf") else Path(settings.model).name
    name = getattr(engine, "model_name", None)
    return str(name) if name else "SmolLM2-135M-Instruct"


@router.get("/v1/models")
async def list_models(request: Request, _tenant: TenantDep,
                      settings: SettingsDep) -> dict[str, Any]:
    """The served model (one per server)."""
    engine = getattr(request.app.state, "engine", None)
    card = {"id": served_model_name(settings, engine), "object": "model",
            "created": request.app.state.lifecycle.started_at, "owned_by": "cipherlm"}
    max_len = _max_model_len(engine) if engine is not None else None
    if max_len:
        card["max_model_len"] = max_len
    return {"object": "list", "data": [card]}


@dataclasses.dataclass
class _Job:
    """One validated request on its way to the engine."""

    meta: ResponseMeta
    prompts: list[list[int]]
    params: SamplingParams
    tenant: Tenant
    limiter: TenantLimiter
    reserved_tokens: int
    include_usage: bool
    arrival: float


# --- validation -------------------------------------------------------------------------------------


def _max_model_len(engine: Any) -> int:
    value = getattr(engine, "max_model_len", None)
    return value if isinstance(value, int) and value > 0 else int(engine.model_config.max_position_embeddings)


def _check_unsupported(body: CompletionRequest | ChatCompletionRequest, fields: dict[str, Any]) -> None:
    with _as_400():
        openai_api.check_unsupported(fields, chat=isinstance(body, ChatCompletionRequest))


@contextlib.contextmanager
def _as_400():
    """The shared translation's errors (engine.openai_api) as 400s naming the field."""
    try:
        yield
    except openai_api.OpenAIRequestError as exc:
        raise InvalidRequestError(str(exc), param=exc.param) from exc


def _check_model(body: CompletionRequest | ChatCompletionRequest, settings: Settings, engine: Any) -> str:
    name = served_model_name(settings, engine)
    if body.model not in (None, "", name):
        raise NotFoundError(f"the model {body.model!r} does not exist; this server serves {name!r}",
                            param="model", code="model_not_found")
    return name


def _tokenize(body: CompletionRequest | ChatCompletionRequest, engine: Any,
              settings: Settings) -> list[list[int]]:
    """Prompt token ids, one list per prompt (chat: the rendered template)."""
    tok = engine.tokenizer
    if isinstance(body, ChatCompletionRequest):
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        return [tok.apply_chat_template(messages)]
    p = body.prompt
    if isinstance(p, str):
        prompts = [tok.encode(p)]
    elif isinstance(p[0], str):
        prompts = [tok.encode(s) for s in p]
    elif isinstance(p[0], int):
        prompts = [list(p)]
    else:
        prompts = [list(ids) for ids in p]
    if len(prompts) > settings.max_prompts_per_request:
        raise InvalidRequestError(f"at most {settings.max_prompts_per_request} prompts per request",
                                  param="prompt")
    vocab = engine.model_config.vocab_size
    if any(ids and (min(ids) < 0 or max(ids) >= vocab) for ids in prompts):  # ints (pydantic / tokenizer)
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
    return prompts


def _max_tokens(body: CompletionRequest | ChatCompletionRequest, tenant: Tenant, room: int,
                fields: dict[str, Any]) -> int:
    """The request's max_tokens (chat default: what fits the context, capped), checked against limits."""
    with _as_400():
        return openai_api.resolve_max_tokens(fields, chat=isinstance(body, ChatCompletionRequest),
                                             room=room, cap=tenant.limits.max_tokens)


def _check_context(prompts: list[list[int]], max_tokens: int, tenant: Tenant, engine: Any) -> None:
    limit = _max_model_len(engine)
    if tenant.limits.max_context_tokens:
        limit = min(limit, tenant.limits.max_context_tokens)
    longest = max(len(p) for p in prompts)
    if longest + max_tokens > limit:
        raise InvalidRequestError(
            f"this model's context is {limit} tokens; the prompt has {longest} "
            f"and max_tokens is {max_tokens}",
            param="max_tokens", code="context_length_exceeded")


def _sampling_params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                     engine: Any = None, fields: dict[str, Any] | None = None) -> SamplingParams:
    """Translate OpenAI fields (+ vLLM extras) to the engine's SamplingParams (400 on bad values)."""
    fields = dict(body) if fields is None else fields
    with _as_400():
        grammars = _grammars(engine) if openai_api.structured_spec(fields) else None
        return openai_api.sampling_params(fields, chat=isinstance(body, ChatCompletionRequest),
                                          max_tokens=max_tokens, grammars=grammars)


def _grammars(engine: Any):
    """The engine's grammar compiler (None: an engine without a tokenizer cannot constrain text)."""
    if getattr(engine, "tokenizer", None) is None:
        return None
    from engine import structured

    return structured.model_compiler(engine.tokenizer, engine.model_config)


async def _compile_ahead(fields: dict[str, Any], engine: Any) -> None:
    """Compile the body's grammar in a worker thread, so that ``_prepare`` finds it in the compiler's cache
    and the event loop never compiles; errors are left for ``_prepare`` to report (the SDK's order)."""
    from engine.structured import GrammarError

    try:
        spec = openai_api.structured_spec(fields)
    except openai_api.OpenAIRequestError:
        return
    if spec is None:
        return
    grammars = await asyncio.to_thread(_grammars, engine)  # the first one reads the vocabulary (~0.3 s)
    if grammars is not None:
        with contextlib.suppress(GrammarError):
            await asyncio.to_thread(grammars.compile, spec)


def _prepare(body, request: Request, tenant: Tenant, limiter: TenantLimiter, settings: Settings,
             engine: Any, fields: dict[str, Any]) -> _Job:
    """Validate, tokenize and reserve tokens; every failure here is a 4xx. ``fields``: ``dict(body)``, made
    once per request (pydantic yields the ~40 fields one by one; five checks read them)."""
    _check_unsupported(body, fields)
    model = _check_model(body, settings, engine)
    if body.n > settings.max_n:
        raise InvalidRequestError(f"n must be <= {settings.max_n}", param="n")
    try:
        prompts = _tokenize(body, engine, settings)
    except (APIError, EngineError):
        raise
    except Exception as exc:  # a bug: log it, and never show the library's message to the client
        log.exception("tokenizing a %s request failed", type(body).__name__)
        raise APIError("internal server error") from exc
    with _as_400():   # pydantic checked the same fields already; kept so the order is the SDK's
        openai_api.check_fields(fields, chat=isinstance(body, ChatCompletionRequest))
    room = _max_model_len(engine) - max(len(p) for p in prompts)
    max_tokens = _max_tokens(body, tenant, max(room, 1), fields)
    _check_context(prompts, max_tokens, tenant, engine)
    params = _sampling_params(body, max_tokens, engine, fields)
    reserved = sum(len(p) for p in prompts) + len(prompts) * body.n * max_tokens
    charge_tokens(request, tenant, limiter, reserved)
    chat = isinstance(body, ChatCompletionRequest)
    meta = ResponseMeta(id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, created=int(time.time()),
                        model=model, n=body.n, chat=chat, logprobs=params.logprobs)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return _Job(meta, prompts, params, tenant, limiter, reserved, include_usage, time.monotonic())


# --- engine streams ---------------------------------------------------------------------------------


async def _start(engine: Any, job: _Job) -> list[tuple[RequestOutput, AsyncIterator[RequestOutput]]]:
    """Submit every prompt and wait for its first output, so admission errors are still HTTP errors."""
    gens: list[tuple[str, AsyncIterator[RequestOutput]]] = []
    try:
        for i, ids in enumerate(job.prompts):
            rid = f"{job.meta.id}-{i}"
            gens.append((rid, engine.generate(ids, job.params, rid, cache_salt=job.tenant.cache_salt,
                                              priority=job.tenant.priority)))
    except BaseException:
        await _abort_all(engine, gens)
        raise
    firsts = await asyncio.gather(*(anext(g) for _, g in gens), return_exceptions=True)
    errors = [f for f in firsts if isinstance(f, BaseException)]
    if errors:
        for _, g in gens:
            await g.aclose()
        raise errors[0]
    return list(zip(firsts, (g for _, g in gens), strict=True))


async def _abort_all(engine: Any, gens: list[tuple[str, AsyncIterator[RequestOutput]]]) -> None:
    """Abort admitted requests whose streams were never iterated (and drain them, freeing the streams)."""
    for rid, gen in gens:
        await engine.abort(rid)
        async with contextlib.aclosing(gen):
            async for _ in gen:
                pass


async def _one_stream(index: int, first: RequestOutput, gen, queue: asyncio.Queue) -> None:
    try:
        async with contextlib.aclosing(gen):
            await queue.put((index, first))
            async for out in gen:
                await queue.put((index, out))
    except Exception as exc:  # noqa: BLE001 - handed to the merged stream, which raises it
        await queue.put((index, exc))
        return
    await queue.put((index, None))


async def _merged(started) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every prompt's stream as they come; cancelling aborts them all."""
    if len(started) == 1:
        first, gen = started[0]
        async with contextlib.aclosing(gen):
            yield 0, first
            async for out in gen:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_one_stream(i, f, g, queue)) for i, (f, g) in enumerate(started)]
    try:
        live = len(tasks)
        while live:
            index, out = await queue.get()
            if out is None:
                live -= 1
                continue
            if isinstance(out, BaseException):
                raise out  # one prompt's stream failed (the engine went away, a cut): the response fails
            yield index, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _interrupt(started):
    """A callable that ends every prompt's engine stream with an error (a drain's cut), or None when the
    engine's streams cannot be interrupted (then ``until_cut`` races each item against the cut)."""
    interrupts = [getattr(gen, "interrupt", None) for _, gen in started]
    if not interrupts or None in interrupts:
        return None

    def interrupt(exc: BaseException) -> None:
        for each in interrupts:
            each(exc)

    return interrupt


class _Timing:
    """Server-side TTFT / ITL / e2e of one request, into the metrics; at its end, from the engine's timestamps,
    how long each prompt waited for its first step and how long its first token took to reach the stream."""

    def __init__(self, job: _Job, metrics) -> None:
        self.job, self.metrics = job, metrics
        self.labels = (job.tenant.id, metrics.model_name)
        self.last: float | None = None
        self._itl = None  # the ITL histogram's child for these labels, looked up once
        self.first_seen: dict[str, float] = {}  # request id -> time.time() its first token reached the stream

    def tick(self, out: RequestOutput) -> None:
        if not any(c.delta_token_ids for c in out.outputs):
            return
        now = time.monotonic()
        if out.request_id not in self.first_seen:
            self.first_seen[out.request_id] = time.time()  # the engine's clock, for the delivery time
        if self.last is None:
            self.metrics.ttft.labels(*self.labels).observe(now - self.job.arrival)
            self._itl = self.metrics.itl.labels(*self.labels)
        else:
            self._itl.observe(now - self.last)
        self.last = now

    def finish(self, finals: list[RequestOutput]) -> None:
        self.metrics.e2e.labels(*self.labels).observe(time.monotonic() - self.job.arrival)
        done = [r for r in finals if r is not None]
        for r in done:  # the rest of a TTFT: the API before the engine, and the prompt's own steps
            m, seen = r.metrics, self.first_seen.get(r.request_id)
            if m is not None and m.first_scheduled_time is not None:
                self.metrics.queue_time.labels(*self.labels).observe(m.first_scheduled_time - m.arrival_time)
            if m is not None and m.first_token_time is not None and seen is not None:
                self.metrics.first_token_delivery.labels(*self.labels).observe(max(0.0, seen - m.first_token_time))
        self.metrics.record_finished(
            self.job.tenant.id, sum(len(r.prompt_token_ids) for r in done),
            sum(len(c.token_ids) for r in done for c in r.outputs),
            sum(r.num_cached_tokens or 0 for r in done),
            [c.finish_reason or "abort" for r in done for c in r.outputs])


def _settle(job: _Job, finals: list[RequestOutput | None]) -> None:
    """Refund unused reserved tokens and free the concurrency slot."""
    used = sum(len(r.prompt_token_ids) + sum(len(c.token_ids) for c in r.outputs) for r in finals if r)
    job.limiter.refund_tokens(job.reserved_tokens - used)
    job.limiter.release()


class _LogprobAccumulator:
    """Collects per-token logprobs across snapshots (the engine reports them per new token)."""

    def __init__(self) -> None:
        self.by_choice: dict[tuple[int, int], list[dict[int, float]]] = {}

    def add(self, index: int, out: RequestOutput) -> None:
        for c in out.outputs:
            if c.logprobs:
                self.by_choice.setdefault((index, c.index), []).extend(c.logprobs)

    def apply(self, finals: list[RequestOutput]) -> None:
        for i, r in enumerate(finals):
            for c in r.outputs:
                c.logprobs = self.by_choice.get((i, c.index), [] if c.logprobs is not None else None)


# --- responses --------------------------------------------------------------------------------------


async def _collect(job: _Job, started, timing: _Timing, logprobs: bool, lifecycle) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(started)
    acc = _LogprobAccumulator()
    async for index, out in lifecycle.until_cut(_merged(started), _interrupt(started)):  # SIGTERM: 503
        timing.tick(out)
        if logprobs:
            acc.add(index, out)
        finals[index] = out
    if logprobs:
        acc.apply(finals)
    return finals


async def _until_disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.5)


async def _respond_full(request: Request, job: _Job, started, decode) -> JSONResponse:
    """Collect every output; a client disconnect cancels (and so aborts) the engine requests."""
    timing = _Timing(job, get_metrics(request))
    collect = asyncio.create_task(_collect(job, started, timing, job.meta.logprobs is not None,
                                           request.app.state.lifecycle))
    watch = asyncio.create_task(_until_disconnected(request))
    finals: list[RequestOutput | None] = [None] * len(started)
    try:
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not collect.done():
            collect.cancel()
            await asyncio.gather(collect, return_exceptions=True)
            return JSONResponse({}, status_code=499)  # nobody is listening
        finals = collect.result()
    finally:
        watch.cancel()
        if not collect.done():
            collect.cancel()
        _settle(job, finals)
    timing.finish(finals)
    return JSONResponse(full_response(job.meta, finals, decode))


async def _event_stream(request: Request, job: _Job, started, decode, state: dict,
                        interval: int = 1) -> AsyncIterator[bytes]:
    """SSE body; cancelled by Starlette when the client goes away (which aborts the engine requests).

    One chunk per completion per engine output taken: the engine stream hands over everything that arrived
    since the last one merged (so a client that is behind gets several steps' tokens in one chunk), and
    with ``interval`` > 1 a completion's tokens wait until that many have come (``stream_interval``)."""
    state["started"] = True
    if interval > 1:
        for _, gen in started:  # the engine's stream skips wake-ups that could not make a chunk
            if hasattr(gen, "coalesce"):
                gen.coalesce(interval)
    timing = _Timing(job, get_metrics(request))
    builder = ChunkBuilder(job.meta, decode)
    finals: list[RequestOutput | None] = [None] * len(started)
    held: dict[int, RequestOutput] = {}  # stream_interval: a prompt's outputs not sent yet
    try:
        for chunk in builder.first_chunks(len(started)):
            yield sse(chunk)
        lifecycle = request.app.state.lifecycle
        async for index, out in lifecycle.until_cut(_merged(started), _interrupt(started)):  # SIGTERM cuts
            timing.tick(out)
            finals[index] = out
            if interval > 1 and (out := _hold(held, index, out, interval)) is None:
                continue
            frame = builder.frames(index, out)
            if frame:
                yield frame
        if job.include_usage:
            yield sse(builder.usage_chunk(finals))
        yield sse("[DONE]")
        timing.finish(finals)
    except Exception as exc:  # headers are gone: report in-band, as OpenAI does
        yield sse(exc.body() if isinstance(exc, APIError) else from_engine_error(exc).body())
    finally:
        _settle(job, finals)


def _hold(held: dict[int, RequestOutput], index: int, out: RequestOutput, interval: int) -> RequestOutput | None:
    """``out`` joined to what prompt ``index`` held back, or None while every completion that moved has
    fewer than ``interval`` new tokens (a first token, a finish and a logprobs-free empty delta never wait)."""
    prev = held.pop(index, None)
    if prev is not None:
        out = merge_outputs(prev, out)
    first = all(len(c.token_ids) == len(c.delta_token_ids) for c in out.outputs)
    if out.finished or first or any(c.finished or len(c.delta_token_ids) >= interval for c in out.outputs):
        return out
    held[index] = out
    return None


class _GuardedStream(StreamingResponse):
    """A streaming response that always closes its body generator when the response ends, and frees the
    slot and aborts the engine requests itself when the client left before the generator ever ran
    (Starlette then never starts it, so the generator's own ``finally`` cannot run)."""

    def __init__(self, content, state: dict, job: _Job, started, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._state, self._job, self._started = state, job, started

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self._stream_until_disconnect(receive, send)
        finally:
            await self.body_iterator.aclose()  # runs the generator's cleanup now, not at GC time
            if not self._state["started"]:
                for _, gen in self._started:
                    await gen.aclose()
                _settle(self._job, [None] * len(self._started))

    async def _stream_until_disconnect(self, receive, send) -> None:
        """Send the body; a client disconnect cancels it (and so aborts the engine requests).

        Starlette does the same under ASGI < 2.4 (uvicorn says 2.3) with an anyio task group per response:
        a cancel scope, the body in a second task, task names looked up: 1-2 of the API process's ~25 µs of
        CPU per token at 256 streamed users of 128 tokens (bench/serve_api_cpu.py, CPU). Here the body runs
        in this task and one plain task listens, cancelling this one if the client goes away first."""
        task = asyncio.current_task()
        state = {"done": False, "gone": False}

        async def listen() -> None:
            with contextlib.suppress(Exception):  # a receive that breaks: the client is as good as gone
                while (await receive())["type"] != "http.disconnect":
                    pass
            if not state["done"]:  # this task is suspended inside the body: the cancel lands there
                state["gone"] = True
                task.cancel()

        listener = asyncio.create_task(listen())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not state["gone"] or task.uncancel() > 0:  # someone else's cancel (too): let it through
                raise
        finally:
            state["done"] = True
            listener.cancel()


async def _serve(body, request: Request, tenant: Tenant, settings: Settings, engine: Any, endpoint: str):
    limiter = admit_request(request, tenant)  # in the handler: a body that fails validation takes no slot
    job: _Job | None = None
    try:
        fields = dict(body)
        await _compile_ahead(fields, engine)
        job = _prepare(body, request, tenant, limiter, settings, engine, fields)
        if request.state.fallback:
            record_fallback(request, tenant, job.meta.id, endpoint)
        started = await _start(engine, job)
    except BaseException:
        if job is not None:  # refused after its tokens were reserved (fallback not recorded, engine full)
            limiter.refund_tokens(job.reserved_tokens)
        limiter.release()
        raise
    decode = _token_decoder(engine)
    if body.stream:
        state = {"started": False}
        stream = _event_stream(request, job, started, decode, state, settings.stream_interval)
        return _GuardedStream(stream, state, job, started,
                              media_type="text/event-stream",
                              headers={"Cache-Control": "no-cache", "X-Request-Id": job.meta.id})
    return await _respond_full(request, job, started, decode)


def _token_decoder(engine: Any):
    tok = engine.tokenizer

    def decode(token_id: int) -> str:
        return tok.decode([token_id], skip_special_tokens=False)

    return decode


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request, call: PlaintextCallDep):
    """Text completion (OpenAI's legacy completions API), streamed with ``stream: true``."""
    return await _serve(body, request, call.tenant, call.settings, call.engine, "/v1/completions")


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request, call: PlaintextCallDep):
    """Chat completion with the model's chat template, streamed with ``stream: true``."""
    return await _serve(body, request, call.tenant, call.settings, call.engine, "/v1/chat/completions")
