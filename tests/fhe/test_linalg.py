"""Encrypted x plain linear algebra: BSGS slot maps and the hybrid matvec against numpy."""

import numpy as np
import pytest

from fhe.backends.seal.keys import CKKSClient
from fhe.errors import LevelError, ShapeError
from fhe.linalg import (
    HybridMatvec,
    PlainMatrix,
    SlotMap,
    Steps,
    hybrid_slots,
    pack_inputs,
    pick_fold,
    replicate_input,
    rotate_sum,
    rotate_sum_steps,
)
from fhe.params import CKKSParams

P = CKKSParams(8192, (60, 40, 40, 60), 40)


@pytest.fixture(scope="module")
def rng():
    return np.random.default_rng(0)


def _client(steps):
    return CKKSClient(P, tuple(steps))


def _ev():
    from fhe.backends import evaluator_for

    return evaluator_for(P, "seal")


@pytest.mark.parametrize("n_in,n_out", [(576, 576), (100, 37)])
def test_plain_matrix_matches_numpy(rng, n_in, n_out):
    w = rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)
    x = rng.standard_normal(n_in)
    pm = PlainMatrix(_ev(), w)
    assert len(pm.rotation_steps) <= 2 + pm.mv.fold.bit_length()   # baby, giant + one per tree level
    client = _client(pm.rotation_steps)
    out = pm(client.encrypt(pm.layout(x)), client.server_keys())
    assert np.abs(pm.extract(client.decrypt(out)) - x @ w).max() < 1e-4


def test_slot_map_with_steps_equals_plain(rng):
    s = P.slots
    dst = rng.choice(s, 200, replace=False)
    off = rng.integers(0, 4, 200) * 7 + rng.integers(0, 3, 200) * 100 + 5
    sm = SlotMap(s, dst, (dst + off) % s, rng.standard_normal(200), Steps(5, 7, 4, 100, 3))
    assert sm.rotation_steps == {5, 7, 100}
    client = _client(sm.rotation_steps)
    x = rng.standard_normal(s)
    ev = _ev()
    enc = sm.encode(ev, ev.top)
    got = client.decrypt(enc(ev, client.encrypt(x), client.server_keys()))
    assert np.abs(got - sm.apply_plain(x)).max() < 1e-4
    with pytest.raises(LevelError):
        enc(ev, ev.mod_switch(client.encrypt(x), 2), client.server_keys())


def test_slot_maps_of_one_shape_share_their_groups_and_keep_their_weights(rng):
    """A plan's layers build maps of the same slot indices with other weights: the diagonal groups (from the
    indices alone) are computed once and shared, the diagonals are each map's own; other indices, other groups."""
    from fhe.linalg import _map_groups

    s = P.slots
    dst = rng.choice(s, 120, replace=False)
    src = (dst + rng.integers(0, 3, 120) * 7 + 5) % s            # babies 0..2: one more step still fits
    a, b = (SlotMap(s, dst, src, rng.standard_normal(120), Steps(5, 7, 4)) for _ in range(2))
    assert a._groups is b._groups
    da, db = a.diagonals(None), b.diagonals(None)
    assert da.keys() == db.keys() and any(not np.array_equal(x[1], y[1]) for x, y in zip(da[0], db[0], strict=True))
    x = rng.standard_normal(s)
    assert not np.allclose(a.apply_plain(x), b.apply_plain(x))
    assert _map_groups(s, dst, (src + 7) % s, Steps(5, 7, 4)) is not a._groups


def test_slot_map_with_a_middle_step_equals_plain(rng):
    """pre + k*baby + j*mid + m*giant: babies over k and j, Horner over m (the output map's structure)."""
    s = P.slots
    steps = Steps(3, -9, 4, 200, 3, mid=100, n_mid=2)
    dst = rng.choice(s, 300, replace=False)
    off = 3 - 9 * rng.integers(0, 4, 300) + 100 * rng.integers(0, 2, 300) + 200 * rng.integers(0, 3, 300)
    sm = SlotMap(s, dst, (dst + off) % s, rng.standard_normal(300), steps)
    assert sm.rotation_steps == {3, s - 9, 100, 200}
    client = _client(sm.rotation_steps)
    x = rng.standard_normal(s)
    ev = _ev()
    enc = sm.encode(ev, ev.top)
    got = client.decrypt(enc(ev, client.encrypt(x), client.server_keys()))
    assert np.abs(got - sm.apply_plain(x)).max() < 1e-4


def test_steps_refuse_offsets_they_cannot_make():
    with pytest.raises(ShapeError):
        SlotMap(64, np.array([0]), np.array([3]), np.array([1.0]), Steps(0, 2, 2))


@pytest.mark.parametrize("horner", [False, True])
def test_rotate_sum_is_exact_for_any_count(rng, horner):
    step, count = 9, 14
    steps = {step} if horner else set(rotate_sum_steps(step, count))
    client = _client(steps)
    x = np.zeros(P.slots)
    x[: step * count] = rng.standard_normal(step * count)
    out = client.decrypt(rotate_sum(_ev(), client.encrypt(x), step, count, client.server_keys(),
                                    horner=horner))
    want = sum(np.roll(x, -k * step) for k in range(count))
    assert np.abs(out[:step] - want[:step]).max() < 1e-5


def _packed(rng, m: int, n_in: int = 100, n_out: int = 150):
    """A hybrid product of ``m`` positions per ciphertext (block layout) and its one-position peer."""
    w = rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)
    block = P.slots // m
    fold, period = pick_fold(block, n_in, n_out)
    mv = HybridMatvec(P.slots, w, hybrid_slots(block, period, fold, n_out), period, fold, m)
    return w, mv


def test_packed_matvec_gives_each_position_its_own_product(rng):
    """m = 3 positions in one ciphertext: every block's outputs are W x_j (within CKKS noise), equal to the
    one-position product of the same x_j; a short chunk (2 of 3) leaves the last block zero; the map's
    offsets, hence its Galois keys, are the one-block product's."""
    w, mv = _packed(rng, 3)
    one = HybridMatvec(mv.block, w, mv.out_slots, mv.period, mv.fold)
    assert mv.rotation_steps == one.rotation_steps                         # same offsets, same keys
    assert mv.map.num_diagonals == one.map.num_diagonals
    xs = rng.standard_normal((3, 100))
    single = PlainMatrix(_ev(), w.T)
    client = _client(mv.rotation_steps | single.rotation_steps)
    keys, ev = client.server_keys(), _ev()
    enc = mv.encode(ev, ev.top)
    for rows in (xs, xs[:2]):
        got = client.decrypt(enc(ev, client.encrypt(pack_inputs(rows, P.slots, mv.period, 3)), keys))
        per = got[mv.position_slots]
        for j, x in enumerate(rows):
            ref = single.extract(client.decrypt(single(client.encrypt(single.layout(x)), keys)))
            assert np.abs(per[j] - w @ x).max() < 1e-4 and np.abs(per[j] - ref).max() < 1e-4
        assert np.abs(per[len(rows):]).max(initial=0.0) < 1e-4
    with pytest.raises(ShapeError):
        pack_inputs(xs, P.slots, mv.period, 2)
    with pytest.raises(ShapeError):          # outputs of a block must not read into the next one
        late = mv.out_slots + (mv.block - mv.period + 1 - mv.out_slots.max())
        HybridMatvec(P.slots, w, late, mv.period, mv.fold, 3)
    assert np.array_equal(pack_inputs(xs[:1], P.slots, 100, 1), replicate_input(xs[0], P.slots, 100))


def test_packed_matvec_on_the_gpu_reference_is_seals_bytes(rng):
    """The packed product is an ordinary slot map: the gpu backend's torch-CPU code answers SEAL's residues."""
    from fhe.backends.gpu import GpuEvaluator, sealio
    from fhe.backends.seal import hazmat as seal

    w, mv = _packed(rng, 2, 64, 90)
    steps = tuple(sorted(mv.rotation_steps))
    client = _client(steps)
    ct = client.encrypt(pack_inputs(rng.standard_normal((2, 64)), P.slots, mv.period, 2))
    sev = _ev()
    theirs = mv.encode(sev, sev.top)(sev, ct, client.server_keys())
    gev = GpuEvaluator(P, device="cpu")
    ours = mv.encode(gev, gev.top)(gev, gev.deserialize(seal.to_bytes(ct)),
                                   gev.load_keys(dict(client.public_blobs), steps))
    raw = sealio.read_ciphertext(seal.to_bytes(theirs), P.poly_modulus_degree, gev.top)
    assert np.array_equal(gev.to_raw(ours).data, raw.data) and ours.scale == raw.scale
