"""Tokenizer, chat template and streaming detokenization on the default model's tokenizer."""

from __future__ import annotations

import itertools

import pytest

from engine import IncrementalDetokenizer, InvalidRequestError, Tokenizer

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


def _detok(tok, prompt, native, skip=True):
    detok = IncrementalDetokenizer(tok, prompt, skip, native=native)
    assert (detok._stream is not None) is native   # the default model's tokenizer takes the native stream
    return detok


NATIVE = pytest.mark.parametrize("native", [True, False], ids=["native-stream", "window"])


@NATIVE
def test_detokenizer_keeps_special_tokens_when_asked(tok, native):
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    for skip, has_marker in [(True, False), (False, True)]:
        detok = _detok(tok, ids[:1], native, skip)
        text = "".join(detok.step([i]) for i in ids[1:])
        assert ("<|im_start|>" in text) is has_marker and "assistant" in text


@pytest.mark.parametrize("text", [
    "plain ascii words, with punctuation!",
    "Ünïcödé: 日本語のテキスト, emoji 🎉🚀 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 letters",
    "  leading spaces and\nnew lines\n\n",
])
@NATIVE
def test_incremental_detokenization_matches_full_decode(tok, text, native):
    ids = tok.encode(text)
    detok = _detok(tok, [], native)
    pieces = [detok.step([i]) for i in ids]
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # never a broken UTF-8 character mid-stream


@NATIVE
def test_incremental_with_prompt_context(tok, native):
    prompt = tok.encode("The answer is")
    gen = tok.encode(" forty-two ✓", add_special_tokens=False)
    detok = _detok(tok, prompt, native)
    assert "".join(detok.step([i]) for i in gen) == tok.decode(prompt + gen)[len(tok.decode(prompt)):]


@pytest.mark.parametrize("skip", [True, False])
def test_native_stream_gives_the_windows_pieces(tok, skip):
    """The two paths stream the same pieces, token by token (not only the same text): a chat turn with its
    control tokens, prose, code, multi-byte characters split over tokens, and one token at a time as well as
    several per step (a speculative step's accepted tokens)."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()[:3000]
    prompt = tok.apply_chat_template([{"role": "user", "content": "Ünïcödé 日本語 🎉🚀 𝔘𝔫𝔦"}])
    gen = tok.encode("<|im_start|>" + readme + " emoji 🎉🚀, 日本語のテキスト<|im_end|>", add_special_tokens=False)
    cuts = list(itertools.accumulate([1, 2, 3] * len(gen)))
    chunks = [gen[a:b] for a, b in zip([0] + cuts, cuts, strict=False) if a < len(gen)]
    for steps in ([[i] for i in gen], chunks):
        native, window = _detok(tok, prompt, True, skip), _detok(tok, prompt, False, skip)
        pieces = [(native.step(s), window.step(s)) for s in steps]
        assert [a for a, _ in pieces] == [b for _, b in pieces]
        assert native.text == window.text == tok.decode(prompt + gen, skip)[len(tok.decode(prompt, skip)):]


@pytest.mark.parametrize("text", ["Hello world", "  two  spaces ", "<|im_start|>user\nhi<|im_end|>", "ünï 東京 🙂 42",
                                  "a\n\n\tb", "x" * 300])
@pytest.mark.parametrize("special", [True, False])
def test_native_encode_gives_transformers_ids(tok, text, special):
    """``encode`` takes the fast backend directly (no batch hop): the same ids as transformers' encode."""
    assert tok._native is not None
    expected = list(tok.hf_tokenizer.encode(text, add_special_tokens=special))
    assert tok.encode(text, add_special_tokens=special) == expected


def test_a_tokenizer_whose_backend_disagrees_keeps_transformers_path():
    class Hf:
        class backend_tokenizer:  # noqa: N801 - the attribute transformers exposes
            @staticmethod
            def encode(text, add_special_tokens=True):
                class E:
                    ids = [1, 2, 3]
                return E()

        @staticmethod
        def encode(text, add_special_tokens=True):
            return [7]

    t = Tokenizer(Hf())
    assert t._native is None and t.encode("x") == [7]


def test_a_backend_that_truncates_keeps_transformers_path(tok):
    """tokenizer.json may set truncation: the backend's own encode would apply it, so transformers' path is kept."""
    import copy

    hf = copy.deepcopy(tok.hf_tokenizer)
    hf.backend_tokenizer.enable_truncation(max_length=4)
    t = Tokenizer(hf)
    text = "one two three four five six seven eight"
    assert t._native is None
    assert t.encode(text) == list(tok.hf_tokenizer.encode(text)) and len(t.encode(text)) > 4
