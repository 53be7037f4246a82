"""Exact modular arithmetic on int64 torch tensors for SEAL's primes (up to 61 bits).

A product of two 60-bit residues needs 120 bits, and torch has no 128-bit integers nor a
``mulhi``. We split one factor into 30-bit halves: a 60 x 30-bit product is < 2^91, whose quotient
by q (< 2^31) a float64 estimates to within 1, so ``a*s - est*q`` computed in *wrapping* int64 is the
exact remainder up to one correction each way. A full ``mulmod`` is one such product (a * b_hi) and one
more estimate of (that * 2^30 + a * b_lo), which is < q * 2^31 too.
Every result is the canonical residue in [0, q), so any two correct implementations (SEAL's lazy
Harvey/Barrett arithmetic, this one, the Triton kernels) agree bit for bit.

All functions broadcast: ``q`` is typically ``[L, 1]`` against data ``[..., L, N]``.
"""

from __future__ import annotations

import torch

_LO = (1 << 30) - 1
_TWO30 = float(1 << 30)


def _mulmod_small(a: torch.Tensor, s: torch.Tensor, q: torch.Tensor, qf: torch.Tensor) -> torch.Tensor:
    """a * s mod q for a in [0, q), 0 <= s < 2^31, q < 2^61 (exact; see the module docstring)."""
    est = torch.floor(a.to(torch.float64) * s.to(torch.float64) / qf).to(torch.int64)
    r = a * s - est * q                          # wraps mod 2^64; the true value lies in [-q, 2q)
    r = torch.where(r < 0, r + q, r)
    return torch.where(r >= q, r - q, r)


def mulmod(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor, qf: torch.Tensor | None = None) -> torch.Tensor:
    """a * b mod q for residues a, b in [0, q) (any broadcastable shapes)."""
    if a.is_cuda and q.dim() == 2 and q.shape[1] == 1:
        return _mulmod_cuda(a, b, q)
    if qf is None:
        qf = q.to(torch.float64)
    hi = _mulmod_small(a, b >> 30, q, qf)                     # a * b_hi mod q
    lo = b & _LO
    # hi * 2^30 + a * b_lo < q * 2^31 whatever q's size, so its quotient's float estimate is within 1
    est = torch.floor((hi.to(torch.float64) * _TWO30 + a.to(torch.float64) * lo.to(torch.float64)) / qf)
    r = hi * (1 << 30) + a * lo - est.to(torch.int64) * q     # wraps mod 2^64; true value in [-q, 2q)
    r = torch.where(r < 0, r + q, r)
    return torch.where(r >= q, r - q, r)


def _mulmod_cuda(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The Triton kernel over rows ``[..., P, N]`` (``q [P, 1]``); b broadcast to a's shape if needed."""
    from fhe.backends.gpu import triton_ops

    shape = torch.broadcast_shapes(a.shape, b.shape)
    if shape[-2] != q.shape[0]:
        raise ValueError(f"primes {tuple(q.shape)} do not match data {tuple(shape)}")
    a = a.expand(shape).contiguous()
    if b.dim() == 2 and b.shape[1] == 1 and b.shape[0] == q.shape[0]:
        return triton_ops.mulmod_rows(a, b.reshape(-1).contiguous(), q.reshape(-1).contiguous())
    return triton_ops.mulmod_rows(a, b.expand(shape).contiguous(), q.reshape(-1).contiguous())


def _addsub_cuda(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor, sub: bool) -> torch.Tensor | None:
    """One Triton launch for same-shape operands ``[..., P, N]`` and ``q [P, 1]`` (None: use torch)."""
    if not (a.is_cuda and q.dim() == 2 and q.shape[1] == 1 and a.dim() >= 2 and q.shape[0] == a.shape[-2]):
        return None
    from fhe.backends.gpu import triton_ops

    return triton_ops.addsub_rows(a, b, q.view(-1), sub) if triton_ops.FUSED else None


def addmod(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """a + b mod q for residues in [0, q) (q < 2^62, so the sum cannot overflow)."""
    fast = _addsub_cuda(a, b, q, False)
    if fast is not None:
        return fast
    s = a + b
    return torch.where(s >= q, s - q, s)


def submod(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """a - b mod q for residues in [0, q)."""
    fast = _addsub_cuda(a, b, q, True)
    if fast is not None:
        return fast
    d = a - b
    return torch.where(d < 0, d + q, d)


def reduce(a: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """a mod q for any non-negative int64 a (torch's remainder is exact on integers)."""
    return torch.remainder(a, q)


__all__ = ["addmod", "mulmod", "reduce", "submod"]
