"""The default model's Q4_1 GGUF run natively (engine.quant) against the dequantized fp32 copy."""

from __future__ import annotations

import pytest
import torch

from engine import Tokenizer, greedy_generate, load_model
from engine.default_model import pull_native
from engine.engine_config import EngineConfig
from engine.model import DenseKVCache
from engine.quant import Int4Linear, QuantEmbedding, QuantLinear

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def pair(default_model_dir):
    native = pull_native()
    return load_model(default_model_dir), load_model(native, weight_format="native"), native


def _logits(model, ids):
    with torch.inference_mode():
        return model.logits(model(torch.tensor(ids), torch.arange(len(ids)), DenseKVCache(model.config, len(ids))))


def test_q4_1_blocks_are_the_fp32_weights_and_give_its_logits(pair):
    fp32, q, folder = pair
    kinds = {m.kind for m in q.modules() if isinstance(m, Int4Linear)}
    assert kinds == {"q4_1", "q8_0"} and isinstance(q.model.embed_tokens, QuantEmbedding)
    for name, mod in q.named_modules(remove_duplicate=False):
        if isinstance(mod, QuantLinear) and not name.startswith("model.embed"):
            assert torch.equal(mod.dequantize(), fp32.get_submodule(name).weight), name
    tok = Tokenizer.from_folder(folder)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    exact = {m: m.kernel_max_rows for m in q.modules() if isinstance(m, QuantLinear)}
    for m in exact:
        m.kernel_max_rows = 0  # every row through the dequantized fp32 GEMM: the same numbers as fp32
    try:
        torch.testing.assert_close(_logits(q, ids), _logits(fp32, ids), rtol=1e-4, atol=1e-4)
    finally:
        for m, rows in exact.items():
            m.kernel_max_rows = rows


def test_engine_decodes_q4_1_natively_as_the_reference_does(pair):
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    fp32, q, folder = pair
    engine = LLMEngine.from_pretrained(folder, EngineConfig(device="cpu", weight_format="native",
                                                            kv_cache_bytes=16 << 20))
    assert any(isinstance(m, Int4Linear) for m in engine.runner.model.modules())
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Name a primary colour."}])
    engine.add_request("q", ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    out: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = list(o.outputs[0].token_ids)
    # The reference decode teacher-forced on the engine's tokens: each is the reference's argmax, or within
    # a near tie of it. The native kernels quantize activations to int8 per block of 32, so the paged
    # attention's float rounding (vs the dense cache here) moves logits by up to a few tenths: measured on an
    # AVX2 box, one step of 8 flipped on a 0.037 margin; on an AVX-512 box (CI's), step 6 flipped on a 0.266
    # margin, where the fp32 model's own margin is 0.058. A scrambled weight layout or a wrong block scale is
    # off by whole logits on most steps; so: every step within 0.5, and most steps exact.
    cache = DenseKVCache(q.config, len(ids) + len(out))
    x, pos = torch.tensor(ids), torch.arange(len(ids))
    gaps = []
    with torch.inference_mode():
        for t in out:
            lg = q.logits(q(x, pos, cache)[-1:])[0]
            cache.advance()
            gaps.append(float(lg.max() - lg[t]))
            x, pos = torch.tensor([t]), torch.tensor([cache.length])
    assert max(gaps) <= 0.5 and sum(g == 0.0 for g in gaps) >= 6, gaps
    assert out[:4] == greedy_generate(fp32, ids, 4)  # kernel rows still pick fp32's first tokens


def test_cli_quantize_writes_a_folder_the_engine_runs(tmp_path, default_model_dir):
    import shutil

    from engine.loader import save_hf_folder
    from server.cli import main
    from tests.engine.test_quant import tiny

    src = tmp_path / "tiny"
    save_hf_folder(tiny(), src)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, src / name)
    assert main(["model", "quantize", str(src), str(tmp_path / "q"), "--format", "int8"]) == 0
    model = load_model(tmp_path / "q", weight_format="native")
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 15
    assert Tokenizer.from_folder(tmp_path / "q").encode("hello")
    assert main(["model", "quantize", str(tmp_path / "missing"), str(tmp_path / "x")]) == 2
