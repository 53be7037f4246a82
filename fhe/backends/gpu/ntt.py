"""SEAL's negacyclic NTT over an RNS prime chain, in torch (the reference the Triton kernels follow).

SEAL's conventions (``util/ntt.cpp``): for each prime q the root is the *minimal* primitive 2N-th
root of unity psi; ``root_powers[bitrev(i)] = psi^i``; the forward transform is Harvey's
Cooley-Tukey loop on a standard-order input, leaving the output in bit-reversed order. We run the
same butterflies stage by stage (vectorised over blocks), so outputs land at SEAL's indices; the
inverse undoes each stage (Gentleman-Sande with psi^-i) and multiplies by N^-1 at the end. Results
are canonical residues, hence equal to SEAL's whatever its lazy reductions do inside.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fhe.backends.gpu.modarith import addmod, mulmod, submod


def _bitrev(i: int, bits: int) -> int:
    return int(format(i, f"0{bits}b")[::-1], 2) if bits else 0


def _factor(n: int) -> list[int]:
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return sorted(set(out + ([n] if n > 1 else [])))


def minimal_root(q: int, two_n: int) -> int:
    """SEAL's ``try_minimal_primitive_root``: the smallest primitive ``two_n``-th root of unity mod q."""
    cofactor = (q - 1) // two_n
    for x in range(2, q):
        g = pow(x, cofactor, q)
        if pow(g, two_n // 2, q) == q - 1:          # order exactly two_n (two_n is a power of 2)
            break
    else:                                            # pragma: no cover - q is an NTT prime
        raise ValueError(f"no primitive {two_n}-th root mod {q}")
    best, g2, cur = g, g * g % q, g
    for _ in range(two_n // 2 - 1):                  # the primitive roots are the odd powers of g
        cur = cur * g2 % q
        best = min(best, cur)
    return best


def _tables(q: int, n: int) -> tuple[list[int], list[int]]:
    """(root_powers, inv_root_powers) in SEAL's bit-reversed order for prime q."""
    psi = minimal_root(q, 2 * n)
    bits = n.bit_length() - 1
    pows = [1] * (2 * n)
    for k in range(1, 2 * n):
        pows[k] = pows[k - 1] * psi % q
    fwd, inv = [0] * n, [0] * n
    for i in range(n):
        fwd[_bitrev(i, bits)] = pows[i]
        inv[_bitrev(i, bits)] = pows[(2 * n - i) % (2 * n)]
    return fwd, inv


def shoup(values: list[int], q: int) -> np.ndarray:
    """Shoup's companions ``floor(w 2^64 / q)`` of twiddles ``w < q`` as int64 words (the uint64 bits): with
    them ``a w mod q`` is one 64-bit high product, two wrapping products and one correction (the Triton
    butterflies' :func:`fhe.backends.gpu.triton_ops._mulmod_shoup`), exact for q < 2^63."""
    return np.array([(w << 64) // q for w in values], dtype=np.uint64).view(np.int64)


@dataclass
class NTTTables:
    """Twiddles of several primes, stacked: ``[P, N]`` int64 (P primes, one row each), with their Shoup
    companions (:func:`shoup`), which the CUDA kernels multiply with."""

    primes: torch.Tensor        # [P, 1]
    roots: torch.Tensor         # [P, N]  psi^bitrev order
    inv_roots: torch.Tensor     # [P, N]
    n_inv: torch.Tensor         # [P, 1]  N^-1 mod q
    roots_shoup: torch.Tensor   # [P, N]  floor(root 2^64 / q), uint64 bits
    inv_roots_shoup: torch.Tensor  # [P, N]

    @classmethod
    def build(cls, primes: list[int], n: int, device: torch.device | str = "cpu") -> NTTTables:
        fwd, inv = zip(*(_tables(q, n) for q in primes), strict=True)
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        sh = lambda rows: torch.from_numpy(  # noqa: E731
            np.stack([shoup(r, q) for r, q in zip(rows, primes, strict=True)])).to(device)
        return cls(t(primes).view(-1, 1), t(list(fwd)), t(list(inv)),
                   t([pow(n, -1, q) for q in primes]).view(-1, 1), sh(fwd), sh(inv))

    def _fields(self) -> tuple[torch.Tensor, ...]:
        return (self.primes, self.roots, self.inv_roots, self.n_inv, self.roots_shoup, self.inv_roots_shoup)

    def take(self, rows: list[int] | slice) -> NTTTables:
        """The tables of a sub-chain (rows of the stacked tensors)."""
        return NTTTables(*(x[rows] for x in self._fields()))

    def to(self, device: torch.device | str) -> NTTTables:
        return NTTTables(*(x.to(device) for x in self._fields()))


def ntt(x: torch.Tensor, tab: NTTTables, inplace: bool = False, skip_diag: bool = False) -> torch.Tensor:
    """Forward negacyclic NTT of ``x [..., P, N]`` (coefficients mod each row's prime) -> SEAL's NTT form.
    ``inplace``: ``x`` is a temporary the caller drops, which the CUDA kernels may transform in place (with
    ``triton_ops.FEWER``); the torch reference ignores it. ``skip_diag`` (CUDA only, where
    ``triton_ops.skips_diag``): ``x [..., P - 1, P, N]``'s rows ``[J, J]`` are already in NTT form and stay."""
    *lead, p, n = x.shape
    assert tab.roots.shape == (p, n), (tab.roots.shape, x.shape)
    if x.is_cuda:
        from fhe.backends.gpu import triton_ops

        own = inplace and triton_ops.FEWER and x.is_contiguous()
        return triton_ops.ntt_(x if own else x.clone(memory_format=torch.contiguous_format), tab.roots,
                               tab.primes.view(-1),
                               inverse=False, roots_shoup=tab.roots_shoup, skip_diag=skip_diag)
    assert not skip_diag, "skip_diag: CUDA only"
    q = tab.primes.view(p, 1, 1)
    qf = q.to(torch.float64)
    m, gap = 1, n // 2
    while m < n:
        v = x.reshape(*lead, p, m, 2, gap)
        r = tab.roots[:, m:2 * m].reshape(p, m, 1)                   # [P, m, 1]
        u, t = v[..., 0, :], mulmod(v[..., 1, :], r, q, qf)
        x = torch.stack((addmod(u, t, q), submod(u, t, q)), dim=-2).reshape(*lead, p, n)
        m, gap = m * 2, gap // 2
    return x


def intt(x: torch.Tensor, tab: NTTTables) -> torch.Tensor:
    """Inverse of :func:`ntt`: SEAL's NTT form ``[..., P, N]`` -> coefficients."""
    *lead, p, n = x.shape
    assert tab.inv_roots.shape == (p, n), (tab.inv_roots.shape, x.shape)
    if x.is_cuda:
        from fhe.backends.gpu import triton_ops

        return triton_ops.ntt_(x.clone(memory_format=torch.contiguous_format), tab.inv_roots, tab.primes.view(-1),
                               inverse=True, n_inv=tab.n_inv.view(-1).contiguous(),
                               roots_shoup=tab.inv_roots_shoup)
    q = tab.primes.view(p, 1, 1)
    qf = q.to(torch.float64)
    m, gap = n // 2, 1
    while m >= 1:
        v = x.reshape(*lead, p, m, 2, gap)
        r = tab.inv_roots[:, m:2 * m].reshape(p, m, 1)
        a, b = v[..., 0, :], v[..., 1, :]
        x = torch.stack((addmod(a, b, q), mulmod(submod(a, b, q), r, q, qf)), dim=-2).reshape(*lead, p, n)
        m, gap = m // 2, gap * 2
    return mulmod(x, tab.n_inv, tab.primes)


__all__ = ["NTTTables", "intt", "minimal_root", "ntt"]
