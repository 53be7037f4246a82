"""Whole steps through :class:`fhe.backends.gpu.whole_step.WholeSteps`: every output the eager step's, residue
for residue (CPU reference here: the shadow run, the batched encodes and the fed run without a graph; on CUDA,
marked ``gpu``, the captured graphs, shared across key sets, and the encrypted attention block's decode steps)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fhe.backends.gpu import GpuEvaluator
from fhe.backends.gpu.shadow import ShadowEvaluator
from fhe.backends.gpu.whole_step import CAPTURE_AFTER
from fhe.backends.seal import hazmat as seal
from fhe.backends.seal.keys import CKKSClient
from fhe.errors import ShapeError
from fhe.evaluator import add_plain_values, relin_rescale
from fhe.params import CKKSParams

P = CKKSParams(8192, (60, 40, 40, 60), 40)
STEPS = (1, 5, P.slots - 3)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _tiny_block(tokens: int):
    """The tiny GQA model's layer 1 on a calibrated 2Quad plan, its key set and ``tokens`` encrypted inputs:
    (model, config, plan, params, rotation steps, client, input ciphertexts)."""
    from fhe.attention import BlockClient, required_rotation_steps
    from fhe.params import ckks_params_for
    from tests.fhe.test_attention import calibrated_plan, layer_input, tiny_model

    model = tiny_model(bias=True)
    cfg = model.config
    x = layer_input(model, 1, torch.arange(tokens) % 7 + 3)
    plan = calibrated_plan(model, 1, x, "2quad")
    params = ckks_params_for("2quad", plan.approx.squarings)
    steps = required_rotation_steps(cfg, params, "2quad", plan.approx.squarings)
    client = CKKSClient(params, steps)
    inputs = BlockClient.for_model(client, cfg, "2quad", plan.approx.squarings).encrypt_input(x)
    return model, cfg, plan, params, steps, client, inputs


def _body(position: int, hoist_steps=(1, 5)):
    """A step whose plaintexts depend on ``position``: products, rotations (hoisted too), relinearization,
    rescale, sums, a mod-switch, and input 1 passed through unchanged."""

    def body(ev, cts, keys):
        x, y = cts
        top = ev.top
        w = np.cos(np.arange(ev.slots) * 0.01 + position)
        a = ev.rescale(ev.mul_plain(x, ev.encode(w, top, ev.prime(top))))
        many = ev.rotate_many(x, hoist_steps, keys)
        pts = ev.encode_many([w * 0.5, np.sin(w)], top, ev.prime(top))
        b = ev.rescale(ev.dot_plain([(many[hoist_steps[0]], pts[0]), (many[hoist_steps[-1]], pts[1])]))
        c = relin_rescale(ev, ev.mul(x, ev.rotate(x, -3, keys)), keys)
        ev.set_scale(b, ev.scale_of(a))
        ev.set_scale(c, ev.scale_of(a))
        s = add_plain_values(ev, ev.add_many([a, b, c]), np.full(ev.slots, 0.25 * position))
        return [ev.mod_switch(s, 1), y]

    return body


def _setup(device: str, seed: int = 0, step_graphs: bool = True):
    client = CKKSClient(P, STEPS)
    rng = np.random.default_rng(seed)
    cts = [client.encrypt(rng.uniform(-1, 1, P.slots)) for _ in range(2)]
    out = []
    for graphs in (step_graphs, False):
        ev = GpuEvaluator(P, device=device, step_graphs=graphs)
        keys = ev.load_keys(dict(client.public_blobs), STEPS)
        out.append((ev, keys, [ev.deserialize(seal.to_bytes(c)) for c in cts]))
    return out


def _same(got, want, ev) -> bool:
    return all(ev.serialize(g) == ev.serialize(w) for g, w in zip(got, want, strict=True))


def _check_steps(device: str) -> GpuEvaluator:
    (ev, keys, cts), (ref, rkeys, rcts) = _setup(device)
    for pos in (3, 4, 7):
        got = ev.run_step(_body(pos), cts, keys)
        want = _body(pos)(ref, rcts, rkeys)
        assert _same(got, want, ev) and got[1] is cts[1]          # the pass-through is the input itself
    ws = ev.whole_steps
    assert ws.replays + ws.eager == 3 and ws.fallbacks == 0
    return ev


def test_whole_steps_on_the_cpu_reference_are_the_eager_steps():
    ws = _check_steps("cpu").whole_steps
    assert ws.eager == 3 and ws.replays == ws.captures == 0         # no graphs off CUDA


def test_a_zero_digit_falls_back_to_the_eager_step():
    (ev, keys, cts), (ref, rkeys, rcts) = _setup("cpu", seed=1)
    cts[0].data[1].zero_()                                       # c1 = 0: every digit is 0
    rcts[0].data[1].zero_()
    got = ev.run_step(_body(2), cts, keys)
    assert ev.whole_steps.fallbacks == 1 and _same(got, _body(2)(ref, rcts, rkeys), ev)


def test_the_signature_names_the_operations_not_the_values():
    ev = GpuEvaluator(P, device="cpu")

    def sig(body):
        sh = ShadowEvaluator(ev)
        body(sh, [sh.input(2, ev.top, ev.scale), sh.input(2, ev.top, ev.scale)], None)
        return sh.signature(), len(sh.encodes)

    assert sig(_body(1)) == sig(_body(9))                        # other positions: other values only
    assert sig(_body(1))[1] == 4
    assert sig(_body(1)) != sig(_body(1, hoist_steps=(1, P.slots - 3)))


def test_a_step_that_encodes_otherwise_than_its_shadow_is_refused():
    (ev, keys, cts), _ = _setup("cpu")

    def sly(ev_, cts_, keys_):
        n = 1 if isinstance(ev_, ShadowEvaluator) else 2
        for _ in range(n):
            ev_.encode(np.ones(4), ev_.top, ev_.scale)
        return [cts_[0]]

    with pytest.raises(ShapeError):
        ev.run_step(sly, cts, keys)


@pytest.mark.gpu
@cuda
def test_whole_step_graphs_on_cuda_are_the_eager_steps():
    ev = _check_steps("cuda")
    ws = ev.whole_steps
    # the signature's first uses run eagerly (fed), the CAPTURE_AFTER-th is captured and replayed
    assert (ws.eager, ws.captures, ws.replays) == (CAPTURE_AFTER - 1, 1, 3 - CAPTURE_AFTER + 1)
    assert len(ws) == 1 and ws.key_copies == 1
    # another session (own keys and inputs) on the same evaluator: the same graph, its keys copied in
    ref = GpuEvaluator(P, device="cuda", step_graphs=False)
    client = CKKSClient(P, STEPS)
    rng = np.random.default_rng(4)
    raw = [seal.to_bytes(client.encrypt(rng.uniform(-1, 1, P.slots))) for _ in range(2)]
    keys = ev.load_keys(dict(client.public_blobs), STEPS)
    rkeys = ref.load_keys(dict(client.public_blobs), STEPS)
    got = ev.run_step(_body(5), [ev.deserialize(r) for r in raw], keys)
    assert _same(got, _body(5)(ref, [ref.deserialize(r) for r in raw], rkeys), ev)
    assert ws.captures == 1 and ws.key_copies == 2


@pytest.mark.gpu
@cuda
def test_attention_decode_steps_as_graphs_are_the_eager_steps():
    from fhe.attention import EncryptedAttentionLayer

    model, cfg, plan, params, steps, client, inputs = _tiny_block(12)
    outs = []
    for on in (False, True):
        ev = GpuEvaluator(params, device="cuda", encoder="fft", step_graphs=on)
        keys = ev.load_keys(dict(client.public_blobs), steps)
        block = EncryptedAttentionLayer(model.layers[1], model.rotary, plan, cfg, params, max_tokens=64,
                                        evaluator=ev)
        cache = block.new_cache()
        outs.append([ev.serialize(o) for o in block.prefill(cache, [ev.deserialize(seal.to_bytes(c))
                                                                    for c in inputs], 0, keys)])
        outs.append([ev.serialize(c) for c in cache.k_blocks + cache.v_blocks])
        if on:
            ws = ev.whole_steps
            assert ws.replays + ws.eager == len(inputs) and 1 <= ws.captures < ws.replays  # positions share graphs
    assert outs[0] == outs[2] and outs[1] == outs[3]


def test_an_input_relabelled_in_the_step_is_a_new_output():
    (ev, keys, cts), _ = _setup("cpu")

    def relabel(ev_, cts_, keys_):
        ev_.set_scale(cts_[1], 2.0 * ev_.scale_of(cts_[1]))
        return [cts_[0], cts_[1]]

    got = ev.run_step(relabel, cts, keys)
    assert got[0] is cts[0] and got[1] is not cts[1]
    assert got[1].scale == 2.0 * cts[1].scale and torch.equal(got[1].data, cts[1].data)
    assert cts[1].scale == ev.scale                              # the caller's input is left alone


@pytest.mark.heavy
def test_attention_steps_through_run_step_on_the_cpu_reference_are_the_eager_steps():
    """The block's wiring (its step as a function of ciphertexts, the cache rebuilt from the outputs) through the
    CPU reference's fed run: 3 tokens (the first token's own path, then rolls into its block); ~4 min here."""
    from fhe.attention import EncryptedAttentionLayer

    model, cfg, plan, params, steps, client, inputs = _tiny_block(3)
    outs = []
    for on in (False, True):
        ev = GpuEvaluator(params, device="cpu", step_graphs=on)
        keys = ev.load_keys(dict(client.public_blobs), steps)
        block = EncryptedAttentionLayer(model.layers[1], model.rotary, plan, cfg, params, max_tokens=64,
                                        evaluator=ev)
        cache = block.new_cache()
        got = block.prefill(cache, [ev.deserialize(seal.to_bytes(c)) for c in inputs], 0, keys)
        outs.append(([ev.serialize(o) for o in got], [ev.serialize(c) for c in cache.k_blocks + cache.v_blocks],
                     cache.length))
    assert outs[0] == outs[1] and ev.whole_steps.eager == len(inputs)
