"""oneDNN-packed linears (engine.cpu_linear): same function, same parameters, as the plain model."""

from __future__ import annotations

import pytest
import torch

from engine.cpu_linear import PackedLinear, onednn_available, pack_linears
from engine.model import DenseKVCache
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
