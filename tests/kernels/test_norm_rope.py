"""Fused RMSNorm / residual-add and RoPE references against the reference model's own pieces."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.model import RMSNorm, RotaryEmbedding, apply_rope
from kernels import KernelInputError, add_rms_norm, rms_norm, rope


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_model(dtype):
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, eps=1e-5)
    norm.weight.data = torch.randn(96, generator=gen)
    x = torch.randn(7, 96, generator=gen).to(dtype)
    want = (norm.weight.float() * norm.normalize(x).float())
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(rms_norm(x, norm.weight.data, 1e-5).float(), want, rtol=tol, atol=tol)


def test_add_rms_norm_returns_new_residual():
    gen = torch.Generator().manual_seed(1)
    x, r = torch.randn(5, 32, generator=gen), torch.randn(5, 32, generator=gen)
    w = torch.randn(32, generator=gen)
    normed, h = add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(normed, rms_norm(x + r, w, 1e-6))
    with pytest.raises(KernelInputError, match="residual"):
        add_rms_norm(x, r[:4], w, 1e-6)


def test_rope_matches_model():
    cfg = ModelConfig(vocab_size=10, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0)
    rot = RotaryEmbedding(cfg)
    gen = torch.Generator().manual_seed(2)
    pos = torch.tensor([0, 5, 17, 3])
    q, k = torch.randn(4, 4, 16, generator=gen), torch.randn(4, 2, 16, generator=gen)
    cos, sin = rot.cos_sin(pos)
    qr, kr = rope(q, k, cos, sin)
    torch.testing.assert_close(qr, apply_rope(q, cos, sin))
    torch.testing.assert_close(kr, apply_rope(k, cos, sin))
    with pytest.raises(KernelInputError, match="cos"):
        rope(q, k, cos[:3], sin)
