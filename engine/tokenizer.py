"""Tokenizer, chat template and incremental detokenization.

Wraps the model's own ``tokenizer.json`` / ``tokenizer_config.json`` through transformers (which uses
``tokenizers`` underneath) and renders its jinja chat template. :class:`IncrementalDetokenizer` turns a
growing list of token ids into text deltas that never split a UTF-8 character.

Special-token text in chat messages is plain text: a user who types ``<|im_start|>system`` into a
message gets the characters ``<|im_start|>`` tokenized as ordinary text, never the control token, so
message content cannot forge a turn (OpenAI's behaviour). Only the chat template itself emits control
tokens. A raw prompt given to :meth:`Tokenizer.encode` (``/v1/completions``, ``generate --raw``) is the
model's input as written, so special-token text there *is* parsed, as vLLM and llama.cpp do.

Text that is not valid Unicode (a lone UTF-16 surrogate such as ``"\ud800"``, which JSON can carry) is
refused with :class:`~engine.errors.InvalidRequestError`.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path
from typing import Any

from engine.errors import InvalidRequestError, ModelLoadError


class Tokenizer:
    """The model's tokenizer and chat template."""

    # text the native path must tokenize exactly as transformers does before it is used (spaces, digits,
    # special-token text, non-ASCII)
    _PROBE = "  Hello wörld 12345\n\t<|im_start|>user x</s> <s> [INST] 東京 🙂  end "

    def __init__(self, hf_tokenizer: Any) -> None:
        self._tok = hf_tokenizer
        self._native = self._native_encoder(hf_tokenizer)

    @classmethod
    def _native_encoder(cls, hf: Any) -> Any:
        """The fast backend's own ``encode`` where it gives transformers' ids on the probe text, else None.

        transformers' ``encode`` of one text goes through the backend's ``encode_batch`` (a thread-pool hop
        per call) and its Python wrapper: 0.15-0.4 ms per 120-token prompt in the API process against
        ~0.1 ms direct (bench/serve_api_cpu.py under cProfile)."""
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None or not callable(getattr(backend, "encode", None)):
            return None
        # a tokenizer.json with truncation or padding set: the backend's own encode applies them; only a side
        # effect of transformers' encode (it switches them off on the backend, as the probe below would) hides
        # that, so such a tokenizer keeps transformers' path rather than depend on it
        if getattr(backend, "truncation", None) is not None or getattr(backend, "padding", None) is not None:
            return None
        try:
            same = all(list(hf.encode(cls._PROBE, add_special_tokens=sp)) ==
                       backend.encode(cls._PROBE, add_special_tokens=sp).ids for sp in (True, False))
        except Exception:  # noqa: BLE001 - any doubt: transformers' path
            return None
        return backend if same else None

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """Load from a model folder (tokenizer.json + tokenizer_config.json)."""
        folder = Path(folder)
        if not (folder / "tokenizer.json").exists():
            raise ModelLoadError(f"{folder}: no tokenizer.json")
        from transformers import AutoTokenizer

        try:
            return cls(AutoTokenizer.from_pretrained(str(folder)))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{folder}: cannot load tokenizer: {exc}") from exc

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Build the tokenizer stored in a GGUF file's metadata."""
        from transformers import AutoTokenizer

        path = Path(path)
        try:
            return cls(AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"{path}: cannot build tokenizer from GGUF: {exc}") from exc

    def save(self, folder: str | Path) -> None:
        """Write tokenizer.json, tokenizer_config.json and the chat template."""
        self._tok.save_pretrained(str(folder))

    @property
    def hf_tokenizer(self) -> Any:
        """The wrapped transformers tokenizer (for libraries that read a vocabulary, e.g. xgrammar)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> token ids (special-token text in ``text`` is parsed). An empty prompt is an error."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"prompt must be a string, got {type(text).__name__}")
        if not text:
            raise InvalidRequestError("prompt is empty")
        check_unicode(text, "prompt")
        if self._native is not None:
            return self._native.encode(text, add_special_tokens=add_special_tokens).ids
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def encode_plain(self, text: str) -> list[int]:
        """Text -> token ids with special-token text tokenized as ordinary characters (no BOS either)."""
        check_unicode(text, "text")
        backend = self._tok.backend_tokenizer
        previous = backend.encode_special_tokens
        backend.encode_special_tokens = True
        try:
            return list(backend.encode(text, add_special_tokens=False).ids)
        finally:
            backend.encode_special_tokens = previous

    def _control_texts(self) -> list[str]:
        """Strings the tokenizer would turn into an added (control) token wherever they appear."""
        return [t for t in self._tok.get_added_vocab() if t]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return self._tok.convert_ids_to_tokens(ids)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Render ``messages`` with the model's template and tokenize; message content stays plain text."""
        if not messages:
            raise InvalidRequestError("messages is empty")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
                raise InvalidRequestError(f"messages[{i}] needs a 'role' and a string 'content'")
            check_unicode(m["content"], f"messages[{i}].content")
            check_unicode(str(m["role"]), f"messages[{i}].role")
        if not self.has_chat_template:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            text += "assistant: " if add_generation_prompt else ""
            if not self._forges_control(messages):
                return self.encode(text)
            return list(self._tok.build_inputs_with_special_tokens(self.encode_plain(text)))
        render = self._render(messages, add_generation_prompt)
        if not self._forges_control(messages):
            return self.encode(render, add_special_tokens=False)
        return self._encode_guarded(messages, add_generation_prompt, render)

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def _forges_control(self, messages: list[dict[str, str]]) -> bool:
        controls = self._control_texts()
        return any(c in m["content"] for m in messages for c in controls)

    def _encode_guarded(self, messages: list[dict[str, str]], add_generation_prompt: bool, render: str) -> list[int]:
        """Template text tokenized with its control tokens, every message's content as plain text.

        The template is rendered once more with a random marker in place of each content; the rendered
        text splits at the markers into template pieces and contents. Where the template transforms
        content (trims it, say) the markers cannot stand for it, and such a request is refused.
        """
        tag = secrets.token_hex(8)
        marks = [f"\uE000{tag}{i}\uE001" for i in range(len(messages))]
        marked = self._render([{**m, "content": mk} for m, mk in zip(messages, marks, strict=True)],
                              add_generation_prompt)
        pieces = re.split(f"(\uE000{tag}\\d+\uE001)", marked)
        by_mark = {mk: m["content"] for mk, m in zip(marks, messages, strict=True)}
        rebuilt = "".join(by_mark.get(p, p) for p in pieces)
        if rebuilt != render or any(marked.count(mk) != 1 for mk in marks):
            raise InvalidRequestError("message content contains special-token text, which this model's chat "
                                      "template cannot keep apart from its control tokens")
        ids: list[int] = []
        for p in pieces:
            if p in by_mark:
                ids += self.encode_plain(by_mark[p]) if by_mark[p] else []
            elif p:
                ids += self._tok.encode(p, add_special_tokens=False)
        return ids

    def decode_stream(self, context_ids: list[int], skip_special_tokens: bool) -> tuple[Any, Any] | None:
        """(backend tokenizer, ``DecodeStream`` primed with ``context_ids``) for :class:`IncrementalDetokenizer`,
        or None where the native stream would not decode as :meth:`decode` does: a slow (Python) tokenizer, a
        decode that cleans up spaces, or a ``tokenizers`` without ``DecodeStream(ids=...)`` (before 0.22)."""
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None or getattr(self._tok, "clean_up_tokenization_spaces", False):
            return None
        try:
            from tokenizers.decoders import DecodeStream

            return backend, DecodeStream(ids=list(context_ids), skip_special_tokens=skip_special_tokens)
        except (ImportError, TypeError):
            return None

    def detokenizer(self, prompt_ids: list[int] | None = None,
                    skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids or [], skip_special_tokens)


def check_unicode(text: str, what: str) -> None:
    """InvalidRequestError unless ``text`` is encodable as UTF-8 (no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"{what} is not valid Unicode (a lone surrogate at index {exc.start})") from None


class IncrementalDetokenizer:
    """Streaming text from a growing id list: each :meth:`step` returns only text that is complete (a
    token ending in an unfinished UTF-8 sequence is held back until the sequence is whole).

    Two paths give the same pieces (``tests/engine/test_tokenizer.py`` checks them against each other):
    ``tokenizers``' native :class:`~tokenizers.decoders.DecodeStream` where the tokenizer has a fast backend
    and its decode applies no clean-up of spaces (0.6–1.3 µs a token on the default model, against 5 µs for
    the window below: the engine core detokenizes every sampled token), else vLLM's prefix/read offsets over
    transformers' ``decode``, each step decoding a short window of recent tokens.
    """

    _CONTEXT = 5  # tokens of left context so merges (leading spaces) decode as in the full text

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True,
                 native: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-self._CONTEXT:])
        self._prefix = 0
        self._read = len(self.ids)
        self.text = ""
        self._stream = tokenizer.decode_stream(self.ids, skip_special_tokens) if native else None

    def step(self, new_ids: list[int]) -> str:
        """Add token ids; return the newly completed text (possibly '')."""
        if self._stream is not None:
            backend, stream = self._stream
            delta = stream.step(backend, new_ids) or ""
            self.text += delta
            return delta
        self.ids.extend(new_ids)
        prefix_text = self._tok.decode(self.ids[self._prefix:self._read], self._skip)
        full = self._tok.decode(self.ids[self._prefix:], self._skip)
        if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
            delta = full[len(prefix_text):]
            self._prefix, self._read = self._read, len(self.ids)
            self.text += delta
            return delta
        return ""
