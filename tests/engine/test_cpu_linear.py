"""oneDNN-packed linears (engine.cpu_linear): same function, same parameters, as the plain model."""

from __future__ import annotations

import pytest
import torch

import kernels.cpu as native_kernels
from engine.cpu_linear import PackedLinear, fuse_linears, fuse_projections, onednn_available, pack_linears
from engine.model import DenseKVCache
from engine.quant import int4_kernel_available, quantize_model
from tests.engine.engine_helpers import tiny_model

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias-tied"])
@torch.inference_mode()
def test_packed_model_logits_match_plain_model(variant):
    plain, packed = tiny_model(variant), tiny_model(variant)
    keys = set(packed.state_dict())
    assert pack_linears(packed) == 7 * len(packed.layers) + 1
    assert set(packed.state_dict()) == keys                    # same parameter names: loaders still work
    assert isinstance(packed.layers[0].mlp.down_proj, PackedLinear)
    if packed.config.tie_word_embeddings:
        assert packed.lm_head.weight is packed.model.embed_tokens.weight
    ids = torch.randint(0, packed.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    logits = [m.logits(m(ids, torch.arange(40), DenseKVCache(m.config, 40))) for m in (plain, packed)]
    err = float((logits[1] - logits[0]).abs().max() / logits[0].abs().max())
    assert 0 < err < 1e-5 or torch.equal(*logits)


@pytest.mark.parametrize("rows", [1, 2, 7, 33])
def test_packed_linear_matches_f_linear_at_any_row_count(rows):
    lin = torch.nn.Linear(64, 48, bias=True)
    x = torch.randn(rows, 64)
    torch.testing.assert_close(PackedLinear(lin, rows_hint=8)(x), lin(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3])
def test_large_packed_linear_one_row_path_matches(rows):
    """A weight of >= 4M elements (an LM head) also keeps a transposed copy for one-row products."""
    lin = torch.nn.Linear(256, 1 << 14, bias=True)
    packed = PackedLinear(lin)
    assert packed.weight_t is not None
    x = torch.randn(rows, 256)
    torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3])
def test_one_row_copy_of_a_small_weight_matches(rows):
    lin = torch.nn.Linear(64, 128, bias=True)
    packed = PackedLinear(lin, one_row_copy=True)
    assert packed.weight_t is not None and PackedLinear(lin).weight_t is None
    x = torch.randn(rows, 64)
    torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not native_kernels.available(), reason="native kernels not built here")
@pytest.mark.parametrize("rows", [1, 3])
def test_native_one_row_products_keep_no_copy_and_match(rows):
    """``native``: one-row products through kernels.cpu.f32_mm over the weight itself; other rows oneDNN."""
    lin = torch.nn.Linear(96, 1 << 15, bias=True)   # a head-sized weight: it would otherwise keep a copy
    packed = PackedLinear(lin, native=True)
    assert packed.weight_t is None and packed.native
    x = torch.randn(rows, 96)
    torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)


def _decode_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Prefill all but the last token, then one-row steps (the decode shape) for the last 3."""
    n = ids.shape[0]
    cache = DenseKVCache(model.config, n)
    model(ids[:n - 3], torch.arange(n - 3), cache)
    cache.advance()
    rows = []
    for i in range(n - 3, n):
        rows.append(model.logits(model(ids[i:i + 1], torch.tensor([i]), cache)))
        cache.advance()
    return torch.cat(rows)


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias-tied"])
@torch.inference_mode()
def test_fused_projections_match_the_separate_ones(variant):
    plain, fused, nat = tiny_model(variant), tiny_model(variant), tiny_model(variant)
    pack_linears(plain), pack_linears(fused, one_row_copies=True)
    pack_linears(nat, native=native_kernels.available())
    keys = set(fused.state_dict())
    assert fuse_projections(fused) == 2 * len(fused.layers)
    assert set(fused.state_dict()) == keys                     # the fused products are not submodules
    attn = fused.layers[0].self_attn
    assert attn.fused_qkv.out_features == attn.q_proj.out_features + 2 * attn.k_proj.out_features
    # the parts' weights are row views of the fused weight: nothing stored twice
    assert attn.k_proj.weight.data_ptr() == attn.fused_qkv.weight[attn.q_proj.out_features].data_ptr()
    assert attn.q_proj.packed is None and attn.q_proj.weight_t is None and attn.fused_qkv.weight_t is not None
    ids = torch.randint(0, fused.config.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    fuse_projections(nat)
    assert nat.layers[0].self_attn.fused_qkv.native == native_kernels.available()
    for run in (lambda m: m.logits(m(ids, torch.arange(24), DenseKVCache(m.config, 24))),
                lambda m: _decode_logits(m, ids)):
        torch.testing.assert_close(run(fused), run(plain), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(run(nat), run(plain), rtol=1e-5, atol=1e-5)
    x = torch.randn(2, attn.q_proj.in_features)                # a part alone still computes its own rows
    torch.testing.assert_close(attn.k_proj(x), plain.layers[0].self_attn.k_proj(x), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not int4_kernel_available(), reason="torch lacks the int4 CPU kernel")
@torch.inference_mode()
def test_fused_int4_projections_match_the_separate_ones():
    from tests.engine.test_quant import tiny

    plain, fused = tiny(), tiny()
    quantize_model(plain, "int4"), quantize_model(fused, "int4")
    assert fuse_projections(fused) == 2 * len(fused.layers)
    mlp = fused.layers[0].mlp
    assert mlp.gate_proj.planes[0].packed.data_ptr() == mlp.fused_gate_up.planes[0].packed.data_ptr()
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(2))
    # decode rows run the int4 kernel, the prefill rows the dequantized GEMM: both must agree
    torch.testing.assert_close(_decode_logits(fused, ids), _decode_logits(plain, ids), rtol=1e-5, atol=1e-5)
    full = [m.logits(m(ids, torch.arange(24), DenseKVCache(m.config, 24))) for m in (fused, plain)]
    torch.testing.assert_close(*full, rtol=1e-5, atol=1e-5)
    for name in ("gate_proj", "up_proj"):                     # the parts still dequantize to their own rows
        assert torch.equal(getattr(mlp, name).dequantize(), getattr(plain.layers[0].mlp, name).dequantize())


def test_projections_of_different_kinds_are_not_fused():
    lin = torch.nn.Linear(64, 64, bias=False)
    assert fuse_linears([PackedLinear(lin), lin]) is None      # an unpacked part
    assert fuse_linears([PackedLinear(lin), PackedLinear(torch.nn.Linear(32, 64, bias=False))]) is None
    assert fuse_linears([PackedLinear(lin), PackedLinear(torch.nn.Linear(64, 64, bias=True))]) is None
