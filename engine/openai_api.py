"""OpenAI request bodies → :class:`SamplingParams`: the one translation the server and the SDK share.

The server (``server/routers/openai.py``, after pydantic has parsed the body) and the SDK's encrypted
path (``client_sdk``, which builds the body itself) both call :func:`check_unsupported`,
:func:`check_fields`, :func:`resolve_max_tokens` and :func:`sampling_params`, in that order, on a plain
mapping of the body's fields, so both accept the same fields (OpenAI's plus vLLM's extras ``top_k``,
``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``,
``num_speculative_tokens`` (per-request speculative decoding, :mod:`engine.spec_decode`), and the
structured-output fields ``response_format``, ``guided_json``, ``guided_regex``, ``guided_choice``,
``guided_grammar`` — compiled into the request's grammar processor, :mod:`engine.structured`), apply
the same defaults (completions: 16 tokens; chat: what fits the context, capped by the tenant's limit and
:data:`CHAT_MAX_TOKENS_CAP`) and refuse the same values, in the same order, with the same message and
field name (:class:`OpenAIRequestError`).

No I/O and no server or SDK types here: a body is a ``Mapping[str, Any]`` (a pydantic model's
``dict(body)`` or the SDK's JSON dict).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from engine.errors import InvalidRequestError
from engine.sampling_params import MAX_LOGPROBS, MAX_SPECULATIVE_TOKENS, SamplingParams

if TYPE_CHECKING:  # engine.structured imports torch and xgrammar: loaded only when a body asks for it
    from engine.structured import GrammarCompiler, GrammarSpec

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
    """Refuse fields accepted only at their neutral value (``echo``, ``suffix``, ``tools``,
    ``use_beam_search``, ...)."""
    if body.get("logit_bias"):
        raise OpenAIRequestError("logit_bias is not supported", "logit_bias")
    if body.get("use_beam_search"):  # LLM.beam_search drives an idle engine; the server's engine never is
        raise OpenAIRequestError("use_beam_search is not supported by the server; run beam search offline "
                                 "with engine.LLM.beam_search", "use_beam_search")
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


def sampling_params(body: Mapping[str, Any], *, chat: bool, max_tokens: int,
                    grammars: GrammarCompiler | None = None) -> SamplingParams:
    """``SamplingParams`` for an OpenAI-style body (None / missing fields take OpenAI's defaults).

    Args:
        body: the request's fields.
        chat: a chat completion.
        max_tokens: from :func:`resolve_max_tokens`.
        grammars: compiles ``response_format`` / ``guided_*`` into the request's grammar processor
            (:func:`engine.structured.compiler_for`); without it such a request is refused.

    Raises:
        OpenAIRequestError: a field has a wrong type or is out of range, or a schema, regex or grammar does
            not compile (``param`` names it).
    """
    check_fields(body, chat=chat)
    processors = [] if (spec := structured_spec(body)) is None else [_grammar_processor(spec, grammars)]
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
            skip_special_tokens=_or(body, "skip_special_tokens", True), logprobs=_logprobs(body, chat),
            logits_processors=processors, num_speculative_tokens=body.get("num_speculative_tokens"))
    except OpenAIRequestError:
        raise
    except InvalidRequestError as exc:
        raise OpenAIRequestError(str(exc), str(exc).split(" ", 1)[0]) from exc


def _grammar_processor(spec: GrammarSpec, grammars: GrammarCompiler | None) -> Any:
    from engine.structured import GrammarError

    if grammars is None:
        raise OpenAIRequestError("structured output is not available here", spec.param)
    try:
        return grammars.processor(spec)
    except GrammarError as exc:
        raise OpenAIRequestError(str(exc), exc.param) from exc


# --- structured output: response_format and vLLM's guided_* extras ----------------------------------

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
MAX_CHOICES = 256
MAX_SCHEMA_DEPTH = 64
_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for json_schema.name


def structured_spec(body: Mapping[str, Any]) -> GrammarSpec | None:
    """The grammar the body asks for (``response_format`` other than text, or one ``guided_*``), or None.

    Checks shapes only (types, sizes, at most one constraint); compiling is
    :func:`sampling_params`' business.

    Raises:
        OpenAIRequestError: a malformed field, or two constraints at once (``param`` names the field).
    """
    specs = []
    if body.get("response_format") is not None:
        specs.append(_response_format(body["response_format"]))
    specs += [_guided(name, body[name]) for name in GUIDED_FIELDS if body.get(name) is not None]
    specs = [s for s in specs if s is not None]
    if len(specs) > 1:
        raise OpenAIRequestError("give at most one of response_format (json), " + ", ".join(GUIDED_FIELDS),
                                 specs[1].param)
    return specs[0] if specs else None


def _response_format(fmt: Any) -> GrammarSpec | None:
    from engine.structured import GrammarSpec

    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_schema", '{"type":"object"}', "response_format")
    if kind != "json_schema":
        raise OpenAIRequestError("response_format must be {'type': 'text' | 'json_object' | 'json_schema'}",
                                 "response_format")
    param = "response_format.json_schema"
    js = fmt.get("json_schema")
    if not isinstance(js, Mapping):
        raise OpenAIRequestError(f"{param} must be an object with 'name' and 'schema'", param)
    name = js.get("name")
    if not (isinstance(name, str) and _SCHEMA_NAME.match(name)):
        raise OpenAIRequestError(f"{param}.name must be 1-64 letters, digits, '_' or '-'", f"{param}.name")
    if js.get("strict") is not None and not isinstance(js.get("strict"), bool):
        raise OpenAIRequestError(f"{param}.strict must be true or false", f"{param}.strict")
    schema = js.get("schema", {"type": "object"})
    return _schema_spec(schema, f"{param}.schema")


def _guided(name: str, value: Any) -> GrammarSpec:
    from engine.structured import GrammarSpec, choice_spec

    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise OpenAIRequestError(f"guided_json is not valid JSON: {exc}", name) from exc
        return _schema_spec(value, name)
    if name == "guided_choice":
        if not (isinstance(value, list) and 0 < len(value) <= MAX_CHOICES
                and all(isinstance(c, str) and c for c in value)):
            raise OpenAIRequestError(f"guided_choice must be a list of 1 to {MAX_CHOICES} non-empty strings", name)
        return _spec(lambda: choice_spec(value, name), name)
    if not (isinstance(value, str) and value):
        raise OpenAIRequestError(f"{name} must be a non-empty string", name)
    return _spec(lambda: GrammarSpec("regex" if name == "guided_regex" else "grammar", value, name), name)


def _schema_spec(schema: Any, param: str) -> GrammarSpec:
    """A JSON schema object as its canonical text (properties keep their order: the output follows it)."""
    from engine.structured import GrammarSpec

    if not isinstance(schema, Mapping):  # the server's schema takes objects only; so does the SDK
        raise OpenAIRequestError(f"{param} must be a JSON schema object", param)
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise OpenAIRequestError(f"{param} is nested deeper than {MAX_SCHEMA_DEPTH} levels", param)
    try:
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise OpenAIRequestError(f"{param} is not valid JSON: {exc}", param) from exc
    return _spec(lambda: GrammarSpec("json_schema", text, param), param)


def _spec(build, param: str) -> GrammarSpec:
    """``build()``, with a too-long spec (GrammarError) as the request error."""
    from engine.structured import GrammarError

    try:
        return build()
    except GrammarError as exc:
        raise OpenAIRequestError(str(exc), param) from exc


def _depth(value: Any, limit: int = MAX_SCHEMA_DEPTH + 1) -> int:
    """Nesting depth of a JSON value, counted no further than ``limit`` (a loop: any depth is safe)."""
    depth, level = 0, [value]
    while level and depth < limit:
        depth += 1
        level = [v for x in level if isinstance(x, (Mapping, list))
                 for v in (x.values() if isinstance(x, Mapping) else x)]
    return depth


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
_INT_RANGES: dict[str, tuple[int, int]] = {"n": (1, 128), "top_k": (-1, 2**31 - 1), "seed": (INT64_MIN, INT64_MAX),
                                           "num_speculative_tokens": (0, MAX_SPECULATIVE_TOKENS)}
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
    structured_spec(body)
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
