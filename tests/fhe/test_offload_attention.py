"""Client-aided attention as linear steps (fhe.offload_attention) against the torch layer, under real SEAL."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from engine.config import ModelConfig
from engine.model import DecoderLayer, DenseKVCache, RotaryEmbedding
from fhe.backends.seal.keys import CKKSClient
from fhe.errors import LevelError, ShapeError
from fhe.mlp import MLP_PARAMS
from fhe.offload_attention import (
    AttentionLinearClient,
    ClientKV,
    EncryptedAttentionLinear,
    attention_geometry,
    run_client_aided,
)

#: max |encrypted - torch fp64| of a projection, and of the attention output relative to its magnitude
#: (CKKS error is absolute at the scale and grows with the weights): measured 3e-7 relative on these
#: random layers (outputs up to ~30); the bounds keep a 6x margin and still catch any misplaced slot.
MAX_ERR = 1e-5
MAX_REL = 2e-6


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    err = (got - ref).abs().max().item()
    assert err < MAX_REL * max(1.0, ref.abs().max().item()), err


def _cfg(bias: bool) -> ModelConfig:
    # SmolLM2's attention shape (hidden 576, 9 heads of 64, 3 KV heads), one layer's worth
    return ModelConfig(97, 576, 64, 4, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                       attention_bias=bias)


def _layer(cfg: ModelConfig, seed: int = 0) -> DecoderLayer:
    torch.manual_seed(seed)
    layer = DecoderLayer(cfg, 2)
    with torch.no_grad():
        for p in layer.self_attn.parameters():
            p.normal_(0.0, cfg.hidden_size ** -0.5 * 3)      # scores of a few units: a peaked softmax
        layer.input_layernorm.weight.add_(torch.randn(cfg.hidden_size) * 0.3)  # a dropped gain shows
    return layer.double()


def _reference(layer: DecoderLayer, cfg: ModelConfig, h: torch.Tensor) -> torch.Tensor:
    """The layer's own attention (float64 copy) over positions 0..T-1 with a dense cache."""
    ref = copy.deepcopy(layer)
    cache = DenseKVCache(cfg, h.shape[0], dtype=torch.float64)
    with torch.no_grad():
        return ref.self_attn(ref.input_layernorm(h), torch.arange(h.shape[0]), RotaryEmbedding(cfg), cache)


def _setup(layer: DecoderLayer, cfg: ModelConfig):
    server = EncryptedAttentionLinear(layer, cfg, MLP_PARAMS)
    keys = CKKSClient(MLP_PARAMS, tuple(server.rotation_steps))
    return server, AttentionLinearClient(keys, server.layout, cfg.rms_norm_eps), keys.server_keys()


@pytest.fixture(scope="module")
def smollm2_shaped():
    cfg = _cfg(bias=True)
    layer = _layer(cfg)
    return cfg, layer, *_setup(layer, cfg)


def test_prefill_then_decode_match_the_torch_attention(smollm2_shaped):
    """Three positions in one chunk, then a fourth alone, over the client's clear cache: equal to the layer."""
    cfg, layer, server, client, keys = smollm2_shaped
    h = torch.randn(4, cfg.hidden_size, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2
    rope, cache = RotaryEmbedding(cfg), ClientKV()
    got = torch.cat([run_client_aided(server, client, layer, rope, h[:3], torch.arange(3), cache, keys),
                     run_client_aided(server, client, layer, rope, h[3:], torch.arange(3, 4), cache, keys)])
    _close(got, _reference(layer, cfg, h))


def test_qkv_step_decrypts_to_the_projections_with_bias(smollm2_shaped):
    """What the server returns is exactly [q; k; v] of the normalized input (bias included), nothing else,
    one position per ciphertext."""
    cfg, layer, server, client, keys = smollm2_shaped
    h = torch.randn(2, cfg.hidden_size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    att, x = layer.self_attn, layer.input_layernorm(h)
    vals = client.decrypt([server.qkv(ct, keys) for ct in client.encrypt(client.input_rows(h))])
    with torch.no_grad():
        for got, proj in zip(client.split_qkv(vals), (att.q_proj, att.k_proj, att.v_proj), strict=True):
            assert (got.reshape(2, -1) - proj(x)).abs().max().item() < MAX_ERR


def test_geometry_from_shapes_equals_the_servers(smollm2_shaped):
    from fhe.offload_attention import ATTENTION_PARTS
    from fhe.offload_steps import chunk_shapes

    cfg, _, server, _, _ = smollm2_shaped
    layout, steps = attention_geometry(cfg, MLP_PARAMS)
    chunks = chunk_shapes(cfg, MLP_PARAMS)
    assert set(steps) | {s for p in ATTENTION_PARTS for s in chunks[p].rotation_steps} == server.rotation_steps
    assert all(server.chunks.shapes[p] == chunks[p] for p in ATTENTION_PARTS)
    assert np.array_equal(layout.qkv_slots, server.layout.qkv_slots)
    assert np.array_equal(layout.o_slots, server.layout.o_slots)
    assert (layout.qkv_period, layout.o_period) == (server.layout.qkv_period, server.layout.o_period)


def test_no_bias_model_and_bad_inputs():
    cfg = _cfg(bias=False)
    layer = _layer(cfg, seed=3)
    server, client, keys = _setup(layer, cfg)
    h = torch.randn(2, cfg.hidden_size, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    got = run_client_aided(server, client, layer, RotaryEmbedding(cfg), h, torch.arange(2), ClientKV(), keys)
    _close(got, _reference(layer, cfg, h))
    with pytest.raises(ShapeError):
        client.input_rows(torch.zeros(1, cfg.hidden_size + 1))
    with pytest.raises(ShapeError):
        client.mixture_rows(torch.full((1, 576), float("nan")))
    stale = server.qkv(client.encrypt(client.input_rows(h[:1]))[0], keys)      # level 1: not fresh
    with pytest.raises(LevelError):
        server.o(stale, keys)
