"""SEAL's ``sample_poly_uniform`` on the device: the c1 of a seeded ciphertext from its seed, bit for bit (issue 16).

A seeded upload (SEAL's symmetric encryption saved with its seed) carries c0 and the 64-byte seed of the PRNG
that drew c1. SEAL 4's load expands it with ``sample_poly_uniform(prng, parms, c1)``:

1. one bulk fill: the first ``L * N`` u64 words of the stream, prime after prime (``[L][N]``);
2. prime by prime, coefficient by coefficient, a word ``>= max_multiple_j = (2^64 - 1) - ((2^64 - 1) mod q_j) - 1``
   is rejected and replaced by the *next* word of the stream (after the bulk, in order, shared by all primes),
   itself tested against the same bound until one passes;
3. each kept word reduced mod ``q_j`` (SEAL's ``barrett_reduce_64``: the exact remainder).

Here the stream comes from :func:`fhe.backends.gpu.blake2xb.stream_words` (the Triton kernel on CUDA) and the
rejections are resolved at once per prime with a running cursor kept on the device (masks, cumsums, a sorted
search: no host synchronization per coefficient; one per ciphertext, to learn whether the extra words drawn
sufficed, which they do but with negligible probability, and then more are drawn). At 60-bit primes about one
word in 16 is rejected.
"""

from __future__ import annotations

import math

import torch

from fhe.backends.gpu.blake2xb import WORDS_PER_REFILL, stream_words

_MIN = -(1 << 63)
_LOW63 = (1 << 63) - 1
_M64 = (1 << 64) - 1


def max_multiple(q: int) -> int:
    """SEAL's rejection bound for prime ``q``: words ``>= this`` are redrawn."""
    return _M64 - (_M64 % q) - 1


def _flip(u: int) -> int:
    """The int64 whose signed order is the unsigned order of the u64 ``u`` (sign bit flipped)."""
    return u - (1 << 63)


def _extra_words(primes: list[int], n: int) -> int:
    """Stream words to draw after the bulk: the expected replacements, with a margin of ~8 sigma."""
    mean = sum(n * ((1 << 64) - max_multiple(q)) / float(1 << 64) for q in primes)
    mean = mean / (1 - max(((1 << 64) - max_multiple(q)) / float(1 << 64) for q in primes))
    return int(mean * 1.1 + 8 * math.sqrt(mean) + 256)


def _reduce(v: torch.Tensor, q: int) -> torch.Tensor:
    """``v mod q`` for int64 ``v`` read as u64 (q < 2^62): the low 63 bits' remainder plus 2^63 mod q where the
    top bit is set."""
    r = (v & _LOW63) % q + (v < 0).to(torch.int64) * ((1 << 63) % q)
    return torch.where(r >= q, r - q, r)


def _resolve(bulk: torch.Tensor, extra: torch.Tensor, primes: list[int], out: torch.Tensor) -> torch.Tensor:
    """Fill ``out [L, N]`` from the bulk words ``bulk [L, N]`` and the words after them ``extra [E]`` (int64 bits
    of u64 words) as SEAL's loop does; returns whether ``extra`` sufficed (a 0-dim bool tensor on the device)."""
    ef = extra ^ _MIN                                            # unsigned order as signed order
    cursor = torch.zeros(1, dtype=torch.int64, device=bulk.device)
    enough = torch.ones((), dtype=torch.bool, device=bulk.device)
    zero = torch.zeros(1, dtype=torch.int64, device=bulk.device)
    for j, q in enumerate(primes):
        bound = _flip(max_multiple(q))
        rej = (bulk[j] ^ _MIN) >= bound                         # [N]: words SEAL redraws
        cum = torch.cumsum(ef < bound, 0)                       # [E]: extra words kept for this prime, so far
        base = torch.cat([zero, cum]).index_select(0, cursor)   # kept words before the cursor
        rank = torch.cumsum(rej, 0)                             # k-th rejection -> the k-th kept word after it
        nrej = rank[-1:]
        idx = torch.searchsorted(cum, base + rank).clamp_(max=extra.numel() - 1)
        out[j] = _reduce(torch.where(rej, extra[idx], bulk[j]), q)
        enough &= (base + nrej <= cum[-1:]).squeeze(0)
        last = torch.searchsorted(cum, base + nrej) + 1
        cursor = torch.where(nrej > 0, last, cursor)
    return enough


def sample_poly_uniform(seed: bytes, primes: list[int], n: int, out: torch.Tensor) -> torch.Tensor:
    """c1 of the seeded ciphertext whose Blake2xb seed is ``seed``, at ``primes`` (the ciphertext's, in order) and
    ring degree ``n``, written into ``out`` (int64 ``[L, N]`` on the device; returned): SEAL 4's
    ``sample_poly_uniform``, the same residues."""
    lev = len(primes)
    assert out.shape == (lev, n) and out.dtype == torch.int64, (out.shape, out.dtype)
    bulk_refills = -(-lev * n // WORDS_PER_REFILL)
    extra_refills = -(-_extra_words(primes, n) // WORDS_PER_REFILL)
    words = stream_words(seed, 0, bulk_refills + extra_refills, out.device)
    while True:
        bulk = words[:lev * n].view(lev, n)
        if bool(_resolve(bulk, words[lev * n:], primes, out)):  # the one host synchronization
            return out
        more = max(extra_refills, 1)
        words = torch.cat([words, stream_words(seed, words.numel() // WORDS_PER_REFILL, more, out.device)])


__all__ = ["max_multiple", "sample_poly_uniform"]
