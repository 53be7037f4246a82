"""Every backend keeps the evaluator protocol's contracts (fhe/evaluator.py): the SEAL backend on real
ciphertexts and the symbolic one on plaintext values give the same levels, scales, sizes and values, op by
op. A new backend joins by adding its name and key holder here (the gpu backend, issue 16, has: on a
machine without CUDA it runs its torch-CPU reference)."""

from __future__ import annotations

import numpy as np
import pytest

from fhe.backends import evaluator_for
from fhe.errors import KeyMismatchError, LevelError, WireError
from fhe.evaluator import EvalKeys, Evaluator, KeyHolder, relin_rescale
from fhe.params import CKKSParams

P = CKKSParams(8192, (60, 40, 40, 60), 40)
STEPS = (1, 5, P.slots - 3)
TOL = 1e-4          # SEAL's noise at N = 8192, 2^40 (the symbolic backend is exact)


class _SealClientForGpu:
    """The gpu backend's client is SEAL's: its ciphertexts cross the seam as SEAL bytes, as on the wire."""

    def __init__(self) -> None:
        from fhe.backends.seal.keys import CKKSClient

        self._client = CKKSClient(P, STEPS)
        self._ev = evaluator_for(P, "gpu")
        self.params, self.fingerprint = P, self._client.fingerprint
        self.public_blobs = self._client.public_blobs

    def encrypt(self, values):
        return self._ev.deserialize(self._client.encrypt_bytes(values))

    def decrypt(self, ct):
        from fhe.backends.seal import hazmat

        return self._client.decrypt(hazmat.from_bytes("ciphertext", self._client.kit, self._ev.serialize(ct)))


def _holder(name: str) -> KeyHolder:
    if name == "seal":
        from fhe.backends.seal.keys import CKKSClient

        return CKKSClient(P, STEPS)
    if name == "gpu":
        return _SealClientForGpu()
    from fhe.backends.symbolic import SymbolicClient

    return SymbolicClient(P, STEPS)


@pytest.fixture(scope="module", params=["seal", "symbolic", "gpu"])
def backend(request):
    ev = evaluator_for(P, request.param)
    holder = _holder(request.param)
    blobs = getattr(holder, "public_blobs", {"public_key": b"", "relin_keys": b"", "galois_keys": b""})
    keys = ev.load_keys(dict(blobs), STEPS)
    return ev, holder, keys


def _vec(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, P.slots)


def test_it_is_an_evaluator(backend):
    ev, holder, keys = backend
    assert isinstance(ev, Evaluator) and isinstance(keys, EvalKeys) and isinstance(holder, KeyHolder)
    assert keys.backend == ev.name and keys.params == P and set(STEPS) <= set(keys.rotation_steps)
    assert (ev.slots, ev.top, ev.scale) == (P.slots, 3, 2.0 ** 40)


def test_arithmetic_levels_scales_and_values(backend):
    ev, holder, keys = backend
    x, y = _vec(1), _vec(2)
    a, b = holder.encrypt(x), holder.encrypt(y)
    s = ev.add(a, b)
    assert (ev.level(s), ev.scale_of(s), ev.size(s)) == (3, ev.scale, 2)
    assert np.abs(holder.decrypt(s) - (x + y)).max() < TOL
    pt = ev.encode(y, ev.top, ev.prime(ev.top))
    m = ev.mul_plain(a, pt)
    assert ev.scale_of(m) == ev.scale * ev.prime(3) and ev.level(m) == 3
    r = ev.rescale(m)
    assert ev.level(r) == 2 and abs(ev.scale_of(r) / ev.scale - 1) < 1e-12
    assert np.abs(holder.decrypt(r) - x * y).max() < TOL
    c = ev.mul(a, b)
    assert ev.size(c) == 3
    c = relin_rescale(ev, c, keys)
    assert (ev.size(c), ev.level(c)) == (2, 2)
    assert np.abs(holder.decrypt(c) - x * y).max() < TOL
    sq = relin_rescale(ev, ev.square(a), keys)
    assert np.abs(holder.decrypt(sq) - x * x).max() < TOL
    d = ev.dot_plain([(a, pt), (b, pt)])
    assert np.abs(holder.decrypt(d) - (x + y) * y).max() < TOL
    low = ev.mod_switch(a, 1)
    assert ev.level(low) == 1 and ev.level(a) == 3            # out of place
    assert ev.mod_switch(a, 3) is a
    with pytest.raises((LevelError, ValueError)):
        ev.mod_switch(low, 2)


def test_in_place_and_relabel(backend):
    ev, holder, keys = backend
    x = _vec(3)
    a = holder.encrypt(x)
    ev.add_inplace(a, holder.encrypt(x))
    ev.add_plain_inplace(a, ev.encode(x, ev.top, ev.scale))
    assert np.abs(holder.decrypt(a) - 3 * x).max() < TOL
    ev.set_scale(a, ev.scale * 2)                              # same integers, half the message
    assert np.abs(holder.decrypt(a) - 1.5 * x).max() < TOL


def test_rotations(backend):
    ev, holder, keys = backend
    x = _vec(4)
    a = holder.encrypt(x)
    for step in STEPS:
        assert np.abs(holder.decrypt(ev.rotate(a, step, keys)) - np.roll(x, -step)).max() < TOL
    many = ev.rotate_many(a, [1, 5, -3], keys)
    assert sorted(many) == [-3, 1, 5]
    assert np.abs(holder.decrypt(many[-3]) - np.roll(x, 3)).max() < TOL
    assert ev.rotate(a, 0, keys) is a
    with pytest.raises((KeyMismatchError, ValueError)):      # no Galois key for 2
        ev.rotate(a, 2, keys)


def test_serialization_round_trip(backend):
    ev, holder, keys = backend
    x = _vec(5)
    a = ev.rescale(ev.mul_plain(holder.encrypt(x), ev.encode(np.ones(P.slots), 3, ev.prime(3))))
    back = ev.deserialize(ev.serialize(a))
    assert (ev.level(back), ev.scale_of(back), ev.size(back)) == (ev.level(a), ev.scale_of(a), 2)
    assert np.abs(holder.decrypt(back) - x).max() < TOL
    assert ev.nbytes(back) > 0
    with pytest.raises(WireError):
        ev.deserialize(b"garbage" * 10)
