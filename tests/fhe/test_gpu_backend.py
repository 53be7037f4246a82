"""The gpu backend's torch reference (fhe/backends/gpu) against SEAL, bit for bit, on the same inputs.

Every protocol operation that needs no encoding randomness is compared residue by residue with what
tenseal.sealapi computes from the same ciphertexts and keys (N = 8192 here: fast; the default
parameters in test_gpu_backend_full.py). The CUDA kernels are checked against this reference on the
GPU machine (test_gpu_backend_cuda.py).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import tenseal.sealapi as sa
import torch

from fhe import sealio
from fhe.backends import evaluator_for
from fhe.backends.gpu import GpuEvaluator
from fhe.backends.gpu.keys import key_set_nbytes
from fhe.backends.gpu.modarith import mulmod
from fhe.backends.gpu.ntt import NTTTables, intt, ntt
from fhe.backends.seal import hazmat as seal
from fhe.backends.seal.keys import CKKSClient
from fhe.errors import KeyMismatchError, LevelError, ShapeError, WireError
from fhe.params import CKKSParams, KeyLevels, ckks_params_for

P = CKKSParams(8192, (60, 40, 40, 60), 40)
STEPS = (1, 5, P.slots - 3)


@pytest.fixture(scope="module")
def setup():
    client = CKKSClient(P, STEPS)
    ev = GpuEvaluator(P, device="cpu")
    keys = ev.load_keys(dict(client.public_blobs), STEPS)
    rng = np.random.default_rng(7)
    a, b = (client.encrypt(rng.uniform(-1, 1, P.slots)) for _ in range(2))
    return client, client.server_keys(), ev, keys, a, b


def same(ev: GpuEvaluator, ours, theirs) -> bool:
    """Residues, level and scale of our ciphertext equal SEAL's."""
    raw = sealio.read_ciphertext(seal.to_bytes(theirs), P.poly_modulus_degree, ev.top)
    return np.array_equal(ev.to_raw(ours).data, raw.data) and ours.scale == raw.scale


def test_registered_and_named():
    ev = evaluator_for(P, "gpu")
    assert ev.name == "gpu" and ev.params == P and (ev.slots, ev.top) == (P.slots, 3)


def test_mulmod_is_exact_for_60_bit_primes():
    rnd = random.Random(1)
    for bits in (30, 40, 50, 60):
        q = rnd.getrandbits(bits) | (1 << (bits - 1)) | 1
        a = [rnd.randrange(q) for _ in range(4000)] + [0, 1, q - 1, q - 1]
        b = [rnd.randrange(q) for _ in range(4000)] + [q - 1, q - 1, 1, q - 1]
        got = mulmod(torch.tensor(a), torch.tensor(b), torch.tensor(q)).tolist()
        assert got == [x * y % q for x, y in zip(a, b, strict=True)]


def test_ntt_is_seals(setup):
    client, _, ev, _, a, _ = setup
    coeffs = sa.Ciphertext()
    client.kit.evaluator.transform_from_ntt(a, coeffs)
    arr = coeffs.dyn_array()
    want = torch.tensor([arr.at(i) for i in range(arr.size())], dtype=torch.int64).view(2, 3, -1)
    tab = NTTTables.build(client.kit.primes, P.poly_modulus_degree)
    ours = ev.deserialize(seal.to_bytes(a)).data
    assert torch.equal(intt(ours, tab), want) and torch.equal(ntt(want, tab), ours)


def test_add_mul_plain_rescale_mod_switch(setup):
    client, _, ev, _, a, b = setup
    kit = client.kit
    A, B = ev.deserialize(seal.to_bytes(a)), ev.deserialize(seal.to_bytes(b))
    assert same(ev, ev.add(A, B), kit.add(a, b))
    values = np.linspace(-1, 1, P.slots)
    pt, PT = kit.encode(values, 3, kit.prime(3)), ev.encode(values, 3, kit.prime(3))
    assert same(ev, ev.add_plain(A, ev.encode(values, 3, ev.scale)), kit.add_plain_values(a, values))
    m, M = kit.mul_plain(a, pt), ev.mul_plain(A, PT)
    assert same(ev, M, m)
    r = sa.Ciphertext()
    kit.evaluator.rescale_to_next(m, r)
    assert same(ev, ev.rescale(M), r)
    assert same(ev, ev.mod_switch(A, 1), kit.drop_to(a, 1))
    assert same(ev, ev.dot_plain([(A, PT), (B, PT)]), kit.dot_plain([(a, pt), (b, pt)]))


def test_mul_square_relinearize(setup):
    client, server, ev, keys, a, b = setup
    kit = client.kit
    A, B = ev.deserialize(seal.to_bytes(a)), ev.deserialize(seal.to_bytes(b))
    c, C = kit.mul(a, b), ev.mul(A, B)
    assert same(ev, C, c)
    r = sa.Ciphertext()
    kit.evaluator.relinearize(c, server.relin, r)
    assert same(ev, ev.relinearize(C, keys), r)
    sq = sa.Ciphertext()
    kit.evaluator.square(a, sq)
    assert same(ev, ev.square(A), sq)
    low = kit.drop_to(c, 2)                                   # key switching below the top level
    kit.evaluator.relinearize(low, server.relin, r)
    assert same(ev, ev.relinearize(ev.mod_switch(C, 2), keys), r)


@pytest.mark.parametrize("level", [3, 2, 1])
def test_rotations_and_hoisting(setup, level):
    client, server, ev, keys, a, _ = setup
    kit = client.kit
    a = kit.drop_to(a, level)
    A = ev.deserialize(seal.to_bytes(a))
    many = ev.rotate_many(A, [1, 5, -3, 0], keys)
    for step in (1, 5, -3):
        want = kit.rotate(a, step, server.galois)
        assert same(ev, ev.rotate(A, step, keys), want)
        assert same(ev, many[step], want)                    # hoisted == one by one == SEAL
    assert many[0] is A and ev.rotate(A, 0, keys) is A


@pytest.mark.parametrize("batch", [True, False])
def test_rotate_each_is_rotate_one_by_one(setup, batch, monkeypatch):
    """``rotate_each`` (several ciphertexts, each its own step: one batched decomposition and finish with
    ``BATCH_SWITCHES``, session 18) = SEAL's rotations one by one; a step of 0 passes its input through."""
    from fhe.backends.gpu import evaluator

    monkeypatch.setattr(evaluator, "BATCH_SWITCHES", batch)
    client, server, ev, keys, a, b = setup
    kit = client.kit
    A, B = ev.deserialize(seal.to_bytes(a)), ev.deserialize(seal.to_bytes(b))
    got = ev.rotate_each([A, B, A, B], [1, 5, 0, -3], keys)
    assert got[2] is A
    for g, ct, step in zip(got, (a, b, a, b), (1, 5, 0, -3), strict=True):
        assert same(ev, g, ct if step == 0 else kit.rotate(ct, step, server.galois))
    many = ev.rotate_many(A, [1, 5, -3], keys)                # the hoisted steps finished as one batch (or not)
    for step in (1, 5, -3):
        assert same(ev, many[step], kit.rotate(a, step, server.galois))
    with pytest.raises(ShapeError):
        ev.rotate_each([A], [1, 5], keys)


def test_results_decrypt_on_the_seal_client(setup):
    client, _, ev, keys, _, _ = setup
    x = np.random.default_rng(3).uniform(-1, 1, P.slots)
    A = ev.deserialize(client.encrypt_bytes(x))             # seeded upload: expanded through SEAL
    out = seal.from_bytes("ciphertext", client.kit, ev.serialize(ev.rotate(A, 5, keys)))
    assert np.abs(client.decrypt(out) - np.roll(x, -5)).max() < 1e-4


def test_bad_input_is_typed(setup):
    client, _, ev, keys, a, b = setup
    A = ev.deserialize(seal.to_bytes(a))
    with pytest.raises(WireError):
        ev.deserialize(b"garbage" * 10)
    raw = ev.to_raw(A)
    raw.data = raw.data.copy()
    raw.data[0, 0, 0] = ev.ctx.primes[0]                     # a residue that is not one
    with pytest.raises(WireError):
        ev.deserialize(sealio.write_ciphertext(raw))
    with pytest.raises(KeyMismatchError):
        ev.rotate(A, 2, keys)
    with pytest.raises(LevelError):
        ev.add(A, ev.mod_switch(A, 2))
    with pytest.raises(LevelError):
        ev.rescale(ev.mod_switch(A, 1))
    with pytest.raises(ShapeError):
        ev.add_many([])
    with pytest.raises(ShapeError):
        ev.encode(np.ones(P.slots + 1), 3, ev.scale)


def test_level_aware_keys_switch_like_seal():
    """Keys made at the level where they are used (galois_keys@L, relin_keys@L: what the private service
    takes) load as smaller tensors and give SEAL's residues at their level and below; above, LevelError."""
    levels = KeyLevels.build(P, {1: 3, 5: 2}, 2)
    client = CKKSClient(P, (1, 5), levels=levels)
    server = client.server_keys()
    ev = GpuEvaluator(P, device="cpu")
    keys = ev.load_keys(dict(client.public_blobs), levels)
    assert keys.relin.shape[:3] == (2, 2, 3) and keys.nbytes() == key_set_nbytes(P, levels)
    kit = client.kit
    x = client.encrypt(np.random.default_rng(5).uniform(-1, 1, P.slots))
    for level, step in ((3, 1), (2, 1), (2, 5), (1, 5)):
        a = kit.drop_to(x, level)
        sev, gk = server.rotation_key(step, level)
        want = sa.Ciphertext()
        sev.rotate_vector(a, step, gk, want)
        A = ev.deserialize(seal.to_bytes(a))
        assert same(ev, ev.rotate(A, step, keys), want) and same(ev, ev.rotate_many(A, [step], keys)[step], want)
    c = kit.drop_to(kit.mul(x, x), 2)
    sev, rk = server.relin_key(2)
    want = sa.Ciphertext()
    sev.relinearize(c, rk, want)
    C = ev.mod_switch(ev.mul(*(ev.deserialize(seal.to_bytes(x)),) * 2), 2)
    assert same(ev, ev.relinearize(C, keys), want)
    with pytest.raises(LevelError):
        ev.rotate(ev.deserialize(seal.to_bytes(x)), 5, keys)           # step 5's key serves levels <= 2
    with pytest.raises(LevelError):
        ev.relinearize(ev.mul(*(ev.deserialize(seal.to_bytes(x)),) * 2), keys)


def test_fft_encoder_is_seals_encoding(setup):
    """The on-device encoder (``encoder="fft"``): coefficients within 1 of SEAL's, usually equal, and the
    result decrypts to the values (through SEAL) as closely as SEAL's own plaintext does."""
    client, _, ev, _, a, _ = setup
    fast = GpuEvaluator(P, device="cpu", encoder="fft")
    rng = np.random.default_rng(11)
    for level, scale, count in ((3, 2.0 ** 40, P.slots), (2, fast.prime(2), 100), (1, 2.0 ** 30, P.slots)):
        values = rng.uniform(-4, 4, count)
        ours, theirs = fast.encode(values, level, scale), ev.encode(values, level, scale)
        tab = ev.ctx.level(level).data
        diff = torch.remainder(intt(ours.data, tab) - intt(theirs.data, tab) + 1, tab.primes)
        assert ours.scale == theirs.scale and int(diff.max()) <= 2          # every coefficient within +-1
        A = ev.mod_switch(ev.deserialize(seal.to_bytes(a)), level)
        got = client.decrypt(seal.from_bytes("ciphertext", client.kit, ev.serialize(ev.add_plain(
            A, fast.encode(values, level, ev.scale)))))
        want = client.decrypt(seal.from_bytes("ciphertext", client.kit, ev.serialize(ev.add_plain(
            A, ev.encode(values, level, ev.scale)))))
        assert np.abs(got - want).max() < 1e-6
    with pytest.raises(ValueError):
        GpuEvaluator(P, device="cpu", encoder="other")


def test_encode_many_is_encode_one_by_one(setup):
    """The batched encoder (what packed prefill's projections use): each plaintext is ``encode``'s own,
    residue for residue, with either encoder; vectors of different lengths; bad input typed."""
    _, _, ev, _, _, _ = setup
    fast = GpuEvaluator(P, device="cpu", encoder="fft")
    rng = np.random.default_rng(5)
    values = [rng.uniform(-3, 3, n) for n in (P.slots, 17, P.slots // 2)]
    for e in (fast, ev):
        for level, scale in ((3, 2.0 ** 40), (2, e.prime(2))):
            got = e.encode_many(values, level, scale)
            for g, v in zip(got, values, strict=True):
                want = e.encode(v, level, scale)
                assert torch.equal(g.data, want.data) and g.scale == want.scale
    assert fast.encode_many([], 3, 2.0 ** 40) == []
    with pytest.raises(LevelError):
        fast.encode_many(values, 9, 2.0 ** 40)
    with pytest.raises(ShapeError):
        fast.encode_many([np.zeros(P.slots + 1), np.zeros(3)], 3, 2.0 ** 40)


def test_a_plans_diagonals_encode_in_batches_as_one_by_one(setup, monkeypatch):
    """``encode_groups`` (how a plan's products encode their diagonals: the gpu worker's start) keeps every
    group's keys, tags and order, across batch boundaries, and each plaintext is ``encode``'s own, with the
    batched on-device encoder and with SEAL's (one by one)."""
    import fhe.evaluator as fev

    _, _, ev, _, _, _ = setup
    monkeypatch.setattr(fev, "ENCODE_BATCH", 3)                   # batches cut through the groups
    rng = np.random.default_rng(9)
    groups = {(g, k): [(t, j, rng.uniform(-1, 1, P.slots)) for t in range(2) for j in range(1 + g)]
              for g in range(3) for k in range(2)}
    for e in (GpuEvaluator(P, device="cpu", encoder="fft"), ev):
        got = fev.encode_groups(e, groups, 2, e.prime(2))
        assert list(got) == list(groups)
        for key, grp in groups.items():
            assert [item[:2] for item in got[key]] == [item[:2] for item in grp]
            for (_, _, pt), (_, _, v) in zip(got[key], grp, strict=True):
                assert torch.equal(pt.data, e.encode(v, 2, e.prime(2)).data)


def test_packed_diagonals_built_in_torch_are_numpys():
    """Packed prefill on the gpu backend builds its per-chunk diagonals in torch on the device
    (``PackedMap.diagonals``, ``_rope_rows_torch``): the same values bit for bit as the numpy path the
    other backends take, at the shipped geometry, per-row maps and one shared map; ``diagonals_many`` (several
    shifts at once) the same values, plus all-zero rows for babies the numpy path skips."""
    from engine.config import ModelConfig
    from fhe.geometry import Geometry
    from fhe.packed import PackedMap, _rope_rows, _rope_rows_torch

    cfg = ModelConfig.from_hf_dict({"hidden_size": 576, "intermediate_size": 64, "num_hidden_layers": 1,
                                    "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 64,
                                    "rope_theta": 100000.0, "rms_norm_eps": 1e-5})
    params = ckks_params_for("sqexp", 6)
    geo = Geometry.build(cfg, params, "sqexp", 6)
    rng = np.random.default_rng(2)
    n, D, Hq = 5, geo.layout.head_dim, geo.layout.num_heads
    w, cos, sin = rng.standard_normal((Hq, D, 576)), rng.standard_normal((n, D)), rng.standard_normal((n, D))
    rows = _rope_rows(w, cos, sin)
    assert np.array_equal(_rope_rows_torch(*(torch.from_numpy(a) for a in (w, cos, sin))).numpy(), rows)
    for mat in (rows.reshape(n, Hq * D, -1), rng.standard_normal((1, Hq * D, 576)).astype(np.float32)):
        ref, dev = PackedMap(geo, mat), PackedMap(geo, torch.from_numpy(mat))
        for a in (0, 1, D - 1):
            want = list(ref.plaintexts(a, n))
            ks, vals = dev.diagonals(a, n)
            assert ks == [k for k, _ in want] and vals.shape == (len(want), params.slots)
            assert all(np.array_equal(v.numpy(), p) for v, (_, p) in zip(vals, want, strict=True))
        shifts = [D - 1, 5, 1, 0]                              # several shifts in one gather (session 19)
        keep, many = dev.diagonals_many(shifts, n)
        assert many.shape == (len(shifts), len(keep), params.slots)
        for a, vals in zip(shifts, many, strict=True):
            want = dict(ref.plaintexts(a, n))
            assert all(np.array_equal(vals[i].numpy(), want[k]) if k in want else not vals[i].any()
                       for i, k in enumerate(keep)) and set(want) <= set(keep)


def test_encode_many_takes_a_tensor_of_rows(setup):
    """Values already on the evaluator's device ([K, slots] tensor): each plaintext still ``encode``'s."""
    _, _, ev, _, _, _ = setup
    fast = GpuEvaluator(P, device="cpu", encoder="fft")
    vals = torch.from_numpy(np.random.default_rng(4).uniform(-2, 2, (3, P.slots)))
    for e in (fast, ev):
        for g, v in zip(e.encode_many(vals, 2, 2.0 ** 40), vals, strict=True):
            assert torch.equal(g.data, e.encode(v.numpy(), 2, 2.0 ** 40).data)
    assert fast.encode_many(vals[:0], 2, 2.0 ** 40) == []
    with pytest.raises(ShapeError):
        fast.encode_many(torch.zeros(2, P.slots + 1), 2, 2.0 ** 40)
