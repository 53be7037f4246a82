"""The client bundle withholds exactly the encrypted layers' attention weights."""

from __future__ import annotations

import json

import pytest
import torch

from fhe.bundle import BundleError, read_bundle, withheld_names, write_bundle
from tests.engine.hf_tiny import hf_tiny, ours_from_hf


def test_round_trip_withholds_server_side(tmp_path):
    model = ours_from_hf(hf_tiny("qwen2-bias-tied"))
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text('{"fake": true}')
    info = write_bundle(model, tmp_path / "tok", (1,), "ab" * 32, tmp_path / "b.safetensors")
    assert "model.layers.1.self_attn.q_proj.bias" in info["withheld"]
    assert not any(n.startswith("model.layers.1.self_attn") for n in info["tensors"])
    assert "model.layers.1.input_layernorm.weight" not in info["tensors"]
    assert "model.layers.0.self_attn.q_proj.weight" in info["tensors"]
    client, meta = read_bundle(tmp_path / "b.safetensors", tmp_path / "files")
    assert json.loads(meta["encrypted_layers"]) == [1]
    assert client.model.layers[1].self_attn.q_proj.weight.is_meta
    assert torch.equal(client.model.layers[0].self_attn.q_proj.weight, model.model.layers[0].self_attn.q_proj.weight)
    assert torch.equal(client.model.layers[1].mlp.up_proj.weight, model.model.layers[1].mlp.up_proj.weight)
    assert client.lm_head.weight is client.model.embed_tokens.weight
    assert (tmp_path / "files" / "tokenizer.json").read_text() == '{"fake": true}'


def test_withheld_without_bias():
    cfg = ours_from_hf(hf_tiny("llama-gqa")).config
    assert not any(n.endswith("bias") for n in withheld_names(cfg, (0, 1)))
    assert len(withheld_names(cfg, (0, 1))) == 10


def test_garbage_bundle(tmp_path):
    (tmp_path / "b").write_bytes(b"\x01" * 100)
    with pytest.raises(BundleError):
        read_bundle(tmp_path / "b", tmp_path / "f")
