"""The fused forward (engine.fused) computes the reference model's function on the same weights.

On CPU the kernels run their torch references, so this checks the fused wiring (weight concatenation,
residual stream, shared RoPE tables); tests/engine/test_engine_gpu.py checks it with the Triton kernels.
"""

from __future__ import annotations

import pytest
import torch

from engine.fused import FusedLlama
from engine.model import DenseKVCache
from tests.engine.engine_helpers import random_prompts, tiny_model
from tests.engine.hf_tiny import VARIANTS


def run_steps(model, cfg, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits of every position, fed in chunks through a dense cache: [len(ids), V]."""
    cache, out, start = DenseKVCache(cfg, len(ids)), [], 0
    for n in chunks:
        h = model(torch.tensor(ids[start:start + n]), torch.arange(start, start + n), cache)
        cache.advance()
        out.append(model.logits(h))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@torch.inference_mode()
def test_fused_forward_equals_reference(variant):
    model = tiny_model(variant, seed=3)
    ids = random_prompts([21], seed=4)[0]
    chunks = [13, 1, 1, 6]
    want = run_steps(model, model.config, ids, chunks)
    fused = FusedLlama(model)
    got = run_steps(fused, model.config, ids, chunks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the reference forward still runs on the (now sliced) parameters
    torch.testing.assert_close(run_steps(model, model.config, ids, chunks), want, rtol=0, atol=0)


def test_fused_weights_share_storage_with_the_model():
    model = tiny_model("qwen2-bias-tied")
    fused = FusedLlama(model)
    attn, mlp, w = model.layers[1].self_attn, model.layers[1].mlp, fused.fused[1]
    assert attn.k_proj.weight.data_ptr() == w.qkv[attn.q_proj.out_features].data_ptr()
    assert attn.v_proj.bias.data_ptr() == w.qkv_bias[-attn.v_proj.out_features:].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == w.gate_up[mlp.gate_proj.out_features].data_ptr()
    with torch.no_grad():
        attn.k_proj.weight.add_(1.0)  # a write through the model is seen by the fused weight
    assert torch.equal(w.qkv[attn.q_proj.out_features:][: attn.k_proj.out_features], attn.k_proj.weight)
