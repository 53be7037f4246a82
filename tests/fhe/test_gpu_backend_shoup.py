"""The CUDA NTT's Shoup companions and the sync-free encode's host bound, on the CPU (CI; issue 16).

The Triton butterflies multiply a twiddle w by Shoup's method with the tables' ``floor(w 2^64 / q)``; this
checks that identity on the shipped primes' real tables with exact Python integers (the kernels themselves
are checked against the torch reference on the GPU: tests/fhe/test_gpu_backend_cuda.py). The on-device
encoder decides its 2^62 fallback on the host where the values allow (``_fits_on_host``): the bound must
hold for the actual coefficients.
"""

from __future__ import annotations

import numpy as np
import torch

from fhe.backends.gpu import GpuEvaluator
from fhe.backends.gpu.evaluator import _fits_on_host
from fhe.backends.gpu.ntt import NTTTables
from fhe.params import CKKSParams, ckks_params_for


def test_shoup_companions_give_the_canonical_product_on_the_shipped_primes():
    params = ckks_params_for("sqexp", 6)
    tab = GpuEvaluator(params, device="cpu").ctx.tables
    rng = np.random.default_rng(0)
    for row, q in enumerate(int(v) for v in tab.primes.view(-1)):
        cols = rng.integers(0, params.poly_modulus_degree, 64)
        for w, ws in zip(tab.roots[row, cols].tolist(), tab.roots_shoup[row, cols].tolist(), strict=True):
            ws %= 1 << 64                                              # the uint64 bits
            assert ws == (w << 64) // q
            for a in [0, 1, q - 1, int(rng.integers(0, q))]:
                r = (a * w - ((a * ws) >> 64) * q) % (1 << 64)          # what the kernel computes, wrapping
                assert r < 2 * q and r % q == a * w % q


def test_shoup_tables_follow_take():
    tab = NTTTables.build([1152921504606584833, 1125899906826241], 16)
    sub = tab.take([1])
    assert torch.equal(sub.roots_shoup, tab.roots_shoup[1:])
    assert torch.equal(sub.inv_roots_shoup, tab.inv_roots_shoup[1:])


def test_host_bound_holds_for_the_encoded_coefficients():
    params = CKKSParams(8192, (60, 40, 40, 60), 40)
    n, rng = params.poly_modulus_degree, np.random.default_rng(2)
    for scale in (2.0 ** 40, 2.0 ** 52):
        for values in (rng.uniform(-1, 1, params.slots), rng.uniform(-3e3, 3e3, 100), np.zeros(5)):
            spread = np.zeros(2 * n, complex)
            spread[[pow(3, i, 2 * n) for i in range(len(values))]] = values
            coeffs = np.fft.fft(spread).real[:n] * (2.0 * scale / n)
            bound = 2.0 * scale / n * np.abs(values).sum()
            assert np.abs(coeffs).max() <= bound * (1 + 1e-9) + 1
    assert not _fits_on_host(np.array([np.nan]), 2.0 ** 40, n)
    assert not _fits_on_host(np.full(4096, 1e9), 2.0 ** 50, n)
