"""SEAL's Blake2xb PRNG stream on the device: the output blocks of BLAKE2Xb in a Triton kernel (issue 16).

SEAL 4's ``Blake2xbPRNG`` (the default PRNG of the SEAL that TenSEAL ships) fills a 4096-byte buffer per refill,
refill ``r`` (from 0) being ``blake2xb(out_len = 4096, input = r as a little-endian u64, key = the 64-byte seed)``;
its stream is the refills' buffers end to end. BLAKE2Xb (the BLAKE2X paper, the reference ``blake2xb.c``) is:

* ``H0`` = keyed BLAKE2b-512 of the input with the XOF parameter block (fanout 1, depth 1, ``xof_length`` 4096 in
  the high half of the 64-bit node-offset word): :func:`refill_roots`, on the host through :mod:`hashlib`, which
  expresses exactly this parameter block (one 64-byte root per 4096 bytes of stream);
* output block ``i`` (0..63) = unkeyed BLAKE2b of ``H0`` (one compression: 64 bytes, the last block) under the
  parameter block digest 64, key 0, fanout 0, depth 0, leaf length 64, node offset ``i``, ``xof_length`` 4096,
  inner length 64. hashlib refuses depth 0, so these run here: the Triton kernel on CUDA
  (:func:`fhe.backends.gpu.blake2xb_triton.xof_blocks`, one block per lane, its state in registers as uint64,
  rotations by shifts) and :func:`xof_blocks_torch`, the torch reference on int64 (logical right shifts masked)
  that the torch-CPU device runs and CI checks the kernel against under Triton's interpreter.

Each block's 64 bytes are its eight state words, little-endian: stream word ``64 r + 8 i + k`` (in u64 words) is
word ``k`` of block ``i`` of refill ``r``. Nothing here is secret: the seed travels in the clear in every seeded
ciphertext (it only derives the public c1).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

#: SEAL's refill buffer (``UniformRandomGenerator::buffer_size_``) and the BLAKE2b block output
BUFFER_BYTES = 4096
BLOCK_BYTES = 64
BLOCKS_PER_REFILL = BUFFER_BYTES // BLOCK_BYTES
WORDS_PER_REFILL = BUFFER_BYTES // 8
SEED_BYTES = 64

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


def signed(u: int) -> int:
    """A u64 as the int64 with the same bits."""
    return u - (1 << 64) if u >> 63 else u


def out_param_words() -> tuple[int, int, int]:
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
    p0, p2, xof = out_param_words()
    node = torch.arange(BLOCKS_PER_REFILL, dtype=torch.int64, device=roots.device).repeat(r)
    h = [torch.full_like(zero, signed(_IV[0] ^ p0)), (node | xof) ^ signed(_IV[1]),
         torch.full_like(zero, signed(_IV[2] ^ p2))] + [torch.full_like(zero, signed(w)) for w in _IV[3:]]
    v = list(h) + [torch.full_like(zero, signed(w)) for w in _IV]
    v[12] = v[12] ^ BLOCK_BYTES                                               # t0: 64 bytes hashed
    v[14] = v[14] ^ -1                                                        # f0: the last block
    for rnd in range(_ROUNDS):
        s = _SIGMA[rnd % 10]
        for j, (a, b, c, d) in enumerate(((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15),
                                          (0, 5, 10, 15), (1, 6, 11, 12), (2, 7, 8, 13), (3, 4, 9, 14))):
            _g_torch(v, a, b, c, d, m[s[2 * j]], m[s[2 * j + 1]])
    out = torch.stack([h[k] ^ v[k] ^ v[k + 8] for k in range(8)], dim=1)    # [lanes, 8]
    return out.reshape(r, WORDS_PER_REFILL)


def stream_words(seed: bytes, first_refill: int, refills: int, device: torch.device | str) -> torch.Tensor:
    """Words ``512 first_refill ..`` of the stream of ``seed``, ``refills`` buffers of them -> int64 ``[refills * 512]``
    on ``device`` (the roots on the host, the blocks on the device: the Triton kernel on CUDA, the torch reference
    elsewhere)."""
    roots = torch.from_numpy(refill_roots(seed, first_refill, refills).view(np.int64).copy()).to(device)
    if roots.device.type == "cuda":
        from fhe.backends.gpu.blake2xb_triton import xof_blocks

        return xof_blocks(roots).reshape(-1)
    blocks = xof_blocks_torch(roots)
    return blocks.reshape(-1)


__all__ = ["BUFFER_BYTES", "SEED_BYTES", "refill_roots", "stream_words", "xof_blocks_torch"]
