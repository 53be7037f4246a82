"""Lossless Q4_1 / Q8_0 storage of tensors that came from a quantized checkpoint, and the bundle that uses it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fhe import quant
from fhe.bundle import BundleError, read_bundle, write_offload_bundle
from fhe.offload import offload_plan
from tests.engine.hf_tiny import hf_tiny, ours_from_hf


def _as_q4_1(t: torch.Tensor) -> torch.Tensor:
    """What a Q4_1 checkpoint dequantizes to: d*q + m per block of 32, d and m fp16 (GGUF's layout)."""
    b = t.reshape(-1, 32)
    mn, mx = b.min(1).values, b.max(1).values
    d, m = ((mx - mn) / 15).half().float()[:, None], mn.half().float()[:, None]
    q = ((b - m) / d).round().clamp(0, 15)
    return (d * q + m).reshape(t.shape)


def _as_q8_0(t: torch.Tensor) -> torch.Tensor:
    b = t.reshape(-1, 32)
    d = (b.abs().max(1).values / 127).half().float()[:, None]
    return (d * (b / d).round().clamp(-127, 127)).reshape(t.shape)


@pytest.mark.parametrize("kind,make", [("q4_1", _as_q4_1), ("q8_0", _as_q8_0)])
def test_pack_recovers_the_blocks_exactly(kind, make):
    t = make(torch.randn(64, 96, generator=torch.Generator().manual_seed(0)))
    got_kind, parts = quant.pack(t)
    assert got_kind == kind
    assert torch.equal(quant.unpack(kind, parts, tuple(t.shape)), t)
    bytes_ = sum(p.numel() * p.element_size() for p in parts.values())
    assert bytes_ <= t.numel() * (5 if kind == "q4_1" else 8.5) / 8


def test_tensors_that_were_not_quantized_stay_as_they_are():
    assert quant.pack(torch.randn(64, 96)) is None           # 32 distinct values per block: no codes fit
    assert quant.pack(torch.randn(7)) is None                # not a whole number of blocks
    with pytest.raises(ValueError):
        quant.unpack("q4_1", {"q": torch.zeros(2, 16, dtype=torch.uint8)}, (64,))
    with pytest.raises(ValueError):
        quant.unpack("q5_k", {}, (32,))


@pytest.fixture()
def quantized_model():
    model = ours_from_hf(hf_tiny("qwen2-bias-tied"))
    with torch.no_grad():                                    # as if loaded from a Q4_1 GGUF
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):
                p.copy_(_as_q4_1(p))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(_as_q8_0(p))
    return model


def test_quantized_bundle_is_lossless_and_smaller(tmp_path, quantized_model):
    (tmp_path / "tok").mkdir()
    plan = offload_plan(quantized_model.config, "tiny", 1, softmax="client")
    plain = write_offload_bundle(quantized_model, tmp_path / "tok", plan, tmp_path / "a.safetensors")
    info = write_offload_bundle(quantized_model, tmp_path / "tok", plan, tmp_path / "q.safetensors", quantize=True)
    assert info["tensors"] == plain["tensors"] and "model.embed_tokens.weight" in info["quantized"]
    assert "model.layers.0.mlp.up_proj.weight" in info["quantized"]
    assert "model.layers.0.input_layernorm.weight" not in info["quantized"]     # not quantized at the source
    assert (tmp_path / "q.safetensors").stat().st_size < 0.5 * (tmp_path / "a.safetensors").stat().st_size
    client, meta = read_bundle(tmp_path / "q.safetensors", tmp_path / "files")
    assert meta["version"] == "2"
    want = quantized_model.state_dict()
    for name, t in client.state_dict().items():
        if not t.is_meta:
            assert torch.equal(t, want[name]), name


def test_quantized_bundle_with_a_bad_index_is_refused(tmp_path, quantized_model):
    (tmp_path / "tok").mkdir()
    plan = offload_plan(quantized_model.config, "tiny", 1, softmax="client")
    write_offload_bundle(quantized_model, tmp_path / "tok", plan, tmp_path / "q.safetensors", quantize=True)
    with safe_open(str(tmp_path / "q.safetensors"), framework="pt") as fh:
        meta, state = fh.metadata(), {k: fh.get_tensor(k) for k in fh.keys()}
    for bad in ("not json", json.dumps({"model.embed_tokens.weight": ["q4_1", [97, 64]]}), json.dumps({"x": 3})):
        save_file(state, str(tmp_path / "bad.safetensors"), metadata={**meta, "quantized": bad})
        with pytest.raises(BundleError):
            read_bundle(tmp_path / "bad.safetensors", tmp_path / "files")
