"""Tokenizer, chat template and streaming detokenization on the default model's tokenizer."""

from __future__ import annotations

import pytest

from engine import InvalidRequestError, Tokenizer

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def tok(default_model_dir):
    return Tokenizer.from_folder(default_model_dir)


def test_empty_prompt_is_a_clear_error(tok):
    with pytest.raises(InvalidRequestError, match="empty"):
        tok.encode("")
    with pytest.raises(InvalidRequestError, match="messages"):
        tok.apply_chat_template([])


def test_chat_template_is_the_models(tok):
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")


def test_detokenizer_keeps_special_tokens_when_asked(tok):
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    for skip, has_marker in [(True, False), (False, True)]:
        detok = tok.detokenizer(ids[:1], skip_special_tokens=skip)
        text = "".join(detok.step([i]) for i in ids[1:])
        assert ("<|im_start|>" in text) is has_marker and "assistant" in text


@pytest.mark.parametrize("text", [
    "plain ascii words, with punctuation!",
    "Ünïcödé: 日本語のテキスト, emoji 🎉🚀 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 letters",
    "  leading spaces and\nnew lines\n\n",
])
def test_incremental_detokenization_matches_full_decode(tok, text):
    ids = tok.encode(text)
    detok = tok.detokenizer([])
    pieces = [detok.step([i]) for i in ids]
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # never a broken UTF-8 character mid-stream


def test_incremental_with_prompt_context(tok):
    prompt = tok.encode("The answer is")
    gen = tok.encode(" forty-two ✓", add_special_tokens=False)
    detok = tok.detokenizer(prompt)
    assert "".join(detok.step([i]) for i in gen) == tok.decode(prompt + gen)[len(tok.decode(prompt)):]
