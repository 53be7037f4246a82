"""The gpu backend's torch reference against SEAL at the shipped parameters (N = 32768, 12 data
primes of 50-60 bits): relinearize, rotate (hoisted too) and rescale, bit for bit. Slow on a CPU."""

from __future__ import annotations

import numpy as np
import pytest
import tenseal.sealapi as sa

from fhe import sealio
from fhe.backends.gpu import GpuEvaluator
from fhe.backends.seal import hazmat as seal
from fhe.backends.seal.keys import CKKSClient
from fhe.params import ckks_params_for


@pytest.mark.heavy   # CI checks the same code bit for bit at small N (test_gpu_backend.py); CUDA at this size
def test_key_switching_at_the_default_parameters():
    params = ckks_params_for("sqexp", 6)
    steps = (1, 64)
    client = CKKSClient(params, steps)
    server = client.server_keys()
    ev = GpuEvaluator(params, device="cpu")
    keys = ev.load_keys(dict(client.public_blobs), steps)
    rng = np.random.default_rng(0)
    a, b = (client.encrypt(rng.uniform(-1, 1, params.slots)) for _ in range(2))
    A, B = ev.deserialize(seal.to_bytes(a)), ev.deserialize(seal.to_bytes(b))

    def same(ours, theirs):
        raw = sealio.read_ciphertext(seal.to_bytes(theirs), params.poly_modulus_degree, ev.top)
        return np.array_equal(ev.to_raw(ours).data, raw.data) and ours.scale == raw.scale

    c = client.kit.mul(a, b)
    r = sa.Ciphertext()
    client.kit.evaluator.relinearize(c, server.relin, r)
    R = ev.relinearize(ev.mul(A, B), keys)
    assert same(R, r)
    out = sa.Ciphertext()
    client.kit.evaluator.rescale_to_next(r, out)
    assert same(ev.rescale(R), out)
    many = ev.rotate_many(A, steps, keys)
    for step in steps:
        want = client.kit.rotate(a, step, server.galois)
        assert same(many[step], want)
    assert same(ev.rotate(A, 64, keys), client.kit.rotate(a, 64, server.galois))
