"""The position-interleaved chunk product (fhe/interleaved.py): every position's W x against numpy, a short
chunk, the layout chosen from shapes, and the gpu backend's torch-CPU reference answering SEAL's residues."""

import numpy as np
import pytest

from fhe.backends.seal.keys import CKKSClient
from fhe.errors import ShapeError
from fhe.interleaved import ChunkShape, chunk_shape
from fhe.mlp import MLP_PARAMS as P


@pytest.fixture(scope="module")
def rng():
    return np.random.default_rng(0)


def _ev():
    from fhe.backends import evaluator_for

    return evaluator_for(P, "seal")


@pytest.mark.parametrize("n_in,n_out,m,tile,baby,folds", [(100, 700, 4, 32, 4, [1]), (72, 40, 8, 32, 2, [8]),
                                                            (40, 1100, 4, 16, 4, [1, 8])])
def test_chunk_product_gives_each_position_its_own_product(rng, n_in, n_out, m, tile, baby, folds):
    """Several tiles in, several output ciphertexts (n_out > R), m positions, a short group folded (its
    outputs use fewer diagonals and fold their partial sums): every position's outputs are W x_p; a short
    chunk leaves the absent positions zero."""
    sh = ChunkShape(P.slots, n_in, n_out, m, tile, baby)
    assert sh.tiles > 1 and sh.giants(0) > 1 and [sh.fold(g) for g in range(sh.groups)] == folds
    assert {m, m * baby} <= sh.rotation_steps and sh.products == sum(sh.tiles * tile // c for c in folds)
    w = rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)
    client = CKKSClient(P, tuple(sorted(sh.rotation_steps)))
    keys, ev = client.server_keys(), _ev()
    enc = sh.encode(ev, w, ev.top)
    xs = rng.standard_normal((m, n_in))
    for rows in (xs, xs[: m - 1]):
        outs = enc(ev, [client.encrypt(v) for v in sh.pack(rows)], keys)
        assert len(outs) == sh.groups and all(ev.level(c) == ev.top - 1 for c in outs)
        values = [client.decrypt(c) for c in outs]
        assert np.abs(sh.unpack(values, len(rows)) - rows @ w.T).max() < 1e-5
        assert np.abs(sh.unpack(values, m)[len(rows):]).max(initial=0.0) < 1e-5
    with pytest.raises(ShapeError):
        sh.pack(np.zeros((m + 1, n_in)))
    with pytest.raises(ShapeError):
        enc(ev, [client.encrypt(sh.pack(xs)[0])], keys)


def test_chunk_shape_is_chosen_from_shapes_and_shares_rotations():
    """SmolLM2's four parts at N = 8192, 8 positions: the layout's rotations per position are a fraction of the
    one-position hybrid product's (24 to 46), its products within 7 % of the slot floor m * n_in * n_out / S."""
    for n_out, n_in in ((960, 576), (576, 576), (3072, 576), (576, 1536)):
        sh = chunk_shape(P.slots, n_in, n_out, 8)
        assert sh is chunk_shape(P.slots, n_in, n_out, 8)
        assert sh.rows % sh.tile == 0 and sh.rotations / 8 <= 14
        assert sh.products <= 1.07 * 8 * n_in * n_out / P.slots
    with pytest.raises(ShapeError):
        ChunkShape(P.slots, 10, 10, 3, 8, 2)


def test_chunk_product_on_the_gpu_reference_is_seals_bytes(rng):
    """Only evaluator-protocol calls: the gpu backend's torch-CPU code answers SEAL's residues."""
    from fhe import sealio
    from fhe.backends.gpu import GpuEvaluator
    from fhe.backends.seal import hazmat as seal

    sh = ChunkShape(P.slots, 40, 1100, 4, 16, 4)
    steps = tuple(sorted(sh.rotation_steps))
    w = rng.standard_normal((1100, 40))
    client = CKKSClient(P, steps)
    cts = [client.encrypt(v) for v in sh.pack(rng.standard_normal((3, 40)))]
    sev = _ev()
    theirs = sh.encode(sev, w, sev.top)(sev, cts, client.server_keys())
    gev = GpuEvaluator(P, device="cpu")
    ours = sh.encode(gev, w, gev.top)(gev, [gev.deserialize(seal.to_bytes(c)) for c in cts],
                                      gev.load_keys(dict(client.public_blobs), steps))
    for a, b in zip(ours, theirs, strict=True):
        raw = sealio.read_ciphertext(seal.to_bytes(b), P.poly_modulus_degree, gev.top)
        assert np.array_equal(gev.to_raw(a).data, raw.data) and a.scale == raw.scale
