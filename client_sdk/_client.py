"""``Client`` (blocking) and ``AsyncClient`` (asyncio) on httpx, OpenAI-style.

    client = Client(api_key="clm-...", base_url="http://127.0.0.1:8000")
    resp = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], max_tokens=32)
    for chunk in client.completions.create(prompt="Once", max_tokens=32, stream=True):
        print(chunk.choices[0].text, end="")
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

import httpx

from client_sdk._base import PROGRESS_CHUNK, BaseClient, chat_body, completion_body, content_length, parse_sse_line
from client_sdk._exceptions import map_transport_errors
from client_sdk._private import aclose_private, async_private_call, private_call
from client_sdk._protocol import Call, Reply
from client_sdk._types import ChatCompletion, ChatCompletionChunk, Completion, Model, TenantInfo

T = TypeVar("T")


def _params(**kw: Any) -> dict[str, Any]:
    """The OpenAI sampling fields passed to ``create`` (None = server default)."""
    return kw


class Stream(Generic[T]):
    """Iterator over the chunks of a streamed response; closes the connection when done or on ``close()``."""

    def __init__(self, response: httpx.Response, parse: Callable[[dict], T]) -> None:
        self.response = response
        self._parse = parse

    def __iter__(self) -> Iterator[T]:
        try:
            with map_transport_errors():
                for line in self.response.iter_lines():
                    event = parse_sse_line(line)
                    if event is False:
                        return
                    if event is not None:
                        yield self._parse(event)
        finally:
            self.close()

    def close(self) -> None:
        """Stop reading (the server cancels the generation)."""
        self.response.close()

    def __enter__(self) -> Stream[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncStream(Generic[T]):
    """Async iterator over the chunks of a streamed response."""

    def __init__(self, response: httpx.Response, parse: Callable[[dict], T]) -> None:
        self.response = response
        self._parse = parse

    async def __aiter__(self) -> AsyncIterator[T]:
        try:
            with map_transport_errors():
                async for line in self.response.aiter_lines():
                    event = parse_sse_line(line)
                    if event is False:
                        return
                    if event is not None:
                        yield self._parse(event)
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop reading (the server cancels the generation)."""
        await self.response.aclose()

    async def __aenter__(self) -> AsyncStream[T]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# --- blocking ---------------------------------------------------------------------------------------


class Client(BaseClient):
    """Blocking client. Use as a context manager or call :meth:`close`. Arguments: see :class:`BaseClient`,
    plus ``http_client`` (an ``httpx.Client`` to reuse, e.g. with a custom transport)."""

    def __init__(self, api_key: str | None = None, base_url: str | None = None, *,
                 http_client: httpx.Client | None = None, **kwargs: Any) -> None:
        super().__init__(api_key, base_url, **kwargs)
        self._http = http_client or httpx.Client(timeout=self.timeout.to_httpx())
        self._sleep: Callable[[float], None] = time.sleep
        self.completions = Completions(self)
        self.chat = Chat(self)
        self.models = Models(self)

    def tenant(self) -> TenantInfo:
        """The calling tenant's privacy mode, fallback policy and limits (``GET /v1/tenant``)."""
        return TenantInfo.from_dict(self._json(self._request("GET", "/v1/tenant")))

    def _request(self, method: str, path: str, *, json: Any = None, headers: dict[str, str] | None = None,
                 stream: bool = False, content: bytes | None = None, read_timeout: float | None = None,
                 progress: str | None = None) -> httpx.Response:
        """Send with retries; return a successful response (streamed bodies left unread)."""
        attempt = 0
        while True:
            try:
                request = self._build(self._http, method, path, json, headers, content, read_timeout, progress,
                                      is_async=False)
                return self._send_once(request, stream)
            except Exception as exc:
                if not self.retry.should_retry(attempt, exc):
                    raise
                self._sleep(self.retry.delay(attempt, exc, self._rand))
                attempt += 1

    def _send_once(self, request: httpx.Request, stream: bool) -> httpx.Response:
        with map_transport_errors():
            response = self._http.send(request, stream=stream)
            if response.status_code >= 400 and stream:
                response.read()
                response.close()
        self._check(response)
        return response

    def _exchange(self, call: Call) -> Reply:
        """Perform one call of the private runtime (the blocking driver)."""
        download = bool(call.progress and self.progress is not None and call.method == "GET")
        response = self._request(call.method, call.path, json=call.json, content=call.content,
                                 headers=call.headers, read_timeout=call.read_timeout, progress=call.progress,
                                 stream=download)
        if not download:
            return Reply(response.content)
        total, parts = content_length(response), []
        with map_transport_errors():
            try:
                for chunk in response.iter_bytes(PROGRESS_CHUNK):
                    parts.append(chunk)
                    self._report(call.progress, sum(map(len, parts)), total)
            finally:
                response.close()
        return Reply(b"".join(parts))

    def close(self) -> None:
        """Close the private session (if any) and the connection pool."""
        if getattr(self, "_private", None) is not None:
            self._private.close_session()
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Completions:
    """``client.completions``."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def create(self, *, prompt: str | list[str] | list[int] | list[list[int]], model: str | None = None,
               max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
               top_k: int | None = None, n: int | None = None, stop: str | list[str] | None = None,
               seed: int | None = None, logprobs: int | None = None, presence_penalty: float | None = None,
               frequency_penalty: float | None = None, stream: bool = False, include_usage: bool = False,
               non_sensitive: bool = False, extra_body: dict[str, Any] | None = None,
               ) -> Completion | Stream[Completion]:
        """Complete ``prompt``; with ``stream=True`` return a :class:`Stream` of chunks.

        ``non_sensitive=True`` marks the request non-sensitive (an encrypted tenant whose policy allows it
        is then served in plaintext, and the fallback is recorded). ``top_k`` is a cipherlm/vLLM extra.
        """
        params = _params(model=model, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                         top_k=top_k, n=n, stop=stop, seed=seed, logprobs=logprobs,
                         presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                         stream=stream or None,
                         stream_options={"include_usage": True} if stream and include_usage else None)
        return _call(self._client, "/v1/completions", completion_body(prompt, params, extra_body),
                     non_sensitive, stream, Completion.from_dict)


class ChatCompletions:
    """``client.chat.completions``."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def create(self, *, messages: Iterable[dict[str, Any]], model: str | None = None,
               max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
               top_k: int | None = None, n: int | None = None, stop: str | list[str] | None = None,
               seed: int | None = None, logprobs: bool | None = None, top_logprobs: int | None = None,
               presence_penalty: float | None = None, frequency_penalty: float | None = None,
               stream: bool = False, include_usage: bool = False, non_sensitive: bool = False,
               extra_body: dict[str, Any] | None = None) -> ChatCompletion | Stream[ChatCompletionChunk]:
        """Answer a chat; with ``stream=True`` return a :class:`Stream` of chunks (see Completions.create)."""
        params = _params(model=model, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                         top_k=top_k, n=n, stop=stop, seed=seed, logprobs=logprobs, top_logprobs=top_logprobs,
                         presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                         stream=stream or None,
                         stream_options={"include_usage": True} if stream and include_usage else None)
        parse = ChatCompletionChunk.from_dict if stream else ChatCompletion.from_dict
        return _call(self._client, "/v1/chat/completions", chat_body(messages, params, extra_body),
                     non_sensitive, stream, parse)


class Chat:
    """``client.chat`` (holds ``completions``)."""

    def __init__(self, client: Client) -> None:
        self.completions = ChatCompletions(client)


class Models:
    """``client.models``."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def list(self) -> list[Model]:
        """The served models."""
        body = self._client._json(self._client._request("GET", "/v1/models"))
        return [Model.from_dict(m) for m in body.get("data") or []]


def _call(client: Client, path: str, body: dict, non_sensitive: bool, stream: bool, parse):
    if client.privacy == "encrypted" and not non_sensitive:
        return private_call(client, path, body, stream)
    headers = client._plaintext_headers(non_sensitive)
    response = client._request("POST", path, json=body, headers=headers, stream=stream)
    if stream:
        return Stream(response, parse)
    return parse(client._json(response))


# --- asyncio ----------------------------------------------------------------------------------------


class AsyncClient(BaseClient):
    """Asyncio client; same surface as :class:`Client` with ``await`` (streams: ``async for``)."""

    def __init__(self, api_key: str | None = None, base_url: str | None = None, *,
                 http_client: httpx.AsyncClient | None = None, **kwargs: Any) -> None:
        super().__init__(api_key, base_url, **kwargs)
        self._http = http_client or httpx.AsyncClient(timeout=self.timeout.to_httpx())
        self._sleep: Callable[[float], Any] = asyncio.sleep
        self.completions = AsyncCompletions(self)
        self.chat = AsyncChat(self)
        self.models = AsyncModels(self)

    async def tenant(self) -> TenantInfo:
        """The calling tenant's privacy mode, fallback policy and limits."""
        return TenantInfo.from_dict(self._json(await self._request("GET", "/v1/tenant")))

    async def _request(self, method: str, path: str, *, json: Any = None,
                       headers: dict[str, str] | None = None, stream: bool = False, content: bytes | None = None,
                       read_timeout: float | None = None, progress: str | None = None) -> httpx.Response:
        attempt = 0
        while True:
            try:
                request = self._build(self._http, method, path, json, headers, content, read_timeout, progress,
                                      is_async=True)
                return await self._send_once(request, stream)
            except Exception as exc:
                if not self.retry.should_retry(attempt, exc):
                    raise
                await self._sleep(self.retry.delay(attempt, exc, self._rand))
                attempt += 1

    async def _send_once(self, request: httpx.Request, stream: bool) -> httpx.Response:
        with map_transport_errors():
            response = await self._http.send(request, stream=stream)
            if response.status_code >= 400 and stream:
                await response.aread()
                await response.aclose()
        self._check(response)
        return response

    async def _aexchange(self, call: Call) -> Reply:
        """Perform one call of the private runtime (the asyncio driver: this client's own connections)."""
        download = bool(call.progress and self.progress is not None and call.method == "GET")
        response = await self._request(call.method, call.path, json=call.json, content=call.content,
                                       headers=call.headers, read_timeout=call.read_timeout,
                                       progress=call.progress, stream=download)
        if not download:
            return Reply(response.content)
        total, parts = content_length(response), []
        with map_transport_errors():
            try:
                async for chunk in response.aiter_bytes(PROGRESS_CHUNK):
                    parts.append(chunk)
                    self._report(call.progress, sum(map(len, parts)), total)
            finally:
                await response.aclose()
        return Reply(b"".join(parts))

    async def close(self) -> None:
        """Close the private session (if any) and the connection pool."""
        await aclose_private(self)
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _acall(client: AsyncClient, path: str, body: dict, non_sensitive: bool, stream: bool, parse):
    if client.privacy == "encrypted" and not non_sensitive:
        return await async_private_call(client, path, body, stream)
    headers = client._plaintext_headers(non_sensitive)
    response = await client._request("POST", path, json=body, headers=headers, stream=stream)
    if stream:
        return AsyncStream(response, parse)
    return parse(client._json(response))


class AsyncCompletions:
    """``client.completions`` of :class:`AsyncClient`."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(self, *, prompt: str | list[str] | list[int] | list[list[int]], stream: bool = False,
                     include_usage: bool = False, non_sensitive: bool = False,
                     extra_body: dict[str, Any] | None = None,
                     **params: Any) -> Completion | AsyncStream[Completion]:
        """Same arguments as :meth:`Completions.create`."""
        params.update(stream=stream or None,
                      stream_options={"include_usage": True} if stream and include_usage else None)
        return await _acall(self._client, "/v1/completions", completion_body(prompt, params, extra_body),
                            non_sensitive, stream, Completion.from_dict)


class AsyncChatCompletions:
    """``client.chat.completions`` of :class:`AsyncClient`."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(self, *, messages: Iterable[dict[str, Any]], stream: bool = False,
                     include_usage: bool = False, non_sensitive: bool = False,
                     extra_body: dict[str, Any] | None = None,
                     **params: Any) -> ChatCompletion | AsyncStream[ChatCompletionChunk]:
        """Same arguments as :meth:`ChatCompletions.create`."""
        params.update(stream=stream or None,
                      stream_options={"include_usage": True} if stream and include_usage else None)
        parse = ChatCompletionChunk.from_dict if stream else ChatCompletion.from_dict
        return await _acall(self._client, "/v1/chat/completions", chat_body(messages, params, extra_body),
                            non_sensitive, stream, parse)


class AsyncChat:
    """``client.chat`` of :class:`AsyncClient`."""

    def __init__(self, client: AsyncClient) -> None:
        self.completions = AsyncChatCompletions(client)


class AsyncModels:
    """``client.models`` of :class:`AsyncClient`."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def list(self) -> list[Model]:
        """The served models."""
        body = self._client._json(await self._client._request("GET", "/v1/models"))
        return [Model.from_dict(m) for m in body.get("data") or []]
