"""A second evaluator (symbolic: plaintext values, levels/sizes/scales checked as SEAL does) runs the whole
encrypted block through the protocol: proof that the block names no library (issue 14)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engine.config import ModelConfig
from engine.model import LlamaForCausalLM
from fhe.attention import BlockClient, EncryptedAttentionLayer, required_rotation_steps
from fhe.backends import evaluator_for
from fhe.backends.symbolic import SymbolicClient, SymbolicEvaluator, seal_primes
from fhe.errors import BackendMismatchError, KeyMismatchError, LevelError
from fhe.params import CKKSParams, ckks_params_for
from fhe.simulator import finish, simulate_block
from tests.fhe.test_attention import calibrated_plan, layer_input

P = CKKSParams(8192, (60, 40, 40, 60), 40)


def wide_model() -> LlamaForCausalLM:
    """head_dim 64 as in SmolLM2, so a cache block holds few tokens (21 at N = 16384, 42 at 32768) and a
    short sequence spans several blocks; GQA and biases on."""
    cfg = ModelConfig(vocab_size=61, hidden_size=192, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=64, attention_bias=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


def test_symbolic_primes_are_seals():
    from fhe.backends.seal.hazmat import Kit

    for params in (P, ckks_params_for("sqexp", 6), ckks_params_for("2quad")):
        assert seal_primes(params)[:-1] == Kit(params).primes


def symbolic_setup(kind: str, tokens: int, model=None, *, fold_v: bool = False):
    """(model, layer-1 input of ``tokens`` random ids, calibrated plan, block on the symbolic evaluator, its
    BlockClient, the server keys): the whole block with exact values, every level/scale/size checked.
    ``fold_v``: polyexp at one level less (p * V inside P, ``ckks_params_for(..., fold_v=True)``)."""
    model = model or wide_model()
    ids = torch.randint(0, 61, (tokens,), generator=torch.Generator().manual_seed(1))
    x = layer_input(model, 1, ids)
    plan = calibrated_plan(model, 1, x, kind)
    cfg, sq = model.config, plan.approx.squarings
    params = ckks_params_for(kind, sq, fold_v=fold_v)
    ev = evaluator_for(params, "symbolic")
    client = SymbolicClient(params, required_rotation_steps(cfg, params, kind, sq))
    block = EncryptedAttentionLayer(model.layers[1], model.rotary, plan, cfg, params, max_tokens=64, evaluator=ev)
    return model, x, plan, block, BlockClient.for_model(client, cfg, kind, sq), client.server_keys()


@pytest.mark.parametrize("kind,tokens,fold_v", [("2quad", 45, False), ("sqexp", 50, False), ("polyexp", 45, True)])
def test_the_whole_block_runs_on_the_symbolic_evaluator(kind, tokens, fold_v):
    """Projections, RoPE, the cache over several blocks, scores, squarings, V and the output map: every
    operation through the protocol, every level/scale/size checked, equal to the simulator. polyexp with
    ``fold_v``: the depth-9 block at N = 16384 (p * V inside P)."""
    model, x, plan, block, bc, keys = symbolic_setup(kind, tokens, fold_v=fold_v)
    assert block.geo.fold_v == fold_v and block.geo.params.depth == 4 + plan.approx.score_depth + (not fold_v)
    ev = block.ev
    cache = block.new_cache()
    outs = block.prefill(cache, bc.encrypt_input(x), 0, keys)
    assert len(cache.k_blocks) > 1                                  # the sequence spans several blocks
    assert {ev.level(c) for c in outs} == {1} and {ev.size(c) for c in outs} == {2}   # the whole budget
    ys, zs, _ = simulate_block(model.layers[1], model.rotary, x, torch.arange(len(x)), None, plan)
    err = (finish(*bc.decrypt_output(outs)) - finish(ys, zs)).abs().max().item()
    assert err < 1e-6, err                       # exact values: only float rounding and relabels
    assert ev.counts["rotate"] > 0 and ev.counts["relinearize"] > 0
    assert cache.nbytes() > 0


def test_the_symbolic_evaluator_refuses_what_seal_refuses():
    ev = SymbolicEvaluator(P)
    client = SymbolicClient(P, (1,))
    keys = client.server_keys()
    a = client.encrypt(np.ones(4))
    b = ev.mul_plain(a, ev.encode(np.ones(4), ev.top, ev.prime(ev.top)))
    with pytest.raises(LevelError):
        ev.add(a, b)                                  # scales differ
    with pytest.raises(LevelError):
        ev.add(a, ev.rescale(b))                      # levels differ
    with pytest.raises(LevelError):
        ev.rotate(ev.mul(a, a), 1, keys)              # size 3: relinearize first
    with pytest.raises(KeyMismatchError):
        ev.rotate(a, 2, keys)                         # no Galois key for 2
    with pytest.raises(LevelError):
        ev.rescale(ev.rescale(ev.rescale(b)))         # past the last prime
    with pytest.raises(LevelError):
        ev.mul_plain(a, ev.encode(np.full(4, 2.0 ** 60), ev.top, ev.scale))   # the message overflows Q
    assert np.allclose(client.decrypt(ev.rotate(client.encrypt(np.arange(4.0)), 1, keys))[:3], [1, 2, 3])
    assert ev.deserialize(ev.serialize(a)).values.tolist() == a.values.tolist()


def test_keys_of_another_backend_are_a_typed_error():
    model = wide_model()
    x = layer_input(model, 1, torch.tensor([1, 2, 3]))
    plan = calibrated_plan(model, 1, x, "2quad")
    params = ckks_params_for("2quad")
    block = EncryptedAttentionLayer(model.layers[1], model.rotary, plan, model.config, params,
                                    evaluator=evaluator_for(params, "symbolic"))
    client = SymbolicClient(params, block.rotation_steps)
    bc = BlockClient.for_model(client, model.config, "2quad", plan.approx.squarings)
    other = dataclasses.replace(client.server_keys(), backend="seal")
    with pytest.raises(BackendMismatchError):
        block.forward(block.new_cache(), bc.encrypt_input(x[:1])[0], 0, other)
    with pytest.raises(BackendMismatchError):
        evaluator_for(params, "no-such-backend")
