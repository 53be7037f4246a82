"""SEAL's Blake2xb PRNG stream on the device: the output blocks of BLAKE2Xb in a Triton kernel (issue 16).

SEAL 4's ``Blake2xbPRNG`` (the default PRNG of the SEAL that TenSEAL ships) fills a 4096-byte buffer per refill,
refill ``r`` (from 0) being ``blake2xb(out_len = 4096, input = r as a little-endian u64, key = the 64-byte seed)``;
its stream is the refills' buffers end to end. BLAKE2Xb (the BLAKE2X paper, the reference ``blake2xb.c``) is:

* ``H0`` = keyed BLAKE2b-512 of the input with the XOF parameter block (fanout 1, depth 1, ``xof_length`` 4096 in
  the high half of the 64-bit node-offset word): :func:`refill_roots`, on the host through :mod:`hashlib`, which
  expresses exactly this parameter block (one 64-byte root per 4096 bytes of stream);
* output block ``i`` (0..63) = unkeyed BLAKE2b of ``H0`` (one compression: 64 bytes, the last block) under the
  parameter block digest 64, key 0, fanout 0, depth 0, leaf length 64, node offset ``i``, ``xof_length`` 4096,
  inner length 64. hashlib refuses depth 0, so these run here: :func:`xof_blocks` (the Triton kernel on CUDA,
  one block per lane, its state in registers as uint64, rotations by shifts) and :func:`xof_blocks_torch`, the
  torch reference on int64 (logical right shifts masked) that the torch-CPU device runs and CI checks the
  kernel against under Triton's interpreter.

Each block's 64 bytes are its eight state words, little-endian: stream word ``64 r + 8 i + k`` (in u64 words) is
word ``k`` of block ``i`` of refill ``r``. Nothing here is secret: the seed travels in the clear in every seeded
ciphertext (it only derives the public c1).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
import triton
import triton.language as tl

#: SEAL's refill buffer (``UniformRandomGenerator::buffer_size_``) and the BLAKE2b block output
BUFFER_BYTES = 4096
BLOCK_BYTES = 64
BLOCKS_PER_REFILL = BUFFER_BYTES // BLOCK_BYTES
WORDS_PER_REFILL = BUFFER_BYTES // 8
SEED_BYTES = 64
#: lanes (output blocks) per program of the kernel
LANES = 128

_IV = (0x6A09E667F3BCC908, 0xBB67AE8584CAA73B, 0x3C6EF372FE94F82B, 0xA54FF53A5F1D36F1,
       0x510E527FADE682D1, 0x9B05688C2B3E6C1F, 0x1F83D9ABFB41BD6B, 0x5BE0CD19137E2179)
_SIGMA = ((0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
          (14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3),
          (11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4),
          (7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8),
          (9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13),
          (2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9),
          (12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11),
          (13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10),
          (6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5),
          (10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0))
_ROUNDS = 12
_M64 = (1 << 64) - 1


def _signed(u: int) -> int:
    """A u64 as the int64 with the same bits."""
    return u - (1 << 64) if u >> 63 else u


def _out_param_words() -> tuple[int, int, int]:
    """Words 0 and 2 of an output block's parameter block (word 1 is node offset | xof_length << 32; 3..7 zero):
    digest 64, key 0, fanout 0, depth 0, leaf length 64 | node depth 0, inner length 64."""
    return BLOCK_BYTES | (BLOCK_BYTES << 32), BLOCK_BYTES << 8, BUFFER_BYTES << 32


def refill_roots(seed: bytes, first: int, count: int) -> np.ndarray:
    """``H0`` of refills ``first .. first + count - 1`` of the PRNG seeded by ``seed`` -> uint64 ``[count, 8]``.

    hashlib's BLAKE2b parameter block: ``node_offset`` is the 64-bit word holding BLAKE2Xb's 32-bit node offset
    (0) and, above it, ``xof_length``."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a Blake2xb seed is {SEED_BYTES} bytes, got {len(seed)}")
    out = bytearray()
    for r in range(first, first + count):
        out += hashlib.blake2b(r.to_bytes(8, "little"), digest_size=64, key=seed, fanout=1, depth=1, leaf_size=0,
                               node_offset=BUFFER_BYTES << 32, node_depth=0, inner_size=0).digest()
    return np.frombuffer(bytes(out), dtype="<u8").reshape(count, 8)


# --- the torch reference ------------------------------------------------------------------------------------------
def _rotr(x: torch.Tensor, n: int) -> torch.Tensor:
    """64-bit rotation right of int64 words (torch's ``>>`` is arithmetic: the sign bits are masked off)."""
    return ((x >> n) & ((1 << (64 - n)) - 1)) | (x << (64 - n))


def _g_torch(v: list, a: int, b: int, c: int, d: int, x: torch.Tensor, y: torch.Tensor) -> None:
    v[a] = v[a] + v[b] + x
    v[d] = _rotr(v[d] ^ v[a], 32)
    v[c] = v[c] + v[d]
    v[b] = _rotr(v[b] ^ v[c], 24)
    v[a] = v[a] + v[b] + y
    v[d] = _rotr(v[d] ^ v[a], 16)
    v[c] = v[c] + v[d]
    v[b] = _rotr(v[b] ^ v[c], 63)


def xof_blocks_torch(roots: torch.Tensor) -> torch.Tensor:
    """The stream words of the refills whose roots are ``roots`` (int64 ``[R, 8]``, :func:`refill_roots`' bits)
    -> int64 ``[R, 512]`` (the buffers, in u64 words): every output block of every refill at once, one lane each."""
    assert roots.dtype == torch.int64 and roots.dim() == 2 and roots.shape[1] == 8, (roots.dtype, roots.shape)
    r = roots.shape[0]
    lanes = r * BLOCKS_PER_REFILL
    m = [w.repeat_interleave(BLOCKS_PER_REFILL) for w in roots.t()]            # 8 x [lanes]: H0 of each lane
    zero = torch.zeros(lanes, dtype=torch.int64, device=roots.device)
    m += [zero] * 8
    p0, p2, xof = _out_param_words()
    node = torch.arange(BLOCKS_PER_REFILL, dtype=torch.int64, device=roots.device).repeat(r)
    h = [torch.full_like(zero, _signed(_IV[0] ^ p0)), (node | xof) ^ _signed(_IV[1]),
         torch.full_like(zero, _signed(_IV[2] ^ p2))] + [torch.full_like(zero, _signed(w)) for w in _IV[3:]]
    v = list(h) + [torch.full_like(zero, _signed(w)) for w in _IV]
    v[12] = v[12] ^ BLOCK_BYTES                                               # t0: 64 bytes hashed
    v[14] = v[14] ^ -1                                                        # f0: the last block
    for rnd in range(_ROUNDS):
        s = _SIGMA[rnd % 10]
        for j, (a, b, c, d) in enumerate(((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15),
                                          (0, 5, 10, 15), (1, 6, 11, 12), (2, 7, 8, 13), (3, 4, 9, 14))):
            _g_torch(v, a, b, c, d, m[s[2 * j]], m[s[2 * j + 1]])
    out = torch.stack([h[k] ^ v[k] ^ v[k + 8] for k in range(8)], dim=1)    # [lanes, 8]
    return out.reshape(r, WORDS_PER_REFILL)


# --- the Triton kernel ---------------------------------------------------------------------------------------------
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
def _blake2xb_blocks(roots_ptr, iv_ptr, out_ptr, LANES_TOTAL, BPR: tl.constexpr, P0, P2, XOF,
                     LANES: tl.constexpr):
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
    h0 = z + (_iv(iv_ptr, 0) ^ P0.to(tl.uint64, bitcast=True))
    h1 = (node | XOF.to(tl.uint64, bitcast=True)) ^ _iv(iv_ptr, 1)
    h2 = z + (_iv(iv_ptr, 2) ^ P2.to(tl.uint64, bitcast=True))
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
    """:func:`xof_blocks_torch` by the Triton kernel (CUDA tensors, or CPU ones under Triton's interpreter):
    roots int64 ``[R, 8]`` -> stream words int64 ``[R, 512]``."""
    assert roots.dtype == torch.int64 and roots.dim() == 2 and roots.shape[1] == 8 and roots.is_contiguous(), (
        roots.dtype, roots.shape)
    iv = _IV_CACHE.get(roots.device)
    if iv is None:
        iv = _IV_CACHE[roots.device] = torch.tensor([_signed(w) for w in _IV], dtype=torch.int64,
                                                    device=roots.device)
    r = roots.shape[0]
    out = torch.empty((r, WORDS_PER_REFILL), dtype=torch.int64, device=roots.device)
    lanes = r * BLOCKS_PER_REFILL
    p0, p2, xof = _out_param_words()
    _blake2xb_blocks[(triton.cdiv(lanes, LANES),)](roots, iv, out, lanes, BLOCKS_PER_REFILL, _signed(p0),
                                                   _signed(p2), _signed(xof), LANES=LANES)
    return out


def stream_words(seed: bytes, first_refill: int, refills: int, device: torch.device | str) -> torch.Tensor:
    """Words ``512 first_refill ..`` of the stream of ``seed``, ``refills`` buffers of them -> int64 ``[refills * 512]``
    on ``device`` (the roots on the host, the blocks on the device: the Triton kernel on CUDA, the torch reference
    elsewhere)."""
    roots = torch.from_numpy(refill_roots(seed, first_refill, refills).view(np.int64).copy()).to(device)
    blocks = xof_blocks(roots) if roots.device.type == "cuda" else xof_blocks_torch(roots)
    return blocks.reshape(-1)


__all__ = ["BUFFER_BYTES", "SEED_BYTES", "refill_roots", "stream_words", "xof_blocks", "xof_blocks_torch"]
