"""Tokenizer, chat template and incremental detokenization.

Wraps the model's own ``tokenizer.json`` / ``tokenizer_config.json`` through transformers (which uses
``tokenizers`` underneath) and renders its jinja chat template. :class:`IncrementalDetokenizer` turns a
growing list of token ids into text deltas that never split a UTF-8 character.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.errors import InvalidRequestError, ModelLoadError


class Tokenizer:
    """The model's tokenizer and chat template."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self._tok = hf_tokenizer

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
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> token ids. An empty prompt is an error (nothing to condition on)."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"prompt must be a string, got {type(text).__name__}")
        if not text:
            raise InvalidRequestError("prompt is empty")
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return self._tok.convert_ids_to_tokens(ids)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Render ``messages`` with the model's template and tokenize."""
        if not messages:
            raise InvalidRequestError("messages is empty")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
                raise InvalidRequestError(f"messages[{i}] needs a 'role' and a string 'content'")
        if not self.has_chat_template:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return self.encode(text + ("assistant: " if add_generation_prompt else ""))
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)

    def detokenizer(self, prompt_ids: list[int] | None = None,
                    skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids or [], skip_special_tokens)


class IncrementalDetokenizer:
    """Streaming text from a growing id list, vLLM-style (prefix/read offsets).

    Each :meth:`step` decodes a short window of recent tokens and emits only text that is complete:
    a window ending in an unfinished UTF-8 sequence decodes to U+FFFD and is held back.
    """

    _CONTEXT = 5  # tokens of left context so merges (leading spaces) decode as in the full text

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-self._CONTEXT:])
        self._prefix = 0
        self._read = len(self.ids)
        self.text = ""

    def step(self, new_ids: list[int]) -> str:
        """Add token ids; return the newly completed text (possibly '')."""
        self.ids.extend(new_ids)
        prefix_text = self._tok.decode(self.ids[self._prefix:self._read], self._skip)
        full = self._tok.decode(self.ids[self._prefix:], self._skip)
        if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
            delta = full[len(prefix_text):]
            self._prefix, self._read = self._read, len(self.ids)
            self.text += delta
            return delta
        return ""
