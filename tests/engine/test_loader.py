"""Loading model folders and GGUF files, and the errors bad files produce."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.loader import load_hf_folder, load_model, save_hf_folder
from tests.engine.hf_tiny import hf_tiny, ours_from_hf


@pytest.fixture()
def tiny_folder(tmp_path):
    model = ours_from_hf(hf_tiny("qwen2-bias-tied"))
    save_hf_folder(model, tmp_path / "m")
    return tmp_path / "m", model


def test_round_trip(tiny_folder):
    folder, model = tiny_folder
    loaded = load_hf_folder(folder)
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # still tied


def test_sharded_with_index(tiny_folder, tmp_path):
    folder, model = tiny_folder
    state = load_file(str(folder / "model.safetensors"))
    names = sorted(state)
    shard = tmp_path / "sharded"
    shard.mkdir()
    shutil.copy(folder / "config.json", shard)
    halves = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for fname, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(shard / fname))
    index = {"weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (shard / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_hf_folder(shard)
    assert torch.equal(loaded.model.norm.weight, model.model.norm.weight)


def test_missing_config(tiny_folder):
    folder, _ = tiny_folder
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_hf_folder(folder)


def test_truncated_safetensors_names_the_file(tiny_folder):
    folder, _ = tiny_folder
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_hf_folder(folder)


def test_garbage_safetensors(tiny_folder):
    folder, _ = tiny_folder
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_hf_folder(folder)


def test_shape_mismatch_names_the_tensor(tiny_folder):
    folder, _ = tiny_folder
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"mlp\.\w+_proj\.weight has shape"):
        load_hf_folder(folder)


def test_unknown_architecture(tiny_folder):
    folder, _ = tiny_folder
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "gpt_neox", ["GPTNeoXForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="gpt_neox"):
        load_hf_folder(folder)


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="no such GGUF"):
        load_model(tmp_path / "nope.gguf")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 100)
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        load_model(bad)


def test_truncated_gguf(tmp_path):
    from gguf import GGUFWriter

    src = tmp_path / "t.gguf"
    w = GGUFWriter(str(src), "llama")  # a real GGUF header followed by a cut-off tensor section
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.randn(8, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = src.read_bytes()
    src.write_bytes(data[: len(data) - 40])
    with pytest.raises(ModelLoadError, match="t.gguf"):
        load_model(src)
