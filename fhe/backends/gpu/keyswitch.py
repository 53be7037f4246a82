"""SEAL's key switching (``Evaluator::switch_key_inplace``) and hoisted rotations on top of it.

Key switching a polynomial ``t`` (NTT form, L data primes) with a key of K decomposition components:

1. digits: d_J = INTT_J(t_J) in [0, q_J) for J < L (SEAL's representatives);
2. each digit reduced into all L+1 primes (data + special) and NTT'd there: D[J, i];
3. acc_k[i] = sum_J D[J, i] * key[J]_k[i] mod q_i for the key's two polynomials k;
4. the special prime is divided out with rounding (:func:`drop_last_rounded`).

Hoisting (several Galois elements of one input): steps 1-2 run once on c1. A Galois automorphism is a
slot permutation in NTT form but a *signed* permutation of coefficients, and SEAL's digit of a negated
coefficient is q_J - d, not -d: permuting the hoisted digits misses ``q_J`` at every negated position.
We add it back exactly: ``sum_J q_J key[J]`` times the NTT of the negated positions' indicator (both
cached per step and level), valid when no digit coefficient is 0 (else -0 = 0 needs no fix and we fall
back to the plain path; probability ~ N L / 2^50). The result is bit-identical to rotating one by one.
"""

from __future__ import annotations

import torch

from fhe.backends.gpu.modarith import addmod, mulmod
from fhe.backends.gpu.rns import LevelTables, drop_last_rounded, intt, ntt, summod

#: A hoisted rotation's correction added inside the inner product's kernel (its sum starts from it) instead of by a
#: launch after (issue 16, session 20; and, always since, a batch's inner products are written into one tensor
#: instead of stacked after): a launch and two passes over [2, L+1, N] less per hoisted step. The same residues.
#: False: the addition after, as before. Not isolated on CUDA: a decode step has no hoisted rotations (its 435
#: additions and 148 stacks were unchanged in session 20's profile); it serves ``rotate_many`` (the matmul's babies, the
#: packed prefill), whose residues the CUDA tests compare with SEAL with it on.
FUSED_CORRECTION = True


def expand(d: torch.Tensor, t: torch.Tensor, lt: LevelTables) -> torch.Tensor:
    """Digits ``d [..., L, N]`` (``intt`` of ``t [..., L, N]``) -> ``D [..., L, L+1, N]``: each reduced into every ext
    prime, NTT form. On CUDA (``triton_ops.SKIP_DIAG``) the rows ``D[J, J]`` are ``t[J]`` itself, as in SEAL, and
    only the others are transformed: the same residues."""
    if d.is_cuda:
        from fhe.backends.gpu import triton_ops

        if triton_ops.skips_diag(d.shape[-1]):
            primes = lt.ext.primes.view(-1).contiguous()
            out = triton_ops.expand_digits(d.contiguous(), t.contiguous(), primes)
            return ntt(out, lt.ext, inplace=True, skip_diag=True)
    return ntt(torch.remainder(d.unsqueeze(-2), lt.ext.primes), lt.ext, inplace=True)


def decompose(t: torch.Tensor, lt: LevelTables) -> tuple[torch.Tensor, torch.Tensor]:
    """``t [L, N]`` NTT form -> (digits d [L, N] coefficient form, D [L, L+1, N] NTT form in every prime)."""
    d = intt(t, lt.data)                                              # [L, N] in [0, q_J)
    return d, expand(d, t, lt)


def inner_product(D: torch.Tensor, key: torch.Tensor, lt: LevelTables, out: torch.Tensor | None = None) -> torch.Tensor:
    """acc [2, L+1, N] = sum_J D[J] * key[J] over the ext rows; ``key [K, 2, K+1, N]`` (all rows). ``out``: a
    contiguous ``[2, L+1, N]`` to write it to (a batch's row, instead of a stack after)."""
    lev = D.shape[0]
    q = lt.ext.primes
    if D.is_cuda:
        from fhe.backends.gpu import triton_ops

        return triton_ops.inner_product(D.contiguous(), key, q.view(-1).contiguous(), out=out)
    data = mulmod(D[:, None, :lev], key[:lev, :, :lev], q[:lev], None)        # [L, 2, L, N]
    spec = mulmod(D[:, None, lev:], key[:lev, :, -1:], q[lev:], None)          # [L, 2, 1, N]
    acc = torch.cat((summod(data, q[:lev]), summod(spec, q[lev:])), dim=1)
    return acc if out is None else out.copy_(acc)


def finish(acc: torch.Tensor, lt: LevelTables) -> torch.Tensor:
    """Divide the special prime out of ``acc [2, L+1, N]`` with rounding -> [2, L, N]."""
    return drop_last_rounded(acc, lt.data, lt.special, lt.inv_p, lt.q_ext_ints[-1])


def switch_key(t: torch.Tensor, key: torch.Tensor, lt: LevelTables) -> torch.Tensor:
    """Key switch ``t [L, N]`` (NTT form) with ``key`` -> the pair [2, L, N] to add to (c0, c1)."""
    _, D = decompose(t, lt)
    return finish(inner_product(D, key, lt), lt)


def negated_positions(galois_elt: int, n: int) -> torch.Tensor:
    """[N] 0/1 indicator of the coefficients x^k that sigma_g fills with a negated source coefficient."""
    k = (torch.arange(n, dtype=torch.int64) * galois_elt) % (2 * n)
    out = torch.zeros(n, dtype=torch.int64)
    out[k[k >= n] - n] = 1
    return out


def hoisted_correction(key: torch.Tensor, neg: torch.Tensor, lt: LevelTables) -> torch.Tensor:
    """[2, L+1, N]: NTT_i(indicator) * sum_J (q_J mod q_i) key[J]_k[i] (see the module docstring)."""
    lev = len(lt.q_ext_ints) - 1
    q = lt.ext.primes
    qj = torch.tensor([[qJ % qi for qi in lt.q_ext_ints] for qJ in lt.q_ext_ints[:lev]],
                      dtype=torch.int64, device=key.device)                    # [L, L+1]
    rows = torch.cat((key[:lev, :, :lev], key[:lev, :, -1:]), dim=2)          # [L, 2, L+1, N]
    weighted = summod(mulmod(rows, qj[:, None, :, None], q, None), q)          # [2, L+1, N]
    ind = ntt(neg.to(key.device).expand(lev + 1, -1).contiguous(), lt.ext)    # [L+1, N]
    return mulmod(weighted, ind, q)


def hoisted_inner(D: torch.Tensor, perm: torch.Tensor, key: torch.Tensor, corr: torch.Tensor,
                  lt: LevelTables, out: torch.Tensor | None = None) -> torch.Tensor:
    """The inner product of sigma(c1)'s key switch from c1's hoisted digits ``D``: permute, multiply, add
    the fix -> acc [2, L+1, N] (what :func:`finish` takes); ``out``: as :func:`inner_product`'s. On CUDA the fix
    is the sum's starting value (one kernel, the same residues)."""
    if D.is_cuda:
        from fhe.backends.gpu import triton_ops

        primes = lt.ext.primes.view(-1).contiguous()
        if FUSED_CORRECTION:
            return triton_ops.inner_product(D, key, primes, perm, add=corr.contiguous(), out=out)
        acc = triton_ops.inner_product(D, key, primes, perm)
    else:
        acc = inner_product(D[..., perm], key, lt)
    acc = addmod(acc, corr, lt.ext.primes)
    return acc if out is None else out.copy_(acc)


def hoisted_switch(D: torch.Tensor, perm: torch.Tensor, key: torch.Tensor, corr: torch.Tensor,
                   lt: LevelTables) -> torch.Tensor:
    """Key switch of sigma(c1) from c1's hoisted digits ``D``: :func:`hoisted_inner`, then finish."""
    return finish(hoisted_inner(D, perm, key, corr, lt), lt)


__all__ = ["decompose", "expand", "finish", "hoisted_correction", "hoisted_inner", "hoisted_switch", "inner_product",
           "negated_positions", "switch_key"]
