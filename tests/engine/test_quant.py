"""Quantized CPU linears (engine.quant): packing, GGUF block decoders, kernels, loading, the engine seam.

Tiny random models only; the real default model is in test_quant_smollm2.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from engine import quant as Q
from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.loader import build_model, load_model, save_hf_folder, save_quantized_folder
from engine.model import DenseKVCache, LlamaForCausalLM, greedy_generate

pytestmark = pytest.mark.skipif(not Q.int4_kernel_available(), reason="torch lacks the int4 CPU kernel")

# rows of every projection a multiple of 64 (the int4 CPU layout's row block)
TINY = dict(model_type="llama", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
            rope_theta=10000.0, tie_word_embeddings=True, attention_bias=True)


def tiny(seed: int = 0):
    cfg = ModelConfig.from_hf_dict(TINY)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(s, generator=g) * (0.1 if "norm" not in k else 1.0) for k, s in shapes.items()}
    return build_model(cfg, state, "tiny")


def gguf_blocks(w: np.ndarray, kind: str) -> tuple[torch.Tensor, np.ndarray]:
    t = getattr(GGMLQuantizationType, kind)
    raw = quants.quantize(w, t)
    return torch.from_numpy(raw), quants.dequantize(raw, t)


def test_unpack_reads_the_kernel_layout_back():
    u = torch.randint(0, 16, (192, 96), generator=torch.Generator().manual_seed(1))
    packed = Q.pack_int4(u)
    assert torch.equal(Q.unpack_int4(packed).long(), u)
    rows = torch.tensor([0, 31, 32, 63, 64, 100, 191])
    assert torch.equal(Q.unpack_int4(packed, rows).long(), u[rows])


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_gguf_blocks_decode_to_the_gguf_packages_values(kind):
    w = np.random.default_rng(0).standard_normal((128, 256)).astype(np.float32)
    raw, ref = gguf_blocks(w, kind)
    lin = Q.GGUF_DECODERS[kind](raw)
    assert np.array_equal(lin.dequantize().numpy(), ref)
    x = torch.randn(3, 256)
    y_ref = x @ torch.from_numpy(ref).t()
    assert (lin(x) - y_ref).abs().max() <= 1e-2 * y_ref.abs().max()   # kernel: bf16 activations


def test_q4_k_blocks_decode_to_the_gguf_packages_values():
    rng = np.random.default_rng(0)
    blk = rng.integers(0, 256, (64, 2, 144), dtype=np.uint8)
    blk[..., 0:4] = np.array([0.01, 0.003], np.float16).view(np.uint8)  # sane d, dmin in every super-block
    raw = blk.reshape(64, -1)
    ref = quants.dequantize(raw, GGMLQuantizationType.Q4_K)
    assert np.array_equal(Q.decode_q4_k(torch.from_numpy(raw)).dequantize().numpy(), ref)


@pytest.mark.parametrize("fmt", ["int4", "int8", "int8-channel"])
def test_kernel_rows_track_and_many_rows_equal_the_dequantized_linear(fmt):
    w = torch.randn(192, 128) * 0.1
    bias = torch.randn(192)
    lin = Q.quantize_linear(torch.nn.Linear(128, 192), fmt)  # the dispatch, then the layer under test
    lin = {"int4": lambda: Q.quantize_int4(w, 32, bias), "int8": lambda: Q.quantize_int8_grouped(w, 32, bias),
           "int8-channel": lambda: Q.quantize_int8(w, bias)}[fmt]()
    dense = lin.dequantize()
    g = w.reshape(192, 4, 32)
    if fmt == "int4":  # round to nearest: off by at most half a step of its group
        step = ((g.amax(-1) - g.amin(-1)) / 15).repeat_interleave(32, 1)
    elif fmt == "int8":
        step = (g.abs().amax(-1) / 127).repeat_interleave(32, 1)
    else:
        step = (w.abs().amax(1) / 127)[:, None].expand_as(w)
    assert ((dense - w).abs() <= step / 2 * (1 + 1e-3)).all()  # scales on the fp16 grid: 2^-11 off
    for rows in (1, Q.KERNEL_MAX_ROWS):
        x = torch.randn(rows, 128)
        ref = torch.nn.functional.linear(x, dense, bias)
        assert (lin(x) - ref).abs().max() <= 1e-2 * ref.abs().max()
    x = torch.randn(Q.KERNEL_MAX_ROWS + 1, 128)
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, dense, bias), rtol=1e-6, atol=1e-6)


def test_q8_0_planes_are_exact_and_compact():
    w = np.random.default_rng(2).standard_normal((64, 128)).astype(np.float32)
    lin = Q.decode_q8_0(gguf_blocks(w, "Q8_0")[0])
    assert all(p.scale.dtype == torch.float16 for p in lin.planes)       # 16 d, -128 d stay fp16
    assert lin.resident_bytes() <= 1.5 * w.size                         # ~1.5 bytes a weight, not 4


def test_rtn_int4_recovers_a_q4_1_grid():
    # a Q4_1 block always holds its min (u=0) and max (u=15), so RTN of dequantized Q4_1 is Q4_1 again
    w = np.random.default_rng(3).standard_normal((64, 256)).astype(np.float32)
    ref = torch.from_numpy(gguf_blocks(w, "Q4_1")[1])
    torch.testing.assert_close(Q.quantize_int4(ref, 32).dequantize(), ref, rtol=0, atol=1e-6)


def test_quantized_model_prefill_is_the_dequantized_model_exactly():
    model = tiny()
    assert Q.quantize_model(model, "int4") == 15  # 7 per layer + the head
    assert isinstance(model.model.embed_tokens, Q.QuantEmbedding)
    assert model.lm_head.kind == "int8" and model.model.layers[0].mlp.up_proj.kind == "int4"  # head at 8 bits
    ref = tiny()
    for name, mod in model.named_modules(remove_duplicate=False):
        if isinstance(mod, Q.QuantLinear) and not name.startswith("model.embed"):
            ref.get_submodule(name).weight.data = mod.dequantize()
    ref.model.embed_tokens.weight = ref.lm_head.weight
    n = Q.KERNEL_MAX_ROWS + 1  # a prefill chunk past the kernels' rows: the dequantized fp32 GEMM
    ids = torch.randint(0, 256, (n,))
    pos = torch.arange(n)
    with torch.inference_mode():
        got = model.logits(model(ids, pos, DenseKVCache(model.config, n)))
        want = ref.logits(ref(ids, pos, DenseKVCache(ref.config, n)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_weight_bytes_counts_quantized_layers_once():
    model = tiny()
    fp32 = Q.weight_bytes(model)["total"]
    Q.quantize_model(model, "int4")
    b = Q.weight_bytes(model)
    assert b["quantized"] > 0 and b["total"] < fp32 / 4


@pytest.mark.parametrize("fmt", ["int4", "int8", "int8-channel"])
def test_quantized_folder_round_trips(tmp_path, fmt):
    model = tiny()
    Q.quantize_model(model, fmt)
    save_quantized_folder(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["quant_method"] == "cipherlm"
    native = load_model(tmp_path, weight_format="native")
    fp32 = load_model(tmp_path)  # dequantized
    for name, mod in model.named_modules(remove_duplicate=False):
        if isinstance(mod, Q.QuantLinear) and not name.startswith("model.embed"):
            assert torch.equal(native.get_submodule(name).dequantize(), mod.dequantize())
            assert torch.equal(fp32.get_submodule(name).weight, mod.dequantize())
    assert fp32.model.embed_tokens.weight is fp32.lm_head.weight


def test_engine_runs_an_int4_model_like_the_reference_decode(tmp_path):
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    save_hf_folder(tiny(), tmp_path)
    engine = LLMEngine(load_model(tmp_path, weight_format="int4"), None,
                       EngineConfig(device="cpu", kv_cache_bytes=8 << 20))
    prompt = list(range(3, 23))
    engine.add_request("q", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    out = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = list(o.outputs[0].token_ids)
    ref = load_model(tmp_path, weight_format="int4")
    assert out == greedy_generate(ref, prompt, 12)
    assert any(isinstance(m, Q.Int4Linear) for m in engine.runner.model.modules())


def test_bad_formats_are_typed_errors(tmp_path):
    with pytest.raises(ValueError, match="weight_format"):
        EngineConfig(device="cpu", weight_format="int3")
    with pytest.raises(ValueError, match="weight_group_size"):
        EngineConfig(device="cpu", weight_format="int4", weight_group_size=48)
    with pytest.raises(Q.QuantError):
        Q.quantize_int4(torch.randn(64, 96), 64)
    with pytest.raises(Q.QuantError):
        Q.pack_int4(torch.zeros(48, 64, dtype=torch.int32))
    save_hf_folder(tiny(), tmp_path)
    with pytest.raises(ModelLoadError, match="weight_format"):
        load_model(tmp_path, weight_format="q2")
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"quantization_config": {"quant_method": "bitsandbytes"}}))
    with pytest.raises(UnsupportedModelError, match="bitsandbytes"):
        load_model(tmp_path)
