"""The RNS view of one CKKS parameter set: SEAL's prime chain, NTT tables and per-level constants.

Rows of every table follow SEAL's key chain: data primes q_0 .. q_{K-1} (K = ``params.depth + 1``)
then the special prime P (row K). A ciphertext at level L uses rows 0..L-1; key switching at level L
works over rows 0..L-1 plus row K.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from functools import cached_property

import torch

from fhe.backends.gpu.modarith import addmod, mulmod, reduce, submod
from fhe.backends.gpu.ntt import NTTTables, intt, ntt
from fhe.backends.seal.hazmat import Kit


@dataclass
class RNSContext:
    """Prime chain, tables and constants on one torch device (built from SEAL's own context)."""

    kit: Kit
    device: torch.device
    tables: NTTTables = field(init=False)       # all K+1 rows
    parms_ids: dict[int, bytes] = field(init=False)

    def __post_init__(self) -> None:
        key_chain = [m.value() for m in self.kit.context.key_context_data().parms().coeff_modulus()]
        self.primes = key_chain                              # K data primes + the special prime
        self.K = len(key_chain) - 1
        self.n = self.kit.params.poly_modulus_degree
        self.tables = NTTTables.build(key_chain, self.n, self.device)
        self.parms_ids = {lev: struct.pack("<4Q", *pid) for lev, pid in self.kit.parms_ids.items()}
        self._levels: dict[int, LevelTables] = {}

    def level(self, lev: int) -> LevelTables:
        """Tables and constants of level ``lev`` (cached)."""
        if lev not in self._levels:
            self._levels[lev] = LevelTables.build(self, lev)
        return self._levels[lev]

    @cached_property
    def q(self) -> torch.Tensor:
        """[K+1, 1] primes."""
        return self.tables.primes


@dataclass
class LevelTables:
    """What rescale and key switching need at one level L."""

    data: NTTTables          # rows 0..L-1
    ext: NTTTables           # rows 0..L-1 and the special prime
    last: NTTTables          # row L-1 alone (rescale)
    special: NTTTables       # row K alone
    inv_qlast: torch.Tensor  # [L-1, 1] q_{L-1}^-1 mod q_i
    inv_p: torch.Tensor      # [L, 1]   P^-1 mod q_i
    q_ext_ints: list[int]    # the L+1 primes as Python ints

    @classmethod
    def build(cls, ctx: RNSContext, lev: int) -> LevelTables:
        rows = list(range(lev)) + [ctx.K]
        ints = [ctx.primes[r] for r in rows]
        t = lambda v: torch.tensor(v, dtype=torch.int64, device=ctx.device).view(-1, 1)  # noqa: E731
        return cls(ctx.tables.take(slice(0, lev)), ctx.tables.take(rows), ctx.tables.take(slice(lev - 1, lev)),
                   ctx.tables.take(slice(ctx.K, ctx.K + 1)),
                   t([pow(ints[lev - 1], -1, q) for q in ints[:lev - 1]]),
                   t([pow(ints[lev], -1, q) for q in ints[:lev]]), ints)


def drop_last_rounded(x: torch.Tensor, keep: NTTTables, last: NTTTables, inv_last: torch.Tensor,
                      q_last: int | None = None) -> torch.Tensor:
    """SEAL's ``divide_and_round_q_last_ntt``: ``x [..., R+1, N]`` (NTT form over ``keep`` rows then the
    ``last`` row) -> ``round(x / q_last)`` over the ``keep`` rows, NTT form.

    The last row goes to coefficients, gets q_last//2 added (floor -> round), is reduced into each kept
    prime, has the same half subtracted there, goes back to NTT form and is subtracted; the difference is
    multiplied by q_last^-1. ``q_last`` (the last prime as an int) spares a device read, which a CUDA
    graph capture cannot do.
    """
    ql = int(last.primes[0, 0]) if q_last is None else q_last
    half = ql >> 1
    tail = intt(x[..., -1:, :], last)                                   # [..., 1, N]
    if x.is_cuda:
        from fhe.backends.gpu import triton_ops

        primes = keep.primes.view(-1).contiguous()
        if triton_ops.fuses_finish(x.shape[-1]):                        # the same steps in the NTT's 2 kernels
            return triton_ops.rounded_ntt_sub_scale(x.contiguous(), tail.contiguous(), keep.roots, keep.roots_shoup,
                                                    primes, inv_last.view(-1).contiguous(), ql)
        if triton_ops.FUSED:                                            # the same steps, 2 kernels + the NTT
            temp = ntt(triton_ops.round_tail(tail.contiguous(), primes, ql), keep, inplace=True)
            return triton_ops.sub_scale(x.contiguous(), temp, inv_last.view(-1).contiguous(), primes)
    tail = addmod(tail, torch.full_like(tail, half), last.primes)
    q = keep.primes                                                     # [R, 1]
    temp = reduce(tail, q)                                              # [..., R, N]
    fix = torch.remainder(torch.full_like(q, half), q)
    temp = submod(temp, fix, q)
    temp = ntt(temp, keep)
    return mulmod(submod(x[..., :-1, :], temp, q), inv_last, q)


def summod(x: torch.Tensor, q: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Sum of residues (< 2^60) along ``dim`` mod q, in chunks of 7 so int64 never overflows."""
    parts = [torch.remainder(c.sum(dim), q) for c in torch.split(x, 7, dim=dim)]
    out = parts[0]
    for p in parts[1:]:
        out = addmod(out, p, q)
    return out


__all__ = ["LevelTables", "RNSContext", "drop_last_rounded", "intt", "ntt", "summod"]
