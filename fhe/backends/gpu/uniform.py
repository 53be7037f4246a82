"""SEAL's ``sample_poly_uniform`` on the device: the c1 of a seeded ciphertext from its seed, bit for bit (issue 16).

A seeded upload (SEAL's symmetric encryption saved with its seed) carries c0 and the 64-byte seed of the PRNG
that drew c1. SEAL 4's load expands it with ``sample_poly_uniform(prng, parms, c1)``:

1. one bulk fill: the first ``L * N`` u64 words of the stream, prime after prime (``[L][N]``);
2. prime by prime, coefficient by coefficient, a word ``>= max_multiple_j = (2^64 - 1) - ((2^64 - 1) mod q_j) - 1``
   is rejected and replaced by the *next* word of the stream (after the bulk, in order, shared by all primes),
   itself tested against the same bound until one passes;
3. each kept word reduced mod ``q_j`` (SEAL's ``barrett_reduce_64``: the exact remainder).

Here the stream comes from :func:`fhe.backends.gpu.blake2xb.stream_words` (the Triton kernel on CUDA) and the
rejections are resolved for all primes at once on the device (masks, cumsums, a batched sorted search: no host
synchronization per coefficient; one per ciphertext, which brings the per-prime counts to the host to walk the
cursor chain and learn whether the extra words drawn sufficed; they do but with negligible probability, and then
more are drawn). SEAL's own primes (just below a power of two) reject about one word in 10^13; a prime far from
one can reject up to one in 16.
"""

from __future__ import annotations

import math

import numpy as np
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


def _reduce(v: torch.Tensor, q: torch.Tensor, two63: torch.Tensor) -> torch.Tensor:
    """``v mod q`` for int64 ``v`` read as u64 (q < 2^62, per row: ``q``, ``two63 = 2^63 mod q`` of shape [L, 1]):
    the low 63 bits' remainder plus 2^63 mod q where the top bit is set."""
    r = (v & _LOW63) % q + (v < 0).to(torch.int64) * two63
    return torch.where(r >= q, r - q, r)


def _resolve(bulk: torch.Tensor, extra: torch.Tensor, primes: list[int], out: torch.Tensor) -> bool:
    """Fill ``out [L, N]`` from the bulk words ``bulk [L, N]`` and the words after them ``extra [E]`` (int64 bits
    of u64 words) as SEAL's loop does; False (``out`` unfinished) where ``extra`` does not hold enough kept words.

    Every prime at once on the device: which bulk words SEAL redraws, the k-th redraw's rank, which extra words
    each prime keeps and their running count. Only the cursor into ``extra`` is a chain (prime j starts where
    prime j - 1's last replacement was taken): it is walked on the host over the small ``[L, E]`` counts, in the
    one synchronization (one transfer of a few kB), then the replacements are gathered on the device."""
    dev, lev = bulk.device, len(primes)
    bounds = torch.tensor([_flip(max_multiple(q)) for q in primes], dtype=torch.int64, device=dev).view(lev, 1)
    rej = (bulk ^ _MIN) >= bounds                                     # [L, N]: words SEAL redraws
    rank = torch.cumsum(rej, 1)                                       # [L, N]: k-th redraw of its prime
    cum = torch.cumsum((extra ^ _MIN).view(1, -1) < bounds, 1)        # [L, E]: extra words kept, so far
    counts = torch.cat([rank[:, -1:], cum], 1).cpu().numpy()          # the one synchronization
    base = np.zeros(lev, dtype=np.int64)
    cursor = 0
    for j in range(lev):
        nrej, kept = int(counts[j, 0]), counts[j, 1:]
        base[j] = kept[cursor - 1] if cursor else 0                   # kept words before the cursor
        if nrej:
            if base[j] + nrej > kept[-1]:
                return False
            cursor = int(np.searchsorted(kept, base[j] + nrej)) + 1   # past the last word this prime took
    idx = torch.searchsorted(cum, torch.from_numpy(base).to(dev).view(lev, 1) + rank).clamp_(max=extra.numel() - 1)
    q = torch.tensor(primes, dtype=torch.int64, device=dev).view(lev, 1)
    two63 = torch.tensor([(1 << 63) % p for p in primes], dtype=torch.int64, device=dev).view(lev, 1)
    out.copy_(_reduce(torch.where(rej, extra[idx], bulk), q, two63))
    return True


def sample_poly_uniform(seed: bytes, primes: list[int], n: int, out: torch.Tensor) -> torch.Tensor:
    """c1 of the seeded ciphertext whose Blake2xb seed is ``seed``, at ``primes`` (the ciphertext's, in order) and
    ring degree ``n``, written into ``out`` (int64 ``[L, N]`` on the device; returned): SEAL 4's
    ``sample_poly_uniform``, the same residues."""
    lev = len(primes)
    assert out.shape == (lev, n) and out.dtype == torch.int64, (out.shape, out.dtype)
    bulk_refills = -(-lev * n // WORDS_PER_REFILL)
    extra_refills = max(1, -(-_extra_words(primes, n) // WORDS_PER_REFILL))
    words = stream_words(seed, 0, bulk_refills + extra_refills, out.device)
    while True:
        bulk = words[:lev * n].view(lev, n)
        if _resolve(bulk, words[lev * n:], primes, out):
            return out
        words = torch.cat([words, stream_words(seed, words.numel() // WORDS_PER_REFILL, extra_refills, out.device)])


__all__ = ["max_multiple", "sample_poly_uniform"]
