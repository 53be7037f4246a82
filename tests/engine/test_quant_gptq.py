"""GPTQ / AWQ layouts (engine.gptq_awq) and the quantizers that write them (engine.gptq), on tiny weights.

The packing is checked against a decode written here from the documented bit layout, field by field, so a
writer and reader that agree with each other but not with the format fail.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine import gptq as G
from engine import gptq_awq as L
from engine import quant as Q
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.loader import load_model
from tests.engine.test_quant import tiny

pytestmark = pytest.mark.skipif(not Q.int4_kernel_available(), reason="torch lacks the int4 CPU kernel")


def int_weights(n: int, k: int, g: int, bits: int, seed: int = 0) -> L.IntWeights:
    gen = torch.Generator().manual_seed(seed)
    top = 1 << bits
    return L.IntWeights(torch.randint(0, top, (n, k), generator=gen, dtype=torch.int32),
                        (torch.rand(n, k // g, generator=gen) / 10 + 1e-3).to(torch.float16),
                        torch.randint(1, top, (n, k // g), generator=gen, dtype=torch.int32), g, bits)


def field(word: int, j: int, bits: int) -> int:
    """Field j of a 32-bit word (a signed int32 read as its two's-complement bits)."""
    return ((word & 0xFFFFFFFF) >> (bits * j)) & ((1 << bits) - 1)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_packing_is_the_documented_layout(bits):
    iw = int_weights(64, 64, 32, bits)
    t = L.gptq_tensors("x", iw, v1=True)
    per = 32 // bits
    assert t["x.qweight"].dtype == t["x.qzeros"].dtype == torch.int32 and t["x.scales"].dtype == torch.float16
    assert t["x.qweight"].shape == (64 // per, 64) and t["x.qzeros"].shape == (2, 64 // per)
    qw, qz = t["x.qweight"].tolist(), t["x.qzeros"].tolist()
    for n in range(64):
        for k in range(64):  # word [k / per, n], field k % per
            assert field(qw[k // per][n], k % per, bits) == iw.q[n, k]
        for grp in range(2):  # v1: zero - 1, word [grp, n / per], field n % per
            assert field(qz[grp][n // per], n % per, bits) == iw.zero[n, grp] - 1
    assert torch.equal(t["x.scales"], iw.scale.T) and t["x.g_idx"].tolist() == [k // 32 for k in range(64)]


def test_awq_packing_is_the_documented_layout():
    iw = int_weights(64, 64, 32, 4)
    t = L.awq_tensors("x", iw)
    assert t["x.qweight"].shape == (64, 8) and t["x.qzeros"].shape == (2, 8)
    order = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's pack order: field j of word c is output column 8c + order[j]
    qw, qz = t["x.qweight"].tolist(), t["x.qzeros"].tolist()
    for k in range(64):
        for c in range(8):
            for j in range(8):
                assert field(qw[k][c], j, 4) == iw.q[8 * c + order[j], k]
    for grp in range(2):
        for c in range(8):
            assert [field(qz[grp][c], j, 4) for j in range(8)] == [int(iw.zero[8 * c + o, grp]) for o in order]


@pytest.mark.parametrize("bits", [4, 8])
def test_int_weights_load_as_int4_planes_exactly(bits):
    iw = int_weights(128, 256, 64, bits)
    layer = iw.to_linear()
    assert len(layer.planes) == (1 if bits == 4 else 2)
    assert torch.equal(layer.dequantize(), iw.dequantize())


@pytest.mark.parametrize("layout,method,bits,sym,act_order", [
    ("gptq", "rtn", 4, True, False), ("gptq", "gptq", 4, True, False), ("gptq", "gptq", 4, False, True),
    ("gptq", "rtn", 8, True, False), ("awq", "rtn", 4, False, False)])
def test_folder_round_trips_to_the_quantized_weights(tmp_path, layout, method, bits, sym, act_order):
    model = tiny()
    spec = G.QuantSpec(layout=layout, method=method, bits=bits, group_size=64, sym=sym, act_order=act_order)
    calib = [list(range(3, 35)), list(range(40, 72))]
    layers = G.quantize_layers(model, spec, calib if method == "gptq" else None)
    G.save_layout_folder(model, layers, spec, tmp_path)
    qcfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == layout and qcfg["bits"] == bits and qcfg["group_size"] == 64
    native, fp32 = load_model(tmp_path, weight_format="native"), load_model(tmp_path)
    assert len(layers) == 14
    for name, iw in layers.items():
        assert isinstance(native.get_submodule(name), Q.Int4Linear)
        assert torch.equal(native.get_submodule(name).dequantize(), iw.dequantize())
        assert torch.equal(fp32.get_submodule(name).weight, iw.dequantize())
        bias, ref_bias = native.get_submodule(name).bias, model.get_submodule(name).bias
        assert (bias is None and ref_bias is None) or torch.equal(bias, ref_bias)
    ids = torch.arange(3, 20)  # the swapped-in model and the loaded one are the same model
    from engine.model import DenseKVCache
    with torch.inference_mode():
        a = native.logits(native(ids, torch.arange(17), DenseKVCache(native.config, 17)))
        b = model.logits(model(ids, torch.arange(17), DenseKVCache(model.config, 17)))
    assert torch.equal(a, b)


def test_gptq_beats_rtn_on_the_layer_output():
    gen = torch.Generator().manual_seed(1)
    # correlated inputs (as activations are: few directions carry most of the energy), uneven scales
    x = torch.randn(2048, 32, generator=gen) @ torch.randn(32, 256, generator=gen)
    x = (x + 0.1 * torch.randn(2048, 256, generator=gen)) * torch.linspace(0.2, 2.0, 256)
    w = torch.randn(128, 256, generator=gen) * 0.05
    h = 2 * x.double().T @ x.double() / x.shape[0]
    ref = x @ w.T
    err = {}
    for name, spec in {"rtn": G.QuantSpec(group_size=64), "gptq": G.QuantSpec(method="gptq", group_size=64),
                       "gptq-act": G.QuantSpec(method="gptq", group_size=64, act_order=True)}.items():
        iw = G.rtn(w, spec) if name == "rtn" else G.gptq_quantize(w, h, spec)
        err[name] = float(((x @ iw.dequantize().T - ref) ** 2).mean())
    assert err["gptq"] < 0.5 * err["rtn"] and err["gptq-act"] < 0.5 * err["rtn"], err


def test_rtn_grids_follow_the_reference_tools():
    w = torch.tensor([[-1.0, 0.5, 0.25, 0.75]])
    sym = G.rtn(w, G.QuantSpec(group_size=4, sym=True))
    assert sym.zero.item() == 8 and sym.scale.item() == pytest.approx(2 / 15, rel=1e-3)
    awq = G.rtn(w, G.QuantSpec(layout="awq", group_size=4, sym=False))
    assert awq.zero.item() == round(1.0 / (1.75 / 15)) and awq.q.max() == 15 and awq.q.min() == 0


def _write(tmp_path, qcfg_update: dict, layout: str = "gptq"):
    model = tiny()
    spec = G.QuantSpec(layout=layout, group_size=64, sym=layout == "gptq")
    G.save_layout_folder(model, G.quantize_layers(model, spec), spec, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"].update(qcfg_update)
    (tmp_path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("update,field_name", [
    ({"bits": 3}, "bits"), ({"checkpoint_format": "marlin"}, "checkpoint_format"),
    ({"group_size": -1}, "group_size"), ({"dynamic": {"-:.*mlp.*": {}}}, "dynamic")])
def test_unsupported_gptq_variants_name_the_field(tmp_path, update, field_name):
    _write(tmp_path, update)
    with pytest.raises(UnsupportedModelError, match=f"quantization_config.{field_name}"):
        load_model(tmp_path, weight_format="native")


def test_unsupported_awq_variants_name_the_field(tmp_path):
    _write(tmp_path, {"version": "gemv"}, layout="awq")
    with pytest.raises(UnsupportedModelError, match="quantization_config.version"):
        load_model(tmp_path, weight_format="native")


def test_act_order_g_idx_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    _write(tmp_path, {"desc_act": True})
    state = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.g_idx"
    state[name] = state[name].flip(0).contiguous()
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="desc_act"):
        load_model(tmp_path, weight_format="native")


def test_a_broken_layer_is_a_load_error(tmp_path):
    from safetensors.torch import load_file, save_file

    _write(tmp_path, {})
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.self_attn.q_proj.qzeros"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="q_proj"):
        load_model(tmp_path, weight_format="native")
