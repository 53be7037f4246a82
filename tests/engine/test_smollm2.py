"""Our model on the real SmolLM2 weights against transformers (same folder, fp32)."""

from __future__ import annotations

import pytest
import torch

from engine import Tokenizer, greedy_generate, load_model
from tests.engine.test_model import our_logits, rel_err

pytestmark = pytest.mark.model

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Give me a tip for learning to code.",
    "Why is the sky blue?",
    "Name a famous painting by Leonardo da Vinci.",
]


@pytest.fixture(scope="module")
def models(default_model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()
    return load_model(default_model_dir), hf, Tokenizer.from_folder(default_model_dir)


@torch.inference_mode()
def test_logits_match_transformers(models):
    ours, hf, tok = models
    ids = torch.tensor(tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}]))
    ref = hf(ids[None]).logits[0].float()
    assert rel_err(our_logits(ours, ids, [ids.numel()]), ref) < 1e-4


@torch.inference_mode()
def test_greedy_continuations_match_transformers(models):
    ours, hf, tok = models
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}])
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
        got = greedy_generate(ours, ids, 20, {tok.eos_token_id})
        assert got == ref, prompt


@torch.inference_mode()
def test_answers_about_paris(models):
    ours, _, tok = models
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}])
    assert "Paris" in tok.decode(greedy_generate(ours, ids, 30, {tok.eos_token_id}))
