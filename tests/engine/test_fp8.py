"""FP8 weights (engine.fp8, ``cuda_weight_format = "fp8"``) on CPU, where the kernels run their torch
references: per-channel e4m3 quantization, which path each row count takes, and the fused forward with fp8
weights = the model on the dequantized weights for decode rows (weight-only) and close to it for prefill
rows (W8A8). tests/engine/test_engine_gpu.py runs the same forward on CUDA."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import engine.fp8
import kernels
from engine.engine_config import EngineConfig
from engine.errors import ParallelConfigError
from engine.fp8 import GEMV_MAX_ROWS, Fp8Linear, check_device
from engine.fused import FusedLlama
from tests.engine.engine_helpers import random_prompts, tiny_model
from tests.engine.test_model import our_logits


def test_quantize_is_per_channel_round_to_nearest():
    w = torch.randn(48, 96) * torch.logspace(-3, 1, 48)[:, None]
    lin = Fp8Linear.quantize(w)
    assert lin.weight.dtype == torch.float8_e4m3fn and lin.scale.shape == (48,)
    torch.testing.assert_close(lin.scale, w.abs().amax(1) / 448)
    assert torch.equal(lin.weight.float().abs().amax(1), torch.full((48,), 448.0))  # each row's amax -> 448
    err = (lin.dequantize(torch.float32) - w).abs()
    assert (err <= w.abs() / 16 + lin.scale[:, None] * 2.0**-10 + 1e-9).all()   # half an e4m3 step
    assert lin.nbytes() == 48 * 96 + 4 * 48


def test_rows_pick_the_path():
    """One row, or up to GEMV_MAX_ROWS rows of a small weight: weight-only (x not rounded); more: W8A8; a
    shape _scaled_mm refuses: the dequantized weight."""
    lin = Fp8Linear.quantize(torch.randn(48, 96))
    deq = lin.dequantize(torch.float32)
    bias = torch.randn(48)
    few = torch.randn(GEMV_MAX_ROWS, 96)
    torch.testing.assert_close(lin(few, bias), F.linear(few, deq, bias))
    many = torch.randn(GEMV_MAX_ROWS + 1, 96)
    torch.testing.assert_close(lin(many, bias), kernels.scaled_mm_fp8_reference(many, lin.weight, lin.scale, bias))
    assert not torch.allclose(lin(many, bias), F.linear(many, deq, bias), rtol=1e-4, atol=1e-4)
    engine.fp8.GEMV_MAX_BYTES, saved = 2 * 48 * 96, engine.fp8.GEMV_MAX_BYTES  # 2 rows of this weight
    try:  # more rows x weight bytes than the limit: W8A8 even under GEMV_MAX_ROWS; one row: always the GEMV
        torch.testing.assert_close(lin(few[:3], bias), kernels.scaled_mm_fp8_reference(few[:3], lin.weight,
                                                                                      lin.scale, bias))
        torch.testing.assert_close(lin(few[:2], bias), F.linear(few[:2], deq, bias))
        engine.fp8.GEMV_MAX_BYTES = 0
        torch.testing.assert_close(lin(few[:1], bias), F.linear(few[:1], deq, bias))
    finally:
        engine.fp8.GEMV_MAX_BYTES = saved
    odd = Fp8Linear.quantize(torch.randn(97, 96))            # 97 output rows: not a multiple of 16
    assert not odd.gemm_ok
    torch.testing.assert_close(odd(many), F.linear(many, odd.dequantize(torch.float32)))


def _dequantized_twin(model, fused: FusedLlama):
    """The reference model holding the fp8 forward's dequantized weights."""
    deq = copy.deepcopy(model)
    for layer, w in zip(deq.layers, fused.fused, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        qkv, gate_up = w.qkv.dequantize(torch.float32), w.gate_up.dequantize(torch.float32)
        q, k = attn.q_proj.out_features, attn.k_proj.out_features
        attn.q_proj.weight.data, attn.k_proj.weight.data, attn.v_proj.weight.data = qkv[:q], qkv[q:q + k], qkv[q + k:]
        g = mlp.gate_proj.out_features
        mlp.gate_proj.weight.data, mlp.up_proj.weight.data = gate_up[:g], gate_up[g:]
        attn.o_proj.weight.data = w.o.dequantize(torch.float32)
        mlp.down_proj.weight.data = w.down.dequantize(torch.float32)
    deq.lm_head = torch.nn.Linear(deq.config.hidden_size, deq.config.vocab_size, bias=False)
    deq.lm_head.weight.data = fused.quant_head.dequantize(torch.float32)
    return deq


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias-tied"])
@torch.inference_mode()
def test_fp8_fused_forward(variant):
    model = tiny_model(variant, seed=3)
    ids = torch.tensor(random_prompts([21], seed=4)[0])
    fused = FusedLlama(copy.deepcopy(model), fp8=True)
    assert all(isinstance(t, Fp8Linear) for w in fused.fused for t in (w.qkv, w.gate_up, w.o, w.down))
    deq = _dequantized_twin(model, fused)
    # decode rows (one token a step): weight-only, the dequantized model's function
    torch.testing.assert_close(our_logits(fused, ids, [1] * 21), our_logits(deq, ids, [1] * 21),
                               rtol=1e-4, atol=1e-4)
    # a prefill chunk: activations rounded to e4m3 per token, close to it but not equal
    got, want = our_logits(fused, ids, [21]), our_logits(deq, ids, [21])
    rel = float((got - want).norm() / want.norm())
    assert 0 < rel < 0.05
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.8
    # and fp8 is not the fp32 model
    assert not torch.allclose(our_logits(fused, ids, [1] * 21), our_logits(model, ids, [1] * 21), atol=1e-4)


def test_resident_bytes_are_one_byte_a_weight_plus_scales():
    model = tiny_model("qwen2-bias-tied", seed=1)
    bf = FusedLlama(copy.deepcopy(model))
    f8 = FusedLlama(copy.deepcopy(model), fp8=True)
    cfg = model.config
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    gemms = [(q + 2 * kv, h), (2 * i, h), (h, q), (h, i)] * cfg.num_hidden_layers + [(cfg.vocab_size, h)]
    fp8_gemm = sum(n * k + 4 * n for n, k in gemms)
    layer_fp32 = sum(n * k * 4 for n, k in gemms[:-1])
    # fp32 model: every parameter once (tied head = embedding); fp8: the GEMMs at a byte + scales, the
    # embedding (the tied head's fp32 table) and the norms and biases unchanged
    assert bf.resident_weight_bytes() == sum(p.numel() * 4 for p in model.parameters())
    assert f8.resident_weight_bytes() == bf.resident_weight_bytes() - layer_fp32 + fp8_gemm


def test_untied_head_drops_its_16_bit_copy():
    model = tiny_model("llama-gqa", seed=1)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    f8 = FusedLlama(model, fp8=True)
    assert model.lm_head.weight.numel() == 0 and f8.quant_head.weight.shape == (97, model.config.hidden_size)


def test_config_accepts_fp8_and_refuses_others():
    assert EngineConfig(device="cpu", cuda_weight_format="fp8").cuda_weight_format == "fp8"
    with pytest.raises(ValueError, match="cuda_weight_format"):
        EngineConfig(device="cpu", cuda_weight_format="fp8_e5m2")
    with pytest.raises(ValueError, match="exclude"):
        FusedLlama(tiny_model("llama-gqa"), int4_group=16, fp8=True)
    check_device(torch.device("cpu"))  # CPU runs the references: never refused
    with pytest.raises(ParallelConfigError, match="cuda_weight_format"):  # the head's vocabulary gather
        EngineConfig(device="cpu", tensor_parallel_size=2, cuda_weight_format="fp8")
