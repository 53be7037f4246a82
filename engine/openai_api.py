"""OpenAI request bodies → :class:`SamplingParams`: the one translation the server and the SDK share.

The server (``server/routers/openai.py``, after pydantic has parsed the body) and the SDK's encrypted
path (``client_sdk``, which builds the body itself) both call :func:`check_unsupported`,
:func:`check_fields`, :func:`resolve_max_tokens` and :func:`sampling_params`, in that order, on a plain
mapping of the body's fields, so both accept the same fields (OpenAI's plus vLLM's extras ``top_k``,
``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``), apply
the same defaults (completions: 16 tokens; chat: what fits the context, capped by the tenant's limit and
:data:`CHAT_MAX_TOKENS_CAP`) and refuse the same values, in the same order, with the same message and
field name (:class:`OpenAIRequestError`).

No I/O and no server or SDK types here: a body is a ``Mapping[str, Any]`` (a pydantic model's
``dict(body)`` or the SDK's JSON dict).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling_params import MAX_LOGPROBS, SamplingParams

COMPLETION_MAX_TOKENS_DEFAULT = 16   # OpenAI's legacy completions default
CHAT_MAX_TOKENS_CAP = 1024           # chat default: what fits the context, at most this
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class OpenAIRequestError(InvalidRequestError):
    """A field of an OpenAI-style body is invalid or unsupported; ``param`` names it (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_unsupported(body: Mapping[str, Any], *, chat: bool) -> None:
    """Refuse fields accepted only at their neutral value (``echo``, ``suffix``, ``tools``, ...)."""
    if body.get("logit_bias"):
        raise OpenAIRequestError("logit_bias is not supported", "logit_bias")
    if not chat:
        if body.get("echo"):
            raise OpenAIRequestError("echo is not supported", "echo")
        if body.get("suffix"):
            raise OpenAIRequestError("suffix is not supported", "suffix")
        best_of = body.get("best_of")
        if best_of is not None and best_of != body.get("n", 1):
            raise OpenAIRequestError("best_of must equal n (or be omitted)", "best_of")
        return
    if body.get("tools"):
        raise OpenAIRequestError("tools are not supported", "tools")
    fmt = body.get("response_format")
    if fmt and (not isinstance(fmt, Mapping) or fmt.get("type", "text") != "text"):
        raise OpenAIRequestError("only response_format {'type': 'text'} is supported", "response_format")


def resolve_max_tokens(body: Mapping[str, Any], *, chat: bool, room: int, cap: int | None) -> int:
    """The request's ``max_tokens``.

    Args:
        body: the request's fields.
        chat: a chat completion (``max_completion_tokens`` counts; the default fills the context).
        room: tokens left in the context after the prompt (at least 1 is assumed).
        cap: the tenant's ``max_tokens`` limit, if any.

    Raises:
        OpenAIRequestError: not a positive integer, or over ``cap``.
    """
    requested = body.get("max_tokens")
    if chat:
        requested = body.get("max_completion_tokens") or requested
        room = max(room, 1)
        default = min(room, cap or room, CHAT_MAX_TOKENS_CAP)
    else:
        default = COMPLETION_MAX_TOKENS_DEFAULT
    value = requested if requested is not None else max(1, default)
    if not _is_int(value) or value < 1:
        raise OpenAIRequestError(f"max_tokens must be an integer >= 1, got {value!r}", "max_tokens")
    if cap is not None and value > cap:
        raise OpenAIRequestError(f"max_tokens {value} exceeds this tenant's limit of {cap}", "max_tokens")
    return value


def sampling_params(body: Mapping[str, Any], *, chat: bool, max_tokens: int) -> SamplingParams:
    """``SamplingParams`` for an OpenAI-style body (None / missing fields take OpenAI's defaults).

    Raises:
        OpenAIRequestError: a field has a wrong type or is out of range (``param`` names it).
    """
    check_fields(body, chat=chat)
    stop = body.get("stop")
    try:
        return SamplingParams(
            n=_or(body, "n", 1), max_tokens=max_tokens, temperature=_or(body, "temperature", 1.0),
            top_p=_or(body, "top_p", 1.0), top_k=_or(body, "top_k", -1), min_p=_or(body, "min_p", 0.0),
            repetition_penalty=_or(body, "repetition_penalty", 1.0),
            presence_penalty=_or(body, "presence_penalty", 0.0),
            frequency_penalty=_or(body, "frequency_penalty", 0.0), seed=body.get("seed"),
            stop=[stop] if isinstance(stop, str) else list(stop or []),
            stop_token_ids=list(body.get("stop_token_ids") or []), ignore_eos=_or(body, "ignore_eos", False),
            skip_special_tokens=_or(body, "skip_special_tokens", True), logprobs=_logprobs(body, chat))
    except OpenAIRequestError:
        raise
    except InvalidRequestError as exc:
        raise OpenAIRequestError(str(exc), str(exc).split(" ", 1)[0]) from exc


# --- logprobs in OpenAI's shapes (the server's responses and the SDK's encrypted path) -------------

_LP_FLOOR = -9999.0  # JSON has no -inf; a masked token's logprob is reported as this


def _lp(lp: dict[int, float], tid: int) -> float:
    value = lp.get(tid, _LP_FLOOR)
    return value if value > _LP_FLOOR else _LP_FLOOR


def _top(lp: dict[int, float], k: int) -> list[tuple[int, float]]:
    return [(t, _lp(lp, t)) for t, _ in sorted(lp.items(), key=lambda kv: -kv[1])[:k]]


def completion_logprobs(token_ids: list[int], lps: list[dict[int, float]] | None, k: int, decode,
                        offset: int = 0) -> dict[str, Any] | None:
    """The legacy completions ``logprobs`` object for ``token_ids`` (text_offset starts at ``offset``)."""
    if lps is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, lp in zip(token_ids, lps, strict=False):
        text = decode(tid)
        tokens.append(text)
        token_lps.append(_lp(lp, tid))
        tops.append({decode(t): v for t, v in _top(lp, k)} if k else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _lp_entry(tid: int, value: float, decode) -> dict[str, Any]:
    text = decode(tid)
    return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_ids: list[int], lps: list[dict[int, float]] | None, k: int, decode) -> dict | None:
    """The chat ``logprobs`` object (``{"content": [...]}``) for ``token_ids``."""
    if lps is None:
        return None
    content = []
    for tid, lp in zip(token_ids, lps, strict=False):
        entry = _lp_entry(tid, _lp(lp, tid), decode)
        entry["top_logprobs"] = [_lp_entry(t, v, decode) for t, v in _top(lp, k)]
        content.append(entry)
    return {"content": content}


# --- field checks (the ranges of the server's request schema) ----------------------------------------

_RANGES: dict[str, tuple[float, float, bool]] = {  # name: (low, high, low is exclusive)
    "temperature": (0, 100, False), "top_p": (0, 1, True), "min_p": (0, 1, False),
    "repetition_penalty": (0, 100, True), "presence_penalty": (-2, 2, False),
    "frequency_penalty": (-2, 2, False),
}
_INT_RANGES: dict[str, tuple[int, int]] = {"n": (1, 128), "top_k": (-1, 2**31 - 1), "seed": (INT64_MIN, INT64_MAX)}
_BOOLS = ("ignore_eos", "skip_special_tokens", "stream")


def check_fields(body: Mapping[str, Any], *, chat: bool) -> None:
    """Types and ranges of the sampling fields, before any limit is applied (the server's schema order).

    Raises:
        OpenAIRequestError: a field has a wrong type or is out of range (``param`` names it).
    """
    for name, (low, high, open_low) in _RANGES.items():
        value = body.get(name)
        in_range = _is_num(value) and (low < value if open_low else low <= value) and value <= high
        if value is not None and not in_range:
            raise OpenAIRequestError(f"{name} must be a number in {'(' if open_low else '['}{low}, {high}], "
                                     f"got {value!r}", name)
    for name, (low, high) in _INT_RANGES.items():
        value = body.get(name)
        if value is not None and not (_is_int(value) and low <= value <= high):
            raise OpenAIRequestError(f"{name} must be an integer in [{low}, {high}], got {value!r}", name)
    for name in _BOOLS:
        if body.get(name) is not None and not isinstance(body.get(name), bool):
            raise OpenAIRequestError(f"{name} must be true or false, got {body.get(name)!r}", name)
    _check_stop(body.get("stop"))
    ids = body.get("stop_token_ids")
    if ids is not None and not (isinstance(ids, list) and len(ids) <= MAX_STOP_TOKEN_IDS
                                and all(_is_int(t) and 0 <= t <= 2**31 - 1 for t in ids)):
        raise OpenAIRequestError(f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids",
                                 "stop_token_ids")


def _check_stop(stop: Any) -> None:
    ok = stop is None or (isinstance(stop, str) and stop) or (
        isinstance(stop, list) and len(stop) <= MAX_STOP_STRINGS and all(isinstance(s, str) and s for s in stop))
    if not ok:
        raise OpenAIRequestError(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} "
                                 "non-empty strings", "stop")


def _logprobs(body: Mapping[str, Any], chat: bool) -> int | None:
    """Top-n logprobs per token (None: none): chat ``logprobs: true`` + ``top_logprobs``; completions an int."""
    if chat:
        flag, top = body.get("logprobs"), body.get("top_logprobs")
        if flag is not None and not isinstance(flag, bool):
            raise OpenAIRequestError("logprobs must be true or false in a chat completion", "logprobs")
        if top is not None and not (_is_int(top) and 0 <= top <= MAX_LOGPROBS):
            raise OpenAIRequestError(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}]", "top_logprobs")
        return (top or 0) if flag else None
    value = body.get("logprobs")
    if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
        raise OpenAIRequestError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}]", "logprobs")
    return value


def _or(body: Mapping[str, Any], name: str, default: Any) -> Any:
    value = body.get(name)
    return default if value is None else value


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
