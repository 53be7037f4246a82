"""The fused forward (engine.fused) computes the reference model's function on the same weights.

On CPU the kernels run their torch references, so this checks the fused wiring (weight concatenation,
residual stream, shared RoPE tables); tests/engine/test_engine_gpu.py checks it with the Triton kernels.
"""

from __future__ import annotations

import copy

import pytest
import torch

from engine.fused import FusedLlama
from kernels._common import HAS_TRITON, _interpreting
from tests.engine.engine_helpers import random_prompts, tiny_model
from tests.engine.hf_tiny import VARIANTS
from tests.engine.test_model import our_logits

INTERPRET = HAS_TRITON and _interpreting()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@torch.inference_mode()
def test_fused_forward_equals_reference(variant):
    model = tiny_model(variant, seed=3)
    ids = torch.tensor(random_prompts([21], seed=4)[0])
    chunks = [13, 1, 1, 6]
    want = our_logits(model, ids, chunks)
    fused = FusedLlama(model)
    got = our_logits(fused, ids, chunks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the reference forward still runs on the (now sliced) parameters
    torch.testing.assert_close(our_logits(model, ids, chunks), want, rtol=0, atol=0)


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


@torch.inference_mode()
def test_int4_fused_forward_is_the_dequantized_model():
    """int4 weights (chunks of 13 rows dequantize, single rows take gemv_int4's torch reference on CPU):
    the same function as the reference model on the dequantized weights."""
    model = tiny_model("llama-gqa", seed=3)
    ids = torch.tensor(random_prompts([21], seed=4)[0])
    chunks = [13, 1, 1, 6]
    fused = FusedLlama(copy.deepcopy(model), int4_group=16)
    deq = copy.deepcopy(model)
    for layer, w in zip(deq.layers, fused.fused, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        qkv, gate_up = w.qkv.dequantize(torch.float32), w.gate_up.dequantize(torch.float32)
        q, k = attn.q_proj.out_features, attn.k_proj.out_features
        attn.q_proj.weight.data, attn.k_proj.weight.data = qkv[:q], qkv[q:q + k]
        attn.v_proj.weight.data = qkv[q + k:]
        mlp.gate_proj.weight.data = gate_up[:mlp.gate_proj.out_features]
        mlp.up_proj.weight.data = gate_up[mlp.gate_proj.out_features:]
        attn.o_proj.weight.data = w.o.dequantize(torch.float32)
        mlp.down_proj.weight.data = w.down.dequantize(torch.float32)
    deq.lm_head = torch.nn.Linear(deq.config.hidden_size, deq.config.vocab_size, bias=False)
    deq.lm_head.weight.data = fused.quant_head.dequantize(torch.float32)
    want = our_logits(deq, ids, chunks)
    got = our_logits(fused, ids, chunks)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.equal(want, our_logits(model, ids, chunks))  # int4 is not the bf16/fp32 model
    n, k = fused.fused[0].qkv.qweight.shape[0], model.config.hidden_size
    assert fused.fused[0].qkv.nbytes() == n * k // 2 + 2 * 2 * n * k // 16  # nibbles + fp16 scale, offset


def _paged_logits(model, ids: torch.Tensor, chunks: list[int], block_size: int = 4) -> torch.Tensor:
    """Logits of every position, fed in chunks through the paged cache's kernels path (one sequence:
    a one-token chunk is a decode row, a longer one a prefill chunk)."""
    from engine.kv_cache import AttentionMetadata, PagedAttention, PagedKVCache

    cfg = model.config
    blocks = -(-ids.numel() // block_size)
    cache = PagedKVCache(cfg, blocks, block_size, torch.float32, "cpu")
    table = torch.arange(blocks, dtype=torch.int32)[None, :]
    out, start = [], 0
    for n in chunks:
        end = start + n
        slots = torch.arange(start, end)
        ctx = torch.tensor([end], dtype=torch.int32)
        if n == 1:
            meta = AttentionMetadata(slots, 1, table, ctx)
        else:
            meta = AttentionMetadata(slots, 0, prefill_block_tables=table,
                                     prefill_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                                     prefill_context_lens=ctx, prefill_max_q=n)
        h = model(ids[start:end], torch.arange(start, end), PagedAttention(cache, meta, cfg.head_dim))
        out.append(model.logits(h))
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("int4", [False, True])
@torch.inference_mode()
def test_decode_fusions_compute_the_unfused_function(int4):
    """The decode fusions (norm / SiLU·mul GEMV prologues, RoPE + store in one launch) on CPU run their
    torch references, which are the unfused ops: the same logits through the paged cache."""
    model = tiny_model("qwen2-bias-tied", seed=3)
    ids = torch.tensor(random_prompts([21], seed=4)[0])
    chunks = [13, 1, 1, 6]
    group = 16 if int4 else None
    on = FusedLlama(copy.deepcopy(model), int4_group=group, gemv_prologues=True, fused_rope_store=True)
    off = FusedLlama(copy.deepcopy(model), int4_group=group, gemv_prologues=False, fused_rope_store=False)
    torch.testing.assert_close(_paged_logits(on, ids, chunks), _paged_logits(off, ids, chunks), rtol=0, atol=0)
    if not int4:  # and the reference model's function
        torch.testing.assert_close(_paged_logits(on, ids, chunks), our_logits(model, ids, chunks),
                                   rtol=1e-5, atol=1e-5)


def _paged_greedy(model, prompt: list[int], steps: int, block_size: int = 4) -> list[int]:
    """Greedy tokens through the paged cache's kernels path: the prompt as one prefill chunk, then one-token
    decode rows (the rows the fused decode layers take)."""
    from engine.kv_cache import AttentionMetadata, PagedAttention, PagedKVCache

    cfg = model.config
    total = len(prompt) + steps
    blocks = -(-total // block_size)
    cache = PagedKVCache(cfg, blocks, block_size, torch.float32, "cpu")
    table = torch.arange(blocks, dtype=torch.int32)[None, :]
    n = len(prompt)
    meta = AttentionMetadata(torch.arange(n), 0, prefill_block_tables=table,
                             prefill_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                             prefill_context_lens=torch.tensor([n], dtype=torch.int32), prefill_max_q=n)
    h = model(torch.tensor(prompt), torch.arange(n), PagedAttention(cache, meta, cfg.head_dim))
    out = [int(model.logits(h)[-1].argmax())]
    for pos in range(n, total - 1):
        meta = AttentionMetadata(torch.tensor([pos]), 1, table, torch.tensor([pos + 1], dtype=torch.int32))
        h = model(torch.tensor(out[-1:]), torch.tensor([pos]), PagedAttention(cache, meta, cfg.head_dim))
        out.append(int(model.logits(h)[-1].argmax()))
    return out


@pytest.mark.parametrize("int4", [False, True])
@torch.inference_mode()
def test_fused_decode_layers_keep_the_function_and_the_greedy_tokens(int4):
    """EngineConfig.cuda_fused_decode_layers (kernels.decode_layer): on CPU its launchers run their torch
    references (the unfused ops), so the decode rows' logits and the greedy tokens equal the old path's."""
    model = tiny_model("qwen2-bias-tied", seed=3)
    ids = torch.tensor(random_prompts([21], seed=4)[0])
    group = 16 if int4 else None
    on = FusedLlama(copy.deepcopy(model), int4_group=group, fused_layers=True)
    off = FusedLlama(copy.deepcopy(model), int4_group=group, fused_layers=False)
    calls = []
    orig = on._forward_fused_layers
    on._forward_fused_layers = lambda *a: calls.append(a[0].shape[0]) or orig(*a)
    torch.testing.assert_close(_paged_logits(on, ids, [13, 1, 1, 3]), _paged_logits(off, ids, [13, 1, 1, 3]),
                               rtol=0, atol=0)
    assert calls == ([1, 1, 3] if int4 else [1, 1])  # the GEMV rows (int4: up to 4), not the 13-token prefill
    prompt = ids[:9].tolist()
    assert _paged_greedy(on, prompt, 12) == _paged_greedy(off, prompt, 12)
    calls.clear()  # a backend without a paged pool (the dense cache) keeps the unfused path
    torch.testing.assert_close(our_logits(on, ids, [13, 1]), our_logits(off, ids, [13, 1]), rtol=0, atol=0)
    assert calls == []


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernels on CPU need TRITON_INTERPRET=1")
@pytest.mark.parametrize("int4", [False, True])
@torch.inference_mode()
def test_fused_decode_layers_triton_kernels_keep_the_greedy_tokens(int4):
    """The decode-layer Triton kernels themselves (Triton's interpreter, fp32): logits within 1e-4 of the
    old path's and the same greedy tokens."""
    model = tiny_model("qwen2-bias-tied", seed=3)
    ids = torch.tensor(random_prompts([21], seed=4)[0])
    group = 16 if int4 else None
    on = FusedLlama(copy.deepcopy(model), int4_group=group, fused_layers=True, kernel_backend="triton")
    off = FusedLlama(copy.deepcopy(model), int4_group=group, fused_layers=False)
    torch.testing.assert_close(_paged_logits(on, ids, [13, 1, 1]), _paged_logits(off, ids, [13, 1, 1]),
                               rtol=1e-4, atol=1e-4)
    prompt = ids[:9].tolist()
    assert _paged_greedy(on, prompt, 6) == _paged_greedy(off, prompt, 6)
