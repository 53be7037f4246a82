"""Engine outputs → OpenAI response bodies and SSE chunks (completions and chat completions).

Choice indices: prompt ``i`` of a request with ``n`` completions per prompt owns choices
``i * n .. i * n + n - 1`` (OpenAI's convention for batched prompts).

Streamed chunks without logprobs are written from per-response byte templates (the id, object, created
and model serialized once; per chunk only the index, finish reason and the JSON-escaped text are joined
in), byte for byte what ``json.dumps`` of the chunk dict gives; chunks with logprobs take the dict path.
"""

from __future__ import annotations

import dataclasses
import json
from json.encoder import encode_basestring_ascii as _json_str  # json.dumps' own escaping of a str (C)
from typing import Any

from engine.openai_api import chat_logprobs, completion_logprobs
from engine.outputs import CompletionOutput, RequestOutput


@dataclasses.dataclass
class ResponseMeta:
    """What every body of one response carries."""

    id: str
    created: int
    model: str
    n: int
    chat: bool
    logprobs: int | None  # top-n per token, None: no logprobs


def usage(finals: list[RequestOutput]) -> dict[str, Any]:
    """The ``usage`` object over every prompt of the request (cached tokens included)."""
    prompt = sum(len(r.prompt_token_ids) for r in finals)
    completion = sum(len(c.token_ids) for r in finals for c in r.outputs)
    cached = sum(r.num_cached_tokens or 0 for r in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _finish_reason(c: CompletionOutput) -> str | None:
    # the engine's "abort" is not an OpenAI reason; a cut-short completion reads as "length"
    return {"abort": "length"}.get(c.finish_reason, c.finish_reason) if c.finish_reason else None


def _logprobs_for(meta: ResponseMeta, c: CompletionOutput, ids: list[int], lps, decode):
    if meta.logprobs is None:
        return None
    if meta.chat:
        return chat_logprobs(ids, lps, meta.logprobs, decode)
    return completion_logprobs(ids, lps, meta.logprobs, decode)


def full_response(meta: ResponseMeta, finals: list[RequestOutput], decode) -> dict[str, Any]:
    """The non-streamed body."""
    choices = []
    for i, r in enumerate(finals):
        for c in sorted(r.outputs, key=lambda c: c.index):
            lps = _logprobs_for(meta, c, c.token_ids, c.logprobs, decode)
            choice: dict[str, Any] = {"index": i * meta.n + c.index, "logprobs": lps,
                                      "finish_reason": _finish_reason(c)}
            if meta.chat:
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = c.text
            choices.append(choice)
    return {"id": meta.id, "object": "chat.completion" if meta.chat else "text_completion",
            "created": meta.created, "model": meta.model, "choices": choices, "usage": usage(finals)}


def _chunk(meta: ResponseMeta, choices: list[dict], usage_obj: dict | None = None) -> dict[str, Any]:
    body = {"id": meta.id, "object": "chat.completion.chunk" if meta.chat else "text_completion",
            "created": meta.created, "model": meta.model, "choices": choices}
    if usage_obj is not None:
        body["usage"] = usage_obj
    return body


class ChunkBuilder:
    """Turns successive :class:`RequestOutput` snapshots into stream chunks (deltas only)."""

    def __init__(self, meta: ResponseMeta, decode) -> None:
        self.meta = meta
        self._decode = decode
        self._finished: set[int] = set()
        head = json.dumps(_chunk(meta, []), separators=(",", ":"), allow_nan=False)
        # b'data: {"id":…,"model":…,"choices":[{"index":' + index + ',"logprobs":null,"finish_reason":'
        self._head = ("data: " + head[:head.rindex('"choices":[')] + '"choices":[{"index":').encode()
        self._key = ',"delta":' if meta.chat else ',"text":'

    def first_chunks(self, num_prompts: int) -> list[dict[str, Any]]:
        """Chat only: the opening chunk per choice announcing the assistant role."""
        if not self.meta.chat:
            return []
        choices = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for i in range(num_prompts * self.meta.n)]
        return [_chunk(self.meta, choices)]

    def chunks(self, prompt_index: int, out: RequestOutput) -> list[dict[str, Any]]:
        """Chunks for the progress in ``out`` (one chunk per completion that moved)."""
        result = []
        for c in out.outputs:
            choice = self._choice(prompt_index * self.meta.n + c.index, c)
            if choice is not None:
                result.append(_chunk(self.meta, [choice]))
        return result

    def frames(self, prompt_index: int, out: RequestOutput) -> bytes:
        """The SSE bytes of :meth:`chunks` (empty when nothing moved), without building dicts when the
        response has no logprobs."""
        if self.meta.logprobs is not None:
            return b"".join(sse(chunk) for chunk in self.chunks(prompt_index, out))
        parts = []
        for c in out.outputs:
            index = prompt_index * self.meta.n + c.index
            newly_finished = c.finished and index not in self._finished
            if not (c.delta_text or c.delta_token_ids or newly_finished):
                continue
            if newly_finished:
                self._finished.add(index)
            reason = _finish_reason(c)
            if self.meta.chat:
                body = '{"content":' + _json_str(c.delta_text) + "}" if c.delta_text else "{}"
            else:
                body = _json_str(c.delta_text)
            parts.append(self._head + (f'{index},"logprobs":null,"finish_reason":'
                                       f'{"null" if reason is None else _json_str(reason)}'
                                       f"{self._key}{body}}}]}}\n\n").encode())
        return b"".join(parts)

    def _choice(self, index: int, c: CompletionOutput) -> dict[str, Any] | None:
        newly_finished = c.finished and index not in self._finished
        if not (c.delta_text or c.delta_token_ids or newly_finished):
            return None
        if newly_finished:
            self._finished.add(index)
        lps = None
        if self.meta.logprobs is not None and c.logprobs:
            lps = _logprobs_for(self.meta, c, c.delta_token_ids, c.logprobs, self._decode)
        choice: dict[str, Any] = {"index": index, "logprobs": lps, "finish_reason": _finish_reason(c)}
        if self.meta.chat:
            choice["delta"] = {"content": c.delta_text} if c.delta_text else {}
        else:
            choice["text"] = c.delta_text
        return choice

    def usage_chunk(self, finals: list[RequestOutput]) -> dict[str, Any]:
        """The closing chunk with ``usage`` and no choices (``stream_options.include_usage``)."""
        return _chunk(self.meta, [], usage(finals))


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), allow_nan=False)
    return f"data: {payload}\n\n".encode()
