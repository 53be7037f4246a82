"""The Triton kernel of SEAL's Blake2xb stream: BLAKE2Xb's output blocks, one per lane (issue 16).

The torch reference, the layout of the stream and the parameter blocks: :mod:`fhe.backends.gpu.blake2xb`. Each lane
compresses one 64-byte root ``H0`` (a refill's) under the output parameter block of node offset ``lane % 64``: the
state's 16 words are uint64 tensors in registers, rotations are shifts, the 12 rounds are unrolled with each round's
message words passed in its sigma order (message words 8..15 are zero: 64 bytes of ``H0`` in a 128-byte block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fhe.backends.gpu.blake2xb import _IV, BLOCKS_PER_REFILL, WORDS_PER_REFILL, out_param_words, signed

#: lanes (output blocks) per program
LANES = 128


@triton.jit
def _rotr64(x, n: tl.constexpr):
    return (x >> n) | (x << (64 - n))


@triton.jit
def _g(a, b, c, d, x, y):
    a = a + b + x
    d = _rotr64(d ^ a, 32)
    c = c + d
    b = _rotr64(b ^ c, 24)
    a = a + b + y
    d = _rotr64(d ^ a, 16)
    c = c + d
    b = _rotr64(b ^ c, 63)
    return a, b, c, d


@triton.jit
def _round(v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
           m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15):
    """One BLAKE2b round, the message words given in the round's sigma order."""
    v0, v4, v8, v12 = _g(v0, v4, v8, v12, m0, m1)
    v1, v5, v9, v13 = _g(v1, v5, v9, v13, m2, m3)
    v2, v6, v10, v14 = _g(v2, v6, v10, v14, m4, m5)
    v3, v7, v11, v15 = _g(v3, v7, v11, v15, m6, m7)
    v0, v5, v10, v15 = _g(v0, v5, v10, v15, m8, m9)
    v1, v6, v11, v12 = _g(v1, v6, v11, v12, m10, m11)
    v2, v7, v8, v13 = _g(v2, v7, v8, v13, m12, m13)
    v3, v4, v9, v14 = _g(v3, v4, v9, v14, m14, m15)
    return v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15


@triton.jit
def _iv(iv_ptr, k: tl.constexpr):
    return tl.load(iv_ptr + k).to(tl.uint64, bitcast=True)


@triton.jit
def _blake2xb_blocks(roots_ptr, iv_ptr, out_ptr, LANES_TOTAL, BPR: tl.constexpr, LANES: tl.constexpr):
    """Lane = one output block (refill ``lane // BPR``, node offset ``lane % BPR``): one BLAKE2b compression of
    that refill's root under the output parameter block; its 8 state words go to ``out[lane, 0:8]``."""
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    ok = lane < LANES_TOTAL
    base = (lane // BPR) * 8
    m0 = tl.load(roots_ptr + base + 0, mask=ok, other=0).to(tl.uint64, bitcast=True)
    m1 = tl.load(roots_ptr + base + 1, mask=ok, other=0).to(tl.uint64, bitcast=True)
    m2 = tl.load(roots_ptr + base + 2, mask=ok, other=0).to(tl.uint64, bitcast=True)
    m3 = tl.load(roots_ptr + base + 3, mask=ok, other=0).to(tl.uint64, bitcast=True)
    m4 = tl.load(roots_ptr + base + 4, mask=ok, other=0).to(tl.uint64, bitcast=True)
    m5 = tl.load(roots_ptr + base + 5, mask=ok, other=0).to(tl.uint64, bitcast=True)
    m6 = tl.load(roots_ptr + base + 6, mask=ok, other=0).to(tl.uint64, bitcast=True)
    m7 = tl.load(roots_ptr + base + 7, mask=ok, other=0).to(tl.uint64, bitcast=True)
    z = tl.zeros([LANES], dtype=tl.uint64)
    node = (lane % BPR).to(tl.uint64)
    h0 = z + _iv(iv_ptr, 8)                        # IV ^ the output parameter block (iv_ptr: see xof_blocks)
    h1 = (node | _iv(iv_ptr, 10)) ^ _iv(iv_ptr, 1)
    h2 = z + _iv(iv_ptr, 9)
    h3 = z + _iv(iv_ptr, 3)
    h4 = z + _iv(iv_ptr, 4)
    h5 = z + _iv(iv_ptr, 5)
    h6 = z + _iv(iv_ptr, 6)
    h7 = z + _iv(iv_ptr, 7)
    v0, v1, v2, v3, v4, v5, v6, v7 = h0, h1, h2, h3, h4, h5, h6, h7
    v8 = z + _iv(iv_ptr, 0)
    v9 = z + _iv(iv_ptr, 1)
    v10 = z + _iv(iv_ptr, 2)
    v11 = z + _iv(iv_ptr, 3)
    v12 = z + (_iv(iv_ptr, 4) ^ 64)                # t0 = 64 bytes
    v13 = z + _iv(iv_ptr, 5)
    v14 = ~(z + _iv(iv_ptr, 6))                    # f0 = ~0: the last block
    v15 = z + _iv(iv_ptr, 7)
    # the 12 rounds, message words in each round's sigma order (rounds 10 and 11 repeat sigma 0 and 1);
    # words 8..15 of the message are zero (64 bytes of H0 in a 128-byte block)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _round(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
        m0, m1, m2, m3, m4, m5, m6, m7, z, z, z, z, z, z, z, z)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _round(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
        z, z, m4, z, z, z, z, m6, m1, z, m0, m2, z, m7, m5, m3)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _round(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
        z, z, z, m0, m5, m2, z, z, z, z, m3, m6, m7, m1, z, m4)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _round(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
        m7, z, m3, m1, z, z, z, z, m2, m6, m5, z, m4, m0, z, z)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _round(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
        z, m0, m5, m7, m2, m4, z, z, z, m1, z, z, m6, z, m3, z)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _round(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
        m2, z, m6, z, m0, z, z, m3, m4, z, m7, m5, z, z, m1, z)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _round(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
        z, m5, m1, z, z, z, m4, z, m0, m7, m6, m3, z, m2, z, z)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _round(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
        z, z, m7, z, z, m1, m3, z, m5, m0, z, m4, z, m6, m2, z)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _round(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
        m6, z, z, z, z, m3, m0, z, z, m2, z, m7, m1, m4, z, m5)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _round(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
        z, m2, z, m4, m7, m6, m1, m5, z, z, z, z, m3, z, z, m0)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _round(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
        m0, m1, m2, m3, m4, m5, m6, m7, z, z, z, z, z, z, z, z)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _round(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
        z, z, m4, z, z, z, z, m6, m1, z, m0, m2, z, m7, m5, m3)
    o = out_ptr + lane * 8
    tl.store(o + 0, (h0 ^ v0 ^ v8).to(tl.int64, bitcast=True), mask=ok)
    tl.store(o + 1, (h1 ^ v1 ^ v9).to(tl.int64, bitcast=True), mask=ok)
    tl.store(o + 2, (h2 ^ v2 ^ v10).to(tl.int64, bitcast=True), mask=ok)
    tl.store(o + 3, (h3 ^ v3 ^ v11).to(tl.int64, bitcast=True), mask=ok)
    tl.store(o + 4, (h4 ^ v4 ^ v12).to(tl.int64, bitcast=True), mask=ok)
    tl.store(o + 5, (h5 ^ v5 ^ v13).to(tl.int64, bitcast=True), mask=ok)
    tl.store(o + 6, (h6 ^ v6 ^ v14).to(tl.int64, bitcast=True), mask=ok)
    tl.store(o + 7, (h7 ^ v7 ^ v15).to(tl.int64, bitcast=True), mask=ok)


_IV_CACHE: dict[torch.device, torch.Tensor] = {}


def xof_blocks(roots: torch.Tensor) -> torch.Tensor:
    """:func:`~fhe.backends.gpu.blake2xb.xof_blocks_torch` by the Triton kernel (CUDA tensors, or CPU ones under
    Triton's interpreter):
    roots int64 ``[R, 8]`` -> stream words int64 ``[R, 512]``."""
    assert roots.dtype == torch.int64 and roots.dim() == 2 and roots.shape[1] == 8 and roots.is_contiguous(), (
        roots.dtype, roots.shape)
    iv = _IV_CACHE.get(roots.device)
    if iv is None:
        p0, p2, xof = out_param_words()        # IV, then h0 and h2 of the parameter block, then xof_length << 32
        iv = _IV_CACHE[roots.device] = torch.tensor([signed(w) for w in (*_IV, _IV[0] ^ p0, _IV[2] ^ p2, xof)],
                                                    dtype=torch.int64, device=roots.device)
    r = roots.shape[0]
    out = torch.empty((r, WORDS_PER_REFILL), dtype=torch.int64, device=roots.device)
    lanes = r * BLOCKS_PER_REFILL
    _blake2xb_blocks[(triton.cdiv(lanes, LANES),)](roots, iv, out, lanes, BLOCKS_PER_REFILL, LANES=LANES)
    return out


__all__ = ["xof_blocks"]
