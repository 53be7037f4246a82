"""Galois automorphisms in SEAL's NTT form: a permutation of the N evaluation slots.

SEAL (``GaloisTool::generate_table_ntt``): for i in [N, 2N), r = bitrev_{logN+1}(i),
idx = ((g * r) >> 1) mod N, table[i - N] = bitrev_{logN}(idx); then ``out[i] = in[table[i]]``.
"""

from __future__ import annotations

import torch


def _bitrev_vec(x: torch.Tensor, bits: int) -> torch.Tensor:
    out = torch.zeros_like(x)
    for b in range(bits):
        out |= ((x >> b) & 1) << (bits - 1 - b)
    return out


def ntt_permutation(galois_elt: int, n: int) -> torch.Tensor:
    """[N] int64 index table of sigma_g in NTT form (``out = in[..., table]``)."""
    logn = n.bit_length() - 1
    rev = _bitrev_vec(torch.arange(n, 2 * n, dtype=torch.int64), logn + 1)
    idx = ((galois_elt * rev) >> 1) & (n - 1)
    return _bitrev_vec(idx, logn)


def galois_elt(step: int, slots: int) -> int:
    """SEAL's Galois element of a left rotation by ``step`` slots: 3^step mod 2N."""
    return pow(3, step % slots, 4 * slots)


__all__ = ["galois_elt", "ntt_permutation"]
