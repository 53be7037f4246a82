"""Typed responses of the API (frozen dataclasses built from the JSON bodies).

Field names follow OpenAI's response objects so code written against the ``openai`` package reads the
same (``resp.choices[0].message.content``, ``resp.usage.prompt_tokens_details.cached_tokens``).
A body without a required field raises :class:`~client_sdk.APIResponseValidationError`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from client_sdk._exceptions import APIResponseValidationError

PrivacyMode = Literal["plaintext", "encrypted"]


def _req(d: Any, key: str, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(d, dict) or key not in d or not isinstance(d[key], kind):
        raise APIResponseValidationError(f"response field {key!r} missing or not {kind}")
    return d[key]


def _list(d: dict, key: str) -> list:
    return _req(d, key, list)


@dataclasses.dataclass(frozen=True)
class PromptTokensDetails:
    """``usage.prompt_tokens_details``."""

    cached_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class Usage:
    """Token counts of a request (``cached_tokens``: prompt tokens served from the prefix cache)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()

    @classmethod
    def from_dict(cls, d: dict) -> Usage:
        details = d.get("prompt_tokens_details") or {}
        return cls(_req(d, "prompt_tokens", int), _req(d, "completion_tokens", int),
                   _req(d, "total_tokens", int), PromptTokensDetails(int(details.get("cached_tokens") or 0)))


def _usage(d: dict) -> Usage | None:
    return Usage.from_dict(d["usage"]) if isinstance(d.get("usage"), dict) else None


@dataclasses.dataclass(frozen=True)
class CompletionChoice:
    """A choice of a completion (or, streamed, the delta of one)."""

    index: int
    text: str
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, d: dict) -> CompletionChoice:
        return cls(_req(d, "index", int), _req(d, "text", str), d.get("finish_reason"), d.get("logprobs"))


@dataclasses.dataclass(frozen=True)
class Completion:
    """``POST /v1/completions`` (``object`` is ``text_completion``); also each streamed chunk."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"

    @classmethod
    def from_dict(cls, d: dict) -> Completion:
        return cls(_req(d, "id", str), _req(d, "created", int), _req(d, "model", str),
                   [CompletionChoice.from_dict(c) for c in _list(d, "choices")], _usage(d),
                   d.get("object", "text_completion"))


@dataclasses.dataclass(frozen=True)
class ChatMessage:
    """An assistant message of a chat completion."""

    role: str
    content: str | None


@dataclasses.dataclass(frozen=True)
class ChatChoice:
    """A choice of a chat completion."""

    index: int
    message: ChatMessage
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, d: dict) -> ChatChoice:
        m = _req(d, "message", dict)
        return cls(_req(d, "index", int), ChatMessage(m.get("role", "assistant"), m.get("content")),
                   d.get("finish_reason"), d.get("logprobs"))


@dataclasses.dataclass(frozen=True)
class ChatCompletion:
    """``POST /v1/chat/completions``."""

    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    object: str = "chat.completion"

    @classmethod
    def from_dict(cls, d: dict) -> ChatCompletion:
        return cls(_req(d, "id", str), _req(d, "created", int), _req(d, "model", str),
                   [ChatChoice.from_dict(c) for c in _list(d, "choices")], _usage(d))


@dataclasses.dataclass(frozen=True)
class ChoiceDelta:
    """What a streamed chat chunk adds to one choice."""

    role: str | None = None
    content: str | None = None


@dataclasses.dataclass(frozen=True)
class ChatChunkChoice:
    """One choice of a streamed chat chunk."""

    index: int
    delta: ChoiceDelta
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, d: dict) -> ChatChunkChoice:
        delta = d.get("delta") or {}
        return cls(_req(d, "index", int), ChoiceDelta(delta.get("role"), delta.get("content")),
                   d.get("finish_reason"), d.get("logprobs"))


@dataclasses.dataclass(frozen=True)
class ChatCompletionChunk:
    """One streamed chunk of a chat completion (the last one may carry only ``usage``)."""

    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"

    @classmethod
    def from_dict(cls, d: dict) -> ChatCompletionChunk:
        return cls(_req(d, "id", str), _req(d, "created", int), _req(d, "model", str),
                   [ChatChunkChoice.from_dict(c) for c in _list(d, "choices")], _usage(d))


@dataclasses.dataclass(frozen=True)
class Model:
    """An entry of ``GET /v1/models``."""

    id: str
    created: int = 0
    owned_by: str = ""
    max_model_len: int | None = None

    @classmethod
    def from_dict(cls, d: dict) -> Model:
        return cls(_req(d, "id", str), int(d.get("created") or 0), str(d.get("owned_by") or ""),
                   d.get("max_model_len"))


@dataclasses.dataclass(frozen=True)
class TenantInfo:
    """``GET /v1/tenant``: the calling tenant's mode, fallback policy and limits."""

    id: str
    privacy_mode: str
    fallback: str
    limits: dict[str, Any]

    @classmethod
    def from_dict(cls, d: dict) -> TenantInfo:
        return cls(_req(d, "id", str), _req(d, "privacy_mode", str), _req(d, "fallback", str),
                   dict(d.get("limits") or {}))
