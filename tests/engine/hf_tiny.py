"""Tiny random Hugging Face models (built from config objects) and their conversion to ours."""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.loader import build_model

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6)

VARIANTS = {
    "llama-mha": dict(model_type="llama", num_key_value_heads=4, rope_theta=10000.0),
    "llama-gqa": dict(model_type="llama", num_key_value_heads=2, rope_theta=500000.0),
    "llama3-rope-scaling": dict(
        model_type="llama", num_key_value_heads=2,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen2-bias-tied": dict(model_type="qwen2", num_key_value_heads=2, rope_theta=1000000.0,
                            tie_word_embeddings=True),
}


def hf_tiny(variant: str, seed: int = 0):
    """A random-initialised transformers model of the variant (fp32, eval mode)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(BASE, **VARIANTS[variant])
    model_type = kw.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # make biases and norm gains non-trivial so a dropped term shows
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return hf


def ours_from_hf(hf) -> torch.nn.Module:
    """Our model on the same weights."""
    cfg = ModelConfig.from_hf_dict(hf.config.to_dict())
    return build_model(cfg, dict(hf.state_dict()), "hf-tiny")
