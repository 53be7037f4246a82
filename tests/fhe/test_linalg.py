"""Encrypted x plain linear algebra: BSGS slot maps and the hybrid matvec against numpy."""

import numpy as np
import pytest

from fhe.backends.seal.keys import CKKSClient
from fhe.errors import LevelError, ShapeError
from fhe.linalg import (
    PlainMatrix,
    SlotMap,
    Steps,
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


def test_hoisted_plain_matrix_is_seals_bit_for_bit_on_the_gpu_reference(rng):
    """``hoist=True`` (babies by rotate_many, one key each; issue 16's matmul): decrypts to x @ W on SEAL, and the
    gpu backend's torch-CPU reference gives SEAL's ciphertext residue for residue, called plainly and as one
    whole step (``run_step``: the shadow run and the fed run a CUDA graph would capture)."""
    from fhe.backends.gpu import GpuEvaluator

    w = rng.standard_normal((576, 576)) / np.sqrt(576)
    x = rng.standard_normal(576)
    pm = PlainMatrix(_ev(), w, hoist=True)
    steps = pm.mv.map.steps
    assert steps.hoist and steps.n_baby == 16 and steps.n_giant == 9            # w = 144: 16 babies, 9 giants
    assert pm.rotation_steps == set(range(1, 16)) | {16, 144, 288}
    client = _client(pm.rotation_steps)
    ct = client.encrypt(pm.layout(x))
    out = pm(ct, client.server_keys())
    assert np.abs(pm.extract(client.decrypt(out)) - x @ w).max() < 1e-4
    gev = GpuEvaluator(P, device="cpu", step_graphs=True)
    gpm = PlainMatrix(gev, w, hoist=True)
    keys = gev.load_keys(dict(client.public_blobs), tuple(pm.rotation_steps))
    gct = gev.deserialize(seal_bytes(ct))
    want = gev.serialize(gev.deserialize(seal_bytes(out)))
    assert gev.serialize(gpm(gct, keys)) == want
    (whole,) = gev.run_step(lambda ev, ins, k: [gpm.encoded(ev, ins[0], k)], [gct], keys)
    assert gev.serialize(whole) == want and gev.whole_steps.eager == 1


def test_hoisted_plain_matrix_with_giants_each_is_seals_on_the_gpu_reference(rng, monkeypatch):
    """``giants_each=True``: the giant sums each rotated by their own key (``rotate_each``, batched with the gpu
    backend's ``BATCH_SWITCHES``) = SEAL's loop of the same rotations, bit for bit, batched or not."""
    from fhe.backends.gpu import GpuEvaluator, evaluator

    w = rng.standard_normal((576, 576)) / np.sqrt(576)
    x = rng.standard_normal(576)
    pm = PlainMatrix(_ev(), w, hoist=True, giants_each=True)
    assert pm.rotation_steps == set(range(1, 16)) | {16 * m for m in range(1, 9)} | {144, 288}
    client = _client(pm.rotation_steps)
    ct = client.encrypt(pm.layout(x))
    out = pm(ct, client.server_keys())
    assert np.abs(pm.extract(client.decrypt(out)) - x @ w).max() < 1e-4
    gev = GpuEvaluator(P, device="cpu")
    gpm = PlainMatrix(gev, w, hoist=True, giants_each=True)
    keys = gev.load_keys(dict(client.public_blobs), tuple(pm.rotation_steps))
    gct = gev.deserialize(seal_bytes(ct))
    want = gev.serialize(gev.deserialize(seal_bytes(out)))
    for batch in (False, True):
        monkeypatch.setattr(evaluator, "BATCH_SWITCHES", batch)
        assert gev.serialize(gpm(gct, keys)) == want


def seal_bytes(ct) -> bytes:
    from fhe.backends.seal import hazmat as seal

    return seal.to_bytes(ct)
