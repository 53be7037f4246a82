"""Fused linear steps (fhe.offload_fused): the algebra in the clear, then the worker's steps on real SEAL
ciphertexts and on the gpu backend's torch-CPU reference ('cpu-reference', bit for bit SEAL's), one position
and the chunk layout, against the plaintext fused maps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from fhe.backends.seal import hazmat as seal
from fhe.backends.seal.keys import CKKSClient
from fhe.errors import ShapeError
from fhe.mlp import MLP_PARAMS, MLPWeights
from fhe.offload import OffloadPlan, OffloadPlanError, offload_plan, with_fused
from fhe.offload_attention import AttentionLinearWeights
from fhe.offload_fused import (
    FUSED_PARTS,
    fused_geometry,
    fused_shape,
    fused_step_order,
    fused_weights,
    split_matvecs,
)
from fhe.offload_steps import chunk_shapes, offload_rotation_steps
from tests.fhe.test_attention import tiny_model

#: |decrypted - plaintext| of a fused product relative to the output's magnitude: CKKS error at 2^40 is
#: ~1e-7 of it on these layers; the bound keeps a wide margin and still catches any misplaced slot
MAX_REL = 1e-5


def _rms(x: np.ndarray, eps: float) -> np.ndarray:
    return 1.0 / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps)


def test_fused_maps_equal_the_four_steps_in_the_clear():
    """o_up then down_qkv, with the client's RMS scaling after each, give what attn_o, mlp_up, mlp_down and
    the next attn_qkv give on normalized inputs (float64, no CKKS)."""
    model = tiny_model(bias=False)
    cfg, eps = model.config, model.config.rms_norm_eps
    l0, l1 = model.model.layers[0], model.model.layers[1]
    rng = np.random.default_rng(0)
    u, x = rng.normal(size=cfg.num_attention_heads * cfg.head_dim), rng.normal(size=cfg.hidden_size) * 5
    att0, mlp0, att1 = AttentionLinearWeights.of(l0), MLPWeights.of(l0), AttentionLinearWeights.of(l1)
    # the four steps: the client normalizes before each product
    o = att0.o @ u
    x1 = x + o
    gu = np.concatenate([mlp0.gate, mlp0.up]) @ (x1 * _rms(x1, eps))
    a = (F.silu(torch.from_numpy(gu[:cfg.intermediate_size])) * torch.from_numpy(gu[cfg.intermediate_size:])).numpy()
    d = mlp0.down @ a
    x2 = x1 + d
    qkv = att1.qkv @ (x2 * _rms(x2, eps))
    # fused: the server multiplies the unnormalized residual, the client scales after
    ya = fused_weights(l0, "o_up") @ np.concatenate([u, x])
    h = cfg.hidden_size
    assert np.allclose(ya[:h], o) and np.allclose(ya[h:] * _rms(x + ya[:h], eps), gu)
    yb = fused_weights(l0, "down_qkv", l1) @ np.concatenate([a, x1])
    assert np.allclose(yb[:h], d) and np.allclose(yb[h:] * _rms(x1 + yb[:h], eps), qkv)
    assert fused_weights(l0, "o_up").shape == fused_shape(cfg, "o_up")
    assert fused_weights(l0, "down_qkv", l1).shape == fused_shape(cfg, "down_qkv")


def test_the_default_plan_fused_is_57_steps_and_the_same_values_per_layer(default_model_dir):
    cfg = ModelConfig.from_file(default_model_dir / "config.json")
    plan = offload_plan(cfg, "smollm2", 2, softmax="client", fused=True)
    steps = plan.linear_steps()
    assert plan.round_trips == len(steps) == 57 == 1 + 28 + 27 + 1
    assert steps[0] == (2, "attn_qkv") and steps[-1] == (29, "mlp_down") and steps[1:3] == ((2, "o_up"),
                                                                                            (2, "down_qkv"))
    assert with_fused(plan, False).round_trips == 112
    # per layer and token the same values cross the wire (up: 576 + 576 + 576 + 1536; down: 960 + 576 + 3072 + 576)
    up = sum(fused_shape(cfg, p)[1] for p in FUSED_PARTS)
    down = sum(fused_shape(cfg, p)[0] for p in FUSED_PARTS)
    assert (up, down) == (3264, 5184)
    # the unfused plan's content and hash are what they were: "fused" is only written when on
    assert "fused" not in with_fused(plan, False).metadata()
    assert with_fused(plan, False).content_hash != plan.content_hash


def test_fused_plans_refuse_what_cannot_fuse(tmp_path):
    model = tiny_model(bias=True)
    with pytest.raises(OffloadPlanError, match="biases"):
        offload_plan(model.config, "tiny", 0, softmax="client", fused=True)
    cfg = tiny_model(bias=False).config
    with pytest.raises(OffloadPlanError, match="client-aided"):
        offload_plan(cfg, "tiny", 0, softmax="approx", attention_plan_hash="0" * 64, fused=True)
    path = offload_plan(cfg, "tiny", 0, softmax="client", fused=True).save(tmp_path / "p.json")
    assert OffloadPlan.load(path).fused
    doc = path.read_text().replace('"fused": true', '"fused": 1')
    (tmp_path / "bad.json").write_text(doc)
    with pytest.raises(OffloadPlanError):
        OffloadPlan.load(tmp_path / "bad.json")


def test_outputs_that_do_not_fit_one_ciphertext_are_cut_in_equal_groups():
    mvs = split_matvecs(4096, np.zeros((3648, 1152)))      # SmolLM2's o_up at N = 8192
    assert [m.weight.shape[0] for m in mvs] == [1824, 1824] and len({m.period for m in mvs}) == 1
    assert len(split_matvecs(4096, np.zeros((1536, 2112)))) == 1    # down_qkv fits one
    with pytest.raises(ShapeError):
        split_matvecs(4096, np.zeros((4, 5000)))


def test_order_of_fused_steps():
    assert fused_step_order([3]) == ((3, "attn_qkv"), (3, "o_up"), (3, "mlp_down"))
    assert fused_step_order([2, 3, 7]) == ((2, "attn_qkv"), (2, "o_up"), (2, "down_qkv"), (3, "o_up"),
                                           (3, "mlp_down"), (7, "attn_qkv"), (7, "o_up"), (7, "mlp_down"))


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """A fused plan of both tiny layers on a SEAL worker and on the gpu backend's CPU reference, one key set."""
    from server.private.compute import _OffloadLinear

    model = tiny_model(bias=False)
    path = offload_plan(model.config, "tiny", 0, softmax="client", fused=True).save(
        tmp_path_factory.mktemp("plan") / "tiny-fused.offload.json")
    seal_side, ours = _OffloadLinear(model, str(path), "cpu"), _OffloadLinear(model, str(path), "cpu-reference")
    client = CKKSClient(MLP_PARAMS, seal_side.steps)
    for w in (seal_side, ours):
        w.load_key("fp", client.server_keys())
    return model, seal_side, ours, client


def test_worker_blocks_and_key_steps_follow_the_plan(workers):
    model, seal_side, _, _ = workers
    assert seal_side.parts() == [(0, "attn_qkv"), (0, "o_up"), (0, "down_qkv"), (1, "o_up"), (1, "mlp_down")]
    assert set(seal_side.fused) == {0, 1} and set(seal_side.attention) == {0} and set(seal_side.blocks) == {1}
    assert seal_side.steps == offload_rotation_steps(model.config, MLP_PARAMS, fused=True)
    layouts, _ = fused_geometry(model.config, MLP_PARAMS)    # the client's layouts, from shapes alone
    for block in seal_side.fused.values():
        for part, lay in block.layouts.items():
            assert lay.period == layouts[part].period and all(
                np.array_equal(a, b) for a, b in zip(lay.out_slots, layouts[part].out_slots, strict=True))
    shapes = chunk_shapes(model.config, MLP_PARAMS, fused=True)
    assert all(seal_side.fused[0].chunks.shapes[p] == shapes[p] for p in FUSED_PARTS)


@pytest.mark.parametrize("part", FUSED_PARTS)
def test_one_position_fused_steps_decrypt_to_the_fused_map_and_the_reference_is_seals_bytes(workers, part):
    model, seal_side, ours, client = workers
    layers = model.model.layers
    w = fused_weights(layers[0], part, layers[1])
    lay = seal_side.fused[0].layouts[part]
    rng = np.random.default_rng(1)
    xs = [rng.normal(size=lay.n_in) * 3 for _ in range(2)]
    cts = [client.encrypt(lay.pack(x)) for x in xs]
    theirs, got = (wk.run("fp", 0, part, cts) for wk in (seal_side, ours))   # two positions: a batch
    assert len(got) == 2 * lay.outputs and [seal.to_bytes(c) for c in got] == [seal.to_bytes(c) for c in theirs]
    for i, x in enumerate(xs):
        y = lay.unpack([client.decrypt(c) for c in theirs[i * lay.outputs:(i + 1) * lay.outputs]])
        ref = w @ x
        assert np.abs(y - ref).max() < MAX_REL * np.abs(ref).max()


@pytest.mark.parametrize("part", FUSED_PARTS)
def test_chunk_layout_fused_steps_decrypt_to_the_fused_map(workers, part):
    """A step of 3 positions (one short chunk) in the chunk layout, SEAL and the CPU reference alike."""
    model, seal_side, ours, client = workers
    w = fused_weights(model.model.layers[0], part, model.model.layers[1])
    sh = seal_side.fused[0].chunks.shapes[part]
    xs = np.random.default_rng(2).normal(size=(3, sh.n_in)) * 3
    cts = [client.encrypt(v) for v in sh.pack(xs)]
    theirs = seal_side.run_chunks("fp", 0, part, cts)
    got = ours.run_chunks("fp", 0, part, cts)
    assert [seal.to_bytes(c) for c in got] == [seal.to_bytes(c) for c in theirs]
    y = sh.unpack([client.decrypt(c) for c in theirs], 3)
    ref = xs @ w.T
    assert np.abs(y - ref).max() < MAX_REL * np.abs(ref).max()


def test_a_fused_block_refuses_a_part_it_does_not_hold(workers):
    _, seal_side, _, client = workers
    block = seal_side.fused[1]    # the last layer: o_up only (its MLP ends with a plain mlp_down)
    assert set(block.layouts) == {"o_up"}
    with pytest.raises(ShapeError):
        block.step("down_qkv", client.encrypt(np.zeros(block.ev.slots)), client.server_keys())


@pytest.mark.gpu
def test_smollm2_shaped_fused_steps_on_cuda_decrypt_to_seals(tmp_path):
    """The GPU worker path by construction: a fused plan of two SmolLM2-shaped random layers on CUDA, its
    graphs captured at warm-up (one position and chunk rows per part), each part decrypting to SEAL's result
    within CKKS noise (the CUDA encoder may differ from SEAL's by one in a coefficient)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from engine.model import LlamaForCausalLM
    from server.private.compute import _OffloadLinear

    cfg = ModelConfig(vocab_size=97, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    path = offload_plan(cfg, "shaped", 0, softmax="client", fused=True).save(tmp_path / "f.offload.json")
    theirs, ours = _OffloadLinear(model, str(path), "cpu"), _OffloadLinear(model, str(path), "cuda")
    assert ours.warm() > 0
    client = CKKSClient(MLP_PARAMS, theirs.steps)
    for w in (theirs, ours):
        w.load_key("fp", client.server_keys())
    rng = np.random.default_rng(3)
    for part in FUSED_PARTS:
        lay = theirs.fused[0].layouts[part]
        cts = [client.encrypt(lay.pack(rng.normal(size=lay.n_in)))]
        want = [client.decrypt(c) for c in theirs.run("fp", 0, part, cts)]
        got = [client.decrypt(c) for c in ours.run("fp", 0, part, cts)]
        assert np.abs(lay.unpack(got) - lay.unpack(want)).max() < 1e-4, part
        sh = theirs.fused[0].chunks.shapes[part]
        chunk = [client.encrypt(v) for v in sh.pack(rng.normal(size=(8, sh.n_in)))]
        want = sh.unpack([client.decrypt(c) for c in theirs.run_chunks("fp", 0, part, chunk)], 8)
        got = sh.unpack([client.decrypt(c) for c in ours.run_chunks("fp", 0, part, chunk)], 8)
        assert np.abs(got - want).max() < 1e-4, part
