"""Structured output: grammars compiled by xgrammar, applied as a token bitmask before sampling.

A request asks for structured output with a :class:`GrammarSpec` (built from OpenAI's
``response_format`` or vLLM's ``guided_*`` extras by :mod:`engine.openai_api`). A
:class:`GrammarCompiler` (one per tokenizer and vocabulary, :func:`compiler_for`) turns the spec into an
xgrammar ``CompiledGrammar`` — cached per spec string, errors included, so a schema is compiled once and
a bad one is refused again without recompiling — and wraps it in a :class:`GrammarProcessor`, the
request's logits processor. Compilation happens when the request is admitted (the server does it in a
worker thread), never inside the engine's step.

Per step the processor only fills its rows of the step's shared token bitmask
(:class:`engine.logits_process.BitmaskLogitsProcessor`); xgrammar's CPU kernel applies the mask for every
constrained row at once. The end-of-sequence tokens are allowed only where the grammar may end.

Matcher state follows the token history: the processor keeps one xgrammar matcher per history it saw in
the last step and advances it by the new token, so ``n > 1``, preemption (recompute keeps the history)
and several rows per sequence (speculative verify) need no sequence ids; a history it cannot extend is
replayed from the start.

JSON is generated in xgrammar's JSON form (``", "`` and ``": "``, no other whitespace): with free
whitespace small models can loop on newlines for ever. Objects get no properties the schema does not
name (xgrammar's ``strict_mode``): the output is still valid against the schema as written.

Errors: :class:`GrammarError` (an :class:`~engine.errors.InvalidRequestError`; ``param`` names the
request field) for a schema, regex or grammar that does not compile.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import threading
import weakref
from collections.abc import Sequence
from typing import Any, Literal

import torch

from engine.errors import InvalidRequestError
from engine.logits_process import BitmaskLogitsProcessor

GrammarKind = Literal["json_schema", "regex", "choice", "grammar"]
MAX_SPEC_CHARS = 64 * 1024   # a schema/regex/grammar longer than this is refused before compiling
CACHE_SIZE = 256             # compiled grammars (and compile errors) kept per compiler

_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")  # "[18:22:32] /project/cpp/x.cc:94: " in xgrammar's errors


class GrammarError(InvalidRequestError):
    """A schema, regex or grammar that cannot be compiled; ``param`` names the request field (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """What the output must match.

    Attributes:
        kind: ``json_schema`` (source: the schema as canonical JSON), ``regex``, ``choice`` (source: an
            EBNF alternation of the choices, see :func:`choice_spec`) or ``grammar`` (EBNF, xgrammar's
            GBNF dialect with a ``root`` rule).
        source: the text compiled; also the cache key (with ``kind``).
        param: the request field it came from, for error messages.
    """

    kind: GrammarKind
    source: str
    param: str = "response_format"

    def __post_init__(self) -> None:
        if len(self.source) > MAX_SPEC_CHARS:
            raise GrammarError(f"{self.param} is longer than {MAX_SPEC_CHARS} characters", self.param)


def choice_spec(choices: Sequence[str], param: str = "guided_choice") -> GrammarSpec:
    """A spec whose only outputs are the given strings exactly."""
    alternatives = " | ".join(_ebnf_literal(c) for c in choices)
    return GrammarSpec("grammar", f"root ::= {alternatives}", param)


def _ebnf_literal(text: str) -> str:
    """``text`` as an EBNF string literal (xgrammar reads JSON-style escapes)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


class GrammarCompiler:
    """Compiles specs for one tokenizer and vocabulary; thread-safe, with an LRU cache of results.

    Args:
        hf_tokenizer: the Hugging Face tokenizer (xgrammar reads its vocabulary).
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary: padding rows).
        stop_token_ids: the tokens that end a sequence (allowed only where the grammar may end).
        cache_size: compiled grammars kept.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 cache_size: int = CACHE_SIZE) -> None:
        import xgrammar as xgr

        self.vocab_size = int(vocab_size)
        self.stop_token_ids = sorted(set(int(t) for t in stop_token_ids))
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.stop_token_ids)
        self.tokenizer_info = info  # what a pickled grammar is rebuilt against (engine core process)
        # our own cache below (bounded, counts hits, keeps errors); one thread: compiles run per request
        self._xgr = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: collections.OrderedDict[tuple[str, str], Any] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def compile(self, spec: GrammarSpec) -> Any:
        """The xgrammar ``CompiledGrammar`` of ``spec`` (cached).

        Raises:
            GrammarError: the spec does not compile (the message is xgrammar's, without its source path).
        """
        key = (spec.kind, spec.source)
        with self._lock:
            result = self._cache.get(key)
            if result is not None:
                self._cache.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
                result = self._compile(spec)
                self._cache[key] = result
                if len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(result, str):
            raise GrammarError(f"{spec.param}: {result}", spec.param)
        return result

    def processor(self, spec: GrammarSpec) -> GrammarProcessor:
        """A fresh logits processor for one request (compiles, or takes the cached grammar)."""
        return GrammarProcessor(self.compile(spec), self.stop_token_ids)

    def _compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar, or the error message (a str) when xgrammar refuses the spec."""
        try:
            if spec.kind == "json_schema":
                return self._xgr.compile_json_schema(spec.source, any_whitespace=False, strict_mode=True)
            if spec.kind == "regex":
                return self._xgr.compile_regex(spec.source)
            return self._xgr.compile_grammar(spec.source)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar reports a bad spec as RuntimeError
            return _clean_message(exc)


def _clean_message(exc: Exception) -> str:
    lines = [_CPP_PREFIX.sub("", line).strip() for line in str(exc).strip().splitlines()]
    return " ".join(line for line in lines if line) or type(exc).__name__


_COMPILERS: weakref.WeakKeyDictionary[Any, dict[tuple, GrammarCompiler]] = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> GrammarCompiler:
    """The compiler of an :class:`engine.tokenizer.Tokenizer` (built once: reading the vocabulary costs
    ~0.3 s), shared by everything that serves that tokenizer — the server's engine, the SDK's runtime."""
    key = (int(vocab_size), tuple(sorted(set(int(t) for t in stop_token_ids))))
    with _COMPILERS_LOCK:
        per_tok = _COMPILERS.setdefault(tokenizer, {})
        compiler = per_tok.get(key)
        if compiler is None:
            compiler = per_tok[key] = GrammarCompiler(tokenizer.hf_tokenizer, *key)
        return compiler


def model_compiler(tokenizer: Any, model_config: Any) -> GrammarCompiler:
    """:func:`compiler_for` with the model's logits width and the engine's end-of-sequence tokens (the
    config's and the tokenizer's, as :class:`engine.llm_engine.LLMEngine` and the SDK stop on)."""
    stop = set(model_config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        stop.add(tokenizer.eos_token_id)
    return compiler_for(tokenizer, model_config.vocab_size, sorted(stop))


class _State:
    """One history's matcher; ``done``: the grammar ended (or a token it forbids was forced in)."""

    __slots__ = ("matcher", "done")

    def __init__(self, matcher: Any, done: bool = False) -> None:
        self.matcher, self.done = matcher, done

    def advance(self, token: int) -> _State:
        """A new state after ``token`` (this one is left as it was: another row may extend it too)."""
        if self.done:
            return _State(self.matcher, True)
        child = self.matcher.fork()
        ok = child.accept_token(int(token))
        return _State(child, not ok or child.is_terminated())


# The engine core process's (tokenizer, model config): a GrammarProcessor pickled by the API process is
# rebuilt against this tokenizer's vocabulary (engine/engine_core.py sets it).
_PROCESS_MODEL: tuple[Any, Any] | None = None


def bind_process_model(tokenizer: Any, model_config: Any) -> None:
    """Name the model whose vocabulary unpickled grammars use in this process (the engine core's)."""
    global _PROCESS_MODEL
    _PROCESS_MODEL = (tokenizer, model_config)


def _processor_from_json(data: str, stop_token_ids: list[int]) -> GrammarProcessor:
    import xgrammar as xgr

    if _PROCESS_MODEL is None:
        raise RuntimeError("a grammar arrived in a process with no model bound (bind_process_model)")
    info = model_compiler(*_PROCESS_MODEL).tokenizer_info
    return GrammarProcessor(xgr.CompiledGrammar.deserialize_json(data, info), stop_token_ids)


class GrammarProcessor(BitmaskLogitsProcessor):
    """One request's grammar constraint (a :class:`~engine.logits_process.BitmaskLogitsProcessor`)."""

    def __init__(self, compiled: Any, stop_token_ids: Sequence[int]) -> None:
        self.compiled = compiled
        self.stop_token_ids = list(stop_token_ids)
        self._states: dict[tuple[int, ...], _State] = {}

    def __reduce__(self):
        # to the engine core: the compiled grammar as xgrammar's JSON (a few KB), never its matchers
        return _processor_from_json, (self.compiled.serialize_json(), self.stop_token_ids)

    def fill_bitmask(self, prompt_token_ids: list[list[int]], output_token_ids: list[list[int]],
                     bitmask: torch.Tensor, rows: list[int]) -> None:
        states: dict[tuple[int, ...], _State] = {}
        for history, row in zip(output_token_ids, rows, strict=True):
            key = tuple(history)
            state = states.get(key) or self._state(key)
            states[key] = state
            if state.done:  # the grammar has ended: only the end-of-sequence tokens remain
                _only(bitmask, row, self.stop_token_ids)
            else:
                state.matcher.fill_next_token_bitmask(bitmask, row)
        self._states = states  # keep what the next step extends; older histories are dropped

    @classmethod
    def apply_bitmask(cls, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        import xgrammar as xgr

        if logits.dtype != torch.float32 or logits.device.type != "cpu":  # xgrammar's CPU kernel: fp32 only
            super().apply_bitmask(logits, bitmask, rows)
            return
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)

    def _state(self, key: tuple[int, ...]) -> _State:
        """The state after ``key``: kept from the last step, one token past a kept one, or replayed."""
        state = self._states.get(key)
        if state is not None:
            return state
        parent = self._states.get(key[:-1]) if key else None
        if parent is not None:
            return parent.advance(key[-1])
        return self._replay(key)

    def _replay(self, key: tuple[int, ...]) -> _State:
        import xgrammar as xgr

        state = _State(xgr.GrammarMatcher(self.compiled, override_stop_tokens=self.stop_token_ids or None))
        for token in key:
            state = state.advance(token)
        return state


def _only(bitmask: torch.Tensor, row: int, token_ids: Sequence[int]) -> None:
    """Allow exactly ``token_ids`` in ``bitmask[row]``."""
    bitmask[row] = 0
    for t in token_ids:
        if t // 32 < bitmask.shape[1]:
            word = int(bitmask[row, t // 32]) | (1 << (t % 32))
            bitmask[row, t // 32] = word - (1 << 32) if word >= 1 << 31 else word  # int32 wraps
