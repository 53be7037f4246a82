"""SEAL's serialization of ciphertexts, plaintexts and key-switching keys, read and written with numpy.

Layout (SEAL 4, little-endian), every object framed by a 16-byte ``SEALHeader``
(magic 0xA15E, header size 16, version, compression mode, reserved, total size) then its members:

* Ciphertext: parms_id (4 x u64), is_ntt_form (u8), size, N, L (u64 each), scale (f64),
  correction_factor (u64), then a DynArray (its own header, count u64, count x u64) of
  ``[size][L][N]`` residues.
* Plaintext: parms_id, coeff_count (u64), scale (f64), DynArray ``[L][N]``.
* KSwitchKeys (RelinKeys, GaloisKeys): parms_id, dim1 (u64), for each entry dim2 (u64) and dim2
  PublicKeys, each a header followed by a Ciphertext's members (no header of its own).

Compressed objects (the default of SEAL built with zstd) are one zstd frame after the header. A seeded
ciphertext (SEAL's symmetric encryption saved with its seed: a client's fresh upload) holds a DynArray of c0
only (``[L][N]``) followed by a ``UniformRandomGeneratorInfo``, itself framed by a header (uncompressed, 16 + 65
bytes) then prng type (u8: 1 Blake2xb, 2 Shake256) and the 64-byte seed: :func:`read_fresh_ct_members` reads
it, and :func:`fhe.backends.gpu.uniform.sample_poly_uniform` expands c1 from the seed as SEAL's load does. Seeded
key-switching keys are not parsed here: SEAL loads them once and saves them expanded
(:func:`fhe.backends.gpu.keys.expand`). Nothing here trusts the bytes: every length is checked
against the parameters and the residues against their primes before anything is used.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import zstandard

from fhe.errors import WireError

MAGIC = 0xA15E
_HEADER = struct.Struct("<HBBBBHQ")
_CT_MEMBERS = struct.Struct("<32sBQQQdQ")
_PT_MEMBERS = struct.Struct("<32sQd")
COMPR_NONE, COMPR_ZSTD = 0, 2
#: SEAL's serialization version written by the tenseal build we read (checked on load by SEAL).
VERSION = (4, 3)


#: ``prng_type`` of SEAL's ``UniformRandomGeneratorInfo``
PRNG_BLAKE2XB, PRNG_SHAKE256 = 1, 2
SEED_BYTES = 64
_SEED_INFO_BYTES = 16 + 1 + SEED_BYTES


@dataclass
class RawCiphertext:
    parms_id: bytes
    scale: float
    data: np.ndarray            # [size, L, N] uint64
    correction_factor: int = 1


@dataclass
class SeededCiphertext:
    """A size-2 ciphertext as SEAL saves it with its seed: c0 and what derives c1."""
    parms_id: bytes
    scale: float
    c0: np.ndarray              # [L, N] uint64
    prng_type: int
    seed: bytes                 # 8 little-endian u64 words
    correction_factor: int = 1


class _Reader:
    """Members of a SEAL object in order; ``take`` returns views of the buffer, not copies (a ciphertext's
    residues are most of it: numpy reads them in place)."""

    def __init__(self, buf: bytes | memoryview) -> None:
        self.buf, self.pos = memoryview(buf), 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise WireError("truncated SEAL object")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, st: struct.Struct) -> tuple:
        return st.unpack(self.take(st.size))

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]


def _header(r: _Reader) -> tuple[int, int]:
    """(compression mode, total size) of the header at the reader's position."""
    magic, hsize, _major, _minor, compr, _res, size = r.unpack(_HEADER)
    if magic != MAGIC or hsize != _HEADER.size:
        raise WireError("not a SEAL object (bad header)")
    if compr not in (COMPR_NONE, COMPR_ZSTD):
        raise WireError(f"unsupported SEAL compression mode {compr}")
    return compr, size


def open_object(data: bytes, max_bytes: int) -> _Reader:
    """A reader over the members of a top-level SEAL object (decompressed, at most ``max_bytes``)."""
    r = _Reader(data)
    compr, size = _header(r)
    if size != len(data):
        raise WireError(f"SEAL header says {size} bytes, got {len(data)}")
    if compr == COMPR_NONE:
        return _Reader(r.take(size - _HEADER.size))
    try:
        body = zstandard.ZstdDecompressor().decompress(r.take(size - _HEADER.size), max_output_size=max_bytes)
    except zstandard.ZstdError as exc:
        raise WireError(f"SEAL object does not decompress: {exc}") from exc
    return _Reader(body)


def _dynarray(r: _Reader, count: int) -> np.ndarray:
    _header(r)
    have = r.u64()
    if have != count:
        raise WireError(f"SEAL array of {have} values, expected {count} (seeded or foreign object)")
    return np.frombuffer(r.take(8 * count), dtype="<u8")


def read_ct_members(r: _Reader, n: int) -> RawCiphertext:
    pid, is_ntt, size, degree, lev, scale, corr = r.unpack(_CT_MEMBERS)
    if not is_ntt or degree != n or not 1 <= size <= 3 or lev < 1 or lev > 64:
        raise WireError(f"unexpected ciphertext shape (ntt={is_ntt}, size={size}, N={degree}, L={lev})")
    arr = _dynarray(r, size * lev * n).reshape(size, lev, n)
    return RawCiphertext(pid, scale, arr, corr)


def read_fresh_ct_members(r: _Reader, n: int) -> RawCiphertext | SeededCiphertext:
    """A ciphertext's members, full or seeded (:class:`SeededCiphertext`; its seed's frame must be SEAL's
    uncompressed one of 81 bytes, and the prng type is returned unchecked)."""
    pid, is_ntt, size, degree, lev, scale, corr = r.unpack(_CT_MEMBERS)
    if not is_ntt or degree != n or not 1 <= size <= 3 or lev < 1 or lev > 64:
        raise WireError(f"unexpected ciphertext shape (ntt={is_ntt}, size={size}, N={degree}, L={lev})")
    _header(r)
    have = r.u64()
    if have == size * lev * n:
        return RawCiphertext(pid, scale, np.frombuffer(r.take(8 * have), dtype="<u8").reshape(size, lev, n), corr)
    if size != 2 or have != lev * n:
        raise WireError(f"SEAL array of {have} values for a ciphertext of size {size}")
    c0 = np.frombuffer(r.take(8 * have), dtype="<u8").reshape(lev, n)
    magic, hsize, _major, _minor, compr, _res, info_size = r.unpack(_HEADER)
    if magic != MAGIC or hsize != _HEADER.size or compr != COMPR_NONE or info_size != _SEED_INFO_BYTES:
        raise WireError("seed of a seeded ciphertext not in SEAL's uncompressed form")
    prng_type = r.take(1)[0]
    return SeededCiphertext(pid, scale, c0, prng_type, bytes(r.take(SEED_BYTES)), corr)


def read_ciphertext(data: bytes, n: int, max_level: int) -> RawCiphertext:
    """A serialized (unseeded) ciphertext of ring degree ``n``."""
    r = open_object(data, 3 * max_level * n * 8 + 4096)
    ct = read_ct_members(r, n)
    if ct.data.shape[1] > max_level:
        raise WireError("ciphertext has more primes than the parameters")
    return ct


def read_plaintext(data: bytes, n: int) -> tuple[bytes, float, np.ndarray]:
    """(parms_id, scale, residues [L, N]) of a serialized NTT-form plaintext."""
    r = open_object(data, 64 * n * 8 + 4096)
    pid, count, scale = r.unpack(_PT_MEMBERS)
    if count % n:
        raise WireError("plaintext size is not a multiple of N")
    return pid, scale, _dynarray(r, count).reshape(count // n, n)


def read_kswitch_keys(data: bytes, n: int, max_bytes: int) -> dict[int, list[RawCiphertext]]:
    """{entry index: [decomposition components]} of RelinKeys/GaloisKeys (empty entries skipped)."""
    r = open_object(data, max_bytes)
    r.take(32)                                   # parms_id of the key level (checked per component)
    dim1 = r.u64()
    if dim1 > 2 * n:
        raise WireError(f"key table of {dim1} entries")
    out: dict[int, list[RawCiphertext]] = {}
    for index in range(dim1):
        dim2 = r.u64()
        if dim2 > 64:
            raise WireError(f"key entry of {dim2} components")
        comps = []
        for _ in range(dim2):
            _header(r)
            comps.append(read_ct_members(r, n))
        if comps:
            out[index] = comps
    return out


def _frame(members: bytes, compress: bool) -> bytes:
    body = zstandard.ZstdCompressor(level=1).compress(members) if compress else members
    mode = COMPR_ZSTD if compress else COMPR_NONE
    return _HEADER.pack(MAGIC, _HEADER.size, *VERSION, mode, 0, _HEADER.size + len(body)) + body


def write_ciphertext(ct: RawCiphertext, compress: bool = True) -> bytes:
    """SEAL's serialized form of ``ct`` (zstd-compressed like SEAL's default, or uncompressed)."""
    size, lev, n = ct.data.shape
    arr = np.ascontiguousarray(ct.data, dtype="<u8").tobytes()
    dyn = _HEADER.pack(MAGIC, _HEADER.size, *VERSION, COMPR_NONE, 0, _HEADER.size + 8 + len(arr))
    members = _CT_MEMBERS.pack(ct.parms_id, 1, size, n, lev, ct.scale, ct.correction_factor)
    return _frame(members + dyn + struct.pack("<Q", size * lev * n) + arr, compress)



def write_seeded_ciphertext(ct: SeededCiphertext, compress: bool = True) -> bytes:
    """SEAL's serialized form of a seeded ciphertext (what SEAL's save of an encryption made with its seed writes:
    c0, then the seed in its own uncompressed frame; zstd over the whole like SEAL's default, or uncompressed).
    On the SDK's critical path (an upload on a zero made ahead): c0 is fed to zstd in place, one copy in all."""
    lev, n = ct.c0.shape
    arr = np.ascontiguousarray(ct.c0, dtype="<u8")
    parts = [_CT_MEMBERS.pack(ct.parms_id, 1, 2, n, lev, ct.scale, ct.correction_factor),
             _HEADER.pack(MAGIC, _HEADER.size, *VERSION, COMPR_NONE, 0, _HEADER.size + 8 + arr.nbytes),
             struct.pack("<Q", lev * n), memoryview(arr).cast("B"),
             _HEADER.pack(MAGIC, _HEADER.size, *VERSION, COMPR_NONE, 0, _SEED_INFO_BYTES),
             bytes([ct.prng_type]) + ct.seed]
    if compress:
        z = zstandard.ZstdCompressor(level=1).compressobj(size=sum(len(p) for p in parts))
        parts = [z.compress(p) for p in parts] + [z.flush()]
    mode = COMPR_ZSTD if compress else COMPR_NONE
    size = _HEADER.size + sum(len(p) for p in parts)
    return b"".join([_HEADER.pack(MAGIC, _HEADER.size, *VERSION, mode, 0, size), *parts])


__all__ = ["PRNG_BLAKE2XB", "RawCiphertext", "SeededCiphertext", "read_ciphertext", "read_fresh_ct_members",
           "read_kswitch_keys", "read_plaintext", "write_ciphertext", "write_seeded_ciphertext"]
