"""The OpenAI-style surface of an encrypted-mode client: bodies in, completion objects out.

The body goes through the same translation as the server's (:mod:`engine.openai_api`: fields,
defaults, validation), the generation through :class:`client_sdk._runtime.PrivateRuntime` (the engine's
forward, sampler and output processor), and each token's delta becomes the same chunk the server's
stream would carry.

Two thin drivers: :func:`private_call` for the blocking :class:`~client_sdk.Client` (its ``_exchange``
performs the runtime's calls), :func:`async_private_call` for :class:`~client_sdk.AsyncClient`: the
CPU-bound runtime (local layers, CKKS) runs in a worker thread and each of its calls is sent by the
AsyncClient's own httpx client on the caller's event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

from client_sdk._exceptions import PrivateModeError
from client_sdk._protocol import Call, Reply
from client_sdk._runtime import PrivateRuntime, PrivateToken, StepStats
from client_sdk._types import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatMessage,
    ChoiceDelta,
    Completion,
    CompletionChoice,
    Usage,
)

__all__ = ["PrivateModeError", "PrivateRuntime", "PrivateStream", "PrivateToken", "StepStats",
           "async_private_call", "private_call"]


@dataclasses.dataclass
class _Job:
    """One validated request: prompt ids, engine parameters, response shape."""

    ids: list[int]
    params: Any
    chat: bool
    model: str
    include_usage: bool


def prepare_job(runtime: PrivateRuntime, path: str, body: dict[str, Any]) -> _Job:
    """Tokenize and translate ``body`` exactly as the server would (``PrivateModeError`` naming the field)."""
    from engine import openai_api
    from engine.errors import InvalidRequestError

    runtime.prepare()
    chat = path.endswith("/chat/completions")
    try:
        openai_api.check_unsupported(body, chat=chat)
        openai_api.check_fields(body, chat=chat)   # field errors before limit errors, as the server's schema
        ids = _prompt_ids(runtime, body, chat)
        room = runtime.max_len() - len(ids)
        max_tokens = openai_api.resolve_max_tokens(body, chat=chat, room=room, cap=runtime.tenant_max_tokens())
        params = openai_api.sampling_params(body, chat=chat, max_tokens=max_tokens)
    except openai_api.OpenAIRequestError as exc:
        raise PrivateModeError(str(exc), param=exc.param) from exc
    except InvalidRequestError as exc:
        raise PrivateModeError(str(exc), param="prompt" if not chat else "messages") from exc
    if params.n != 1:
        raise PrivateModeError("n > 1 is not supported in encrypted mode", param="n")
    if len(ids) + max_tokens > runtime.max_len():
        raise PrivateModeError(f"this session's context is {runtime.max_len()} tokens; the prompt has "
                               f"{len(ids)} and max_tokens is {max_tokens}", param="max_tokens")
    options = body.get("stream_options") or {}
    return _Job(ids, params, chat, runtime.manifest.model, bool(options.get("include_usage")))


def _prompt_ids(runtime: PrivateRuntime, body: dict[str, Any], chat: bool) -> list[int]:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise PrivateModeError("messages must be a non-empty list", param="messages")
        return runtime.tokenizer.apply_chat_template([_message(m) for m in messages])
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise PrivateModeError("encrypted mode takes one non-empty string prompt", param="prompt")
    return runtime.tokenizer.encode(prompt)


def _message(m: Any) -> dict[str, str]:
    """A chat message with its content as one string (text parts joined, as the server does)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise PrivateModeError("each message needs a role", param="messages")
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return {"role": m["role"], "content": content or ""}


# --- tokens -> the server's chunk shapes ------------------------------------------------------------


class _Chunks:
    """Turns the runtime's tokens into the chunks the server's stream would carry, and the usage."""

    def __init__(self, runtime: PrivateRuntime, job: _Job) -> None:
        self.rt, self.job = runtime, job
        self.id = ("chatcmpl-priv-" if job.chat else "cmpl-priv-") + f"{time.time_ns():x}"
        self.created = int(time.time())
        self.tokens: list[PrivateToken] = []

    def __iter__(self) -> Iterator[Any]:
        if self.job.chat:  # the server's opening chunk announces the role
            yield ChatCompletionChunk(self.id, self.created, self.job.model,
                                      [ChatChunkChoice(0, ChoiceDelta("assistant", ""))])
        for tok in self.rt.generate(self.job.ids, self.job.params):
            self.tokens.append(tok)
            yield self._chunk(tok)
        if self.job.include_usage:
            cls = ChatCompletionChunk if self.job.chat else Completion
            yield cls(self.id, self.created, self.job.model, [], self.usage())

    def _chunk(self, tok: PrivateToken) -> Any:
        lps = self._logprobs([tok])
        if self.job.chat:
            delta = ChoiceDelta(None, tok.text or None)
            return ChatCompletionChunk(self.id, self.created, self.job.model,
                                       [ChatChunkChoice(0, delta, tok.finish_reason, lps)])
        choice = CompletionChoice(0, tok.text, tok.finish_reason, lps)
        return Completion(self.id, self.created, self.job.model, [choice])

    def _logprobs(self, toks: list[PrivateToken]) -> dict[str, Any] | None:
        from engine import openai_api

        k = self.job.params.logprobs
        if k is None:
            return None
        ids, lps = [t.token_id for t in toks], [t.logprobs or {} for t in toks]
        if self.job.chat:
            return openai_api.chat_logprobs(ids, lps, k, self._decode)
        return openai_api.completion_logprobs(ids, lps, k, self._decode)

    def _decode(self, token_id: int) -> str:
        return self.rt.tokenizer.decode([token_id], skip_special_tokens=False)

    def usage(self) -> Usage:
        n = len(self.tokens)
        return Usage(len(self.job.ids), n, len(self.job.ids) + n)

    def full(self) -> Any:
        """The non-streamed response, after iterating."""
        text = "".join(t.text for t in self.tokens)
        finish = self.tokens[-1].finish_reason if self.tokens else None
        lps = self._logprobs(self.tokens)
        if self.job.chat:
            choice = ChatChoice(0, ChatMessage("assistant", text), finish, lps)
            return ChatCompletion(self.id, self.created, self.job.model, [choice], self.usage())
        return Completion(self.id, self.created, self.job.model, [CompletionChoice(0, text, finish, lps)],
                          self.usage())


# --- blocking driver --------------------------------------------------------------------------------


class PrivateStream:
    """Iterator of completion chunks from a private generation (same surface as ``Stream``)."""

    def __init__(self, chunks: Iterator[Any]) -> None:
        self._chunks = chunks

    def __iter__(self) -> Iterator[Any]:
        return self._chunks

    def __next__(self) -> Any:
        return next(self._chunks)

    def close(self) -> None:
        """Stop the generation (its server session is closed)."""
        self._chunks.close()

    def __enter__(self) -> PrivateStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def runtime_of(client: Any) -> PrivateRuntime:
    """The client's private runtime (created on first use)."""
    if getattr(client, "_private", None) is None:
        client._private = PrivateRuntime(client, key_store=client.key_store)
    return client._private


def private_call(client: Any, path: str, body: dict[str, Any], stream: bool) -> Any:
    """Serve ``POST path`` (completions or chat) privately for a blocking ``Client``."""
    runtime = runtime_of(client)
    chunks = _Chunks(runtime, prepare_job(runtime, path, body))
    if stream:
        return PrivateStream(iter(chunks))
    for _ in chunks:
        pass
    return chunks.full()


# --- asyncio driver ---------------------------------------------------------------------------------


class _LoopDriver:
    """What the runtime sees of an ``AsyncClient``: ``_exchange`` runs in the runtime's worker thread and
    has the client send the call on its event loop (the AsyncClient's own connection pool)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.timeout, self.progress, self.key_store = client.timeout, client.progress, client.key_store
        self.loop: asyncio.AbstractEventLoop | None = None

    def _exchange(self, call: Call) -> Reply:
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(self.client._aexchange(call), self.loop).result()


def _async_runtime(client: Any) -> PrivateRuntime:
    driver = getattr(client, "_private_driver", None)
    if driver is None:
        driver = client._private_driver = _LoopDriver(client)
        client._private = PrivateRuntime(driver, key_store=client.key_store)
    driver.loop = asyncio.get_running_loop()
    return client._private


class AsyncPrivateStream:
    """Async iterator over a private generation: each chunk is computed in a worker thread."""

    def __init__(self, chunks: Iterator[Any]) -> None:
        self._chunks = chunks

    def __aiter__(self) -> AsyncPrivateStream:
        return self

    async def __anext__(self) -> Any:
        chunk = await asyncio.to_thread(next, self._chunks, None)
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    async def close(self) -> None:
        """Stop the generation (its server session is closed)."""
        await asyncio.to_thread(self._chunks.close)

    async def __aenter__(self) -> AsyncPrivateStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def async_private_call(client: Any, path: str, body: dict[str, Any], stream: bool) -> Any:
    """Serve ``POST path`` privately for an ``AsyncClient`` (bytes sent by the AsyncClient itself)."""
    runtime = _async_runtime(client)
    job = await asyncio.to_thread(prepare_job, runtime, path, body)
    chunks = _Chunks(runtime, job)
    result = AsyncPrivateStream(iter(chunks))
    if stream:
        return result
    async with result:
        async for _ in result:
            pass
    return chunks.full()


async def aclose_private(client: Any) -> None:
    """Close the AsyncClient's open private session, if any."""
    runtime = getattr(client, "_private", None)
    if runtime is not None and runtime.session is not None:
        _async_runtime(client)
        await asyncio.to_thread(runtime.close_session)
