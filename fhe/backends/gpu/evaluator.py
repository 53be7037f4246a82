"""Our own CKKS evaluator (issue 16): SEAL's algorithms on int64 torch tensors, CPU or CUDA.

Reads the ciphertexts and evaluation keys the SEAL client produces and computes, for every protocol
operation, the same residues SEAL computes (tests/fhe/test_gpu_backend*.py check it bit for bit).
Encoding is SEAL's own CKKSEncoder (plaintexts are made once per plan, on the CPU, then kept on the
device), or with ``encoder="fft"`` the same transform on the device (per-step plaintexts: within one
unit of SEAL's coefficients, not bit for bit). On CUDA the fixed-shape parts of key switching and
rescale, and whole rotations/relinearizations per key, run as CUDA graphs (graphs.py). Beyond SEAL:
:meth:`rotate_many` hoists the decomposition (keyswitch.py says why that is still bit-identical).
Not in SEAL's way: a missing Galois key is an error here (SEAL would compose the rotation from
power-of-two keys).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from fhe import sealio
from fhe.backends.gpu import keyswitch as ks
from fhe.backends.gpu.galois import ntt_permutation
from fhe.backends.gpu.keys import GpuKeys, keys_from_server, load_keys
from fhe.backends.gpu.modarith import addmod, mulmod
from fhe.backends.gpu.ntt import ntt
from fhe.backends.gpu.rns import RNSContext, drop_last_rounded, intt
from fhe.backends.gpu.uniform import sample_poly_uniform
from fhe.backends.seal import hazmat as seal
from fhe.backends.seal.keys import ServerKeys
from fhe.errors import LevelError, ShapeError, WireError
from fhe.evaluator import ParamsQueries
from fhe.params import CKKSParams, KeyLevels

_EPS = np.finfo(np.float64).eps
#: The on-device encoder without a host sync (issue 16): its 2^62 fallback test is decided on the host from the
#: values where that suffices (:func:`_fits_on_host`) and the values go up through pinned memory, so an encode no
#: longer waits for the stream to drain (a decode step encodes ~20 plaintexts, each one a drain before). The
#: same device work and residues either way. False: the device test and a pageable copy (main's, benchmarks).
ASYNC_ENCODE = True
#: Several key switches of one call as one batch (issue 16, session 18): ``rotate_many``'s hoisted steps finish
#: together (their inner products stacked, one rounding over ``[B, 2, L+1, N]``, one addition of the rotated c0s),
#: and :meth:`GpuEvaluator.rotate_each` decomposes several ciphertexts in one pass. Row b gets the same kernels'
#: arithmetic as one switch alone, so the same residues (the torch-CPU reference = SEAL in CI; on an H100, session 19:
#: every operation = SEAL at N = 8192 and at the shipped size with it on). On since session 19: the 576x576 matmul
#: with ``giants_each`` 2.12 -> 1.24 ms, 451 -> 160 kernels, bit for bit the same (docs/benchmarks.md; the decode
#: step's A/B was not run). False: one key switch after another (before session 19).
BATCH_SWITCHES = True


@dataclass
class GpuCiphertext:
    """``data [size, L, N]`` int64 residues in NTT form (SEAL's layout) and the scale."""

    data: torch.Tensor
    scale: float

    @property
    def level(self) -> int:
        return self.data.shape[1]


@dataclass
class GpuPlaintext:
    data: torch.Tensor          # [L, N]
    scale: float


def _fits_on_host(values: np.ndarray, scale: float, n: int) -> bool:
    """True when every encoded coefficient is surely below the FFT path's 2^62 bound: |m_k| <= (2 scale / N)
    sum |z_i| (each coefficient is a sum over the slots), with a factor 2 to spare for float64 rounding.
    False decides nothing (NaN included): the device test then runs as before."""
    return bool(2.0 * scale / n * float(np.abs(values).sum()) < 2.0 ** 61)


def _upload(values: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host values to ``device`` as complex128: through pinned memory without waiting (:data:`ASYNC_ENCODE`;
    torch keeps the pinned block until the copy has run), else a pageable copy, which drains the stream."""
    t = torch.from_numpy(values) if isinstance(values, np.ndarray) else values
    if ASYNC_ENCODE and device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory().to(device, non_blocking=True)
    return t.to(device, torch.complex128)


def plain_block(pts: Sequence[GpuPlaintext]) -> torch.Tensor | None:
    """``pts``' residues as one ``[K, L, N]`` view where they are consecutive rows of one contiguous tensor (what
    ``encode_many`` returns for a batch), else None (then they are stacked: a copy)."""
    first = pts[0].data
    if not first.is_contiguous() or any(p.data.shape != first.shape or not p.data.is_contiguous() for p in pts):
        return None
    row = first.numel()
    start = first.storage_offset()
    if any(p.data.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
           or p.data.storage_offset() != start + j * row for j, p in enumerate(pts)):
        return None
    return first.as_strided((len(pts), *first.shape), (row, *first.stride()), start)


def _are_close(a: float, b: float) -> bool:
    """SEAL's ``util::are_close`` (what its add checks scales with)."""
    return abs(a - b) < _EPS * max(abs(a), abs(b), 1.0)


class GpuEvaluator(ParamsQueries):
    """CKKS evaluation for one parameter set on one torch device (see :mod:`fhe.evaluator`)."""

    name = "gpu"

    def __init__(self, params: CKKSParams, device: str | torch.device | None = None, *,
                 graphs: bool = True, encoder: str = "seal", step_graphs: bool | None = None) -> None:
        if encoder not in ("seal", "fft"):
            raise ValueError(f"encoder must be 'seal' or 'fft', got {encoder!r}")
        self.encoder = encoder
        self.params = params
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.kit = seal.Kit(params)
        self.ctx = RNSContext(self.kit, self.device)
        # CUDA graphs of the key switch's fixed-shape halves (graphs.py); False: plain launches (benchmarks)
        self.graphs = None
        if graphs and self.device.type == "cuda":
            from fhe.backends.gpu.graphs import GraphCache

            self.graphs = GraphCache()
        self._perms: dict[int, torch.Tensor] = {}
        # whole steps as one graph each (whole_step.py): on CUDA, with the key switch's graphs, unless told
        from fhe.backends.gpu import whole_step

        # (step_graphs=True off CUDA: the same shadow run and fed plaintexts, run eagerly: what CI checks)
        on = (whole_step.STEP_GRAPHS and self.graphs is not None) if step_graphs is None else step_graphs
        self.whole_steps = whole_step.WholeSteps(self) if on else None
        # while a whole step is warmed up or captured: its encodes come from here (static plaintexts) and
        # rotate_many's zero-digit test goes into a device flag instead of the host (whole_step.py)
        self._feed = None
        self._zero_flag: torch.Tensor | None = None
        self._bits = {lev: sum(math.log2(q) for q in self.ctx.primes[:lev]) for lev in range(1, self.ctx.K + 1)}

    # --- parameters and queries ---------------------------------------------------------------
    def prime(self, level: int) -> float:
        return float(self.ctx.primes[level - 1])

    def level(self, ct: GpuCiphertext) -> int:
        return ct.level

    def scale_of(self, ct: GpuCiphertext) -> float:
        return ct.scale

    def size(self, ct: GpuCiphertext) -> int:
        return ct.data.shape[0]

    def nbytes(self, ct: GpuCiphertext) -> int:
        return ct.data.numel() * 8

    def set_scale(self, ct: GpuCiphertext, scale: float) -> None:
        ct.scale = float(scale)

    def _q(self, lev: int) -> torch.Tensor:
        return self.ctx.q[:lev]

    def _check_scale(self, scale: float, lev: int) -> float:
        """SEAL's ``is_scale_within_bounds``: log2(scale) below the level's modulus bits."""
        if scale <= 0 or int(math.log2(scale)) >= math.floor(self._bits[lev]) + 1:
            raise LevelError(f"scale 2^{math.log2(scale):.1f} out of bounds at level {lev}")
        return scale

    @staticmethod
    def _same_level(a, b) -> None:
        if a.data.shape[-2] != b.data.shape[-2]:
            raise LevelError(f"operands at levels {a.data.shape[-2]} and {b.data.shape[-2]}")

    # --- encoding (SEAL's encoder, then its residues; or the same transform on the device) --------
    def encode(self, values: np.ndarray, level: int, scale: float) -> GpuPlaintext:
        if not 1 <= level <= self.top:
            raise LevelError(f"no level {level} (1..{self.top})")
        if self._feed is not None:
            return self._fed(level, scale, 1)[0]
        values = np.asarray(values, np.float64)
        if values.ndim != 1 or len(values) > self.slots:
            raise ShapeError(f"need a vector of <= {self.slots} values, got shape {values.shape}")
        if self.encoder == "fft":
            pt = self._encode_fft(values, level, scale)
            if pt is not None:
                return pt
        pt = self.kit.encode(values, level, scale)
        _, sc, arr = sealio.read_plaintext(seal.to_bytes(pt), self.params.poly_modulus_degree)
        return GpuPlaintext(torch.from_numpy(arr.astype(np.int64)).to(self.device), sc)

    def batched(self, keys: GpuKeys, rows: int):
        """(evaluator, keys) that run ``rows`` ciphertexts under one key set as one batch (optional protocol
        capability, found by ``getattr``: :mod:`fhe.backends.gpu.batched`; each row's residues are this
        evaluator's)."""
        from fhe.backends.gpu.batched import BatchedEvaluator, BatchKeys

        return BatchedEvaluator(self), BatchKeys.shared(keys, rows)

    def encode_many(self, values: Sequence[np.ndarray], level: int, scale: float) -> list[GpuPlaintext]:
        """:meth:`encode` of each vector, at one level and scale. With the on-device encoder, one batched
        FFT, rounding and NTT for all of them: a packed prefill chunk encodes ~3,300 per-row diagonals
        (positions are public but change per chunk), ~17 per dot product, and one launch sequence per
        plaintext was most of its time. Each row is transformed alone (a batch of independent FFTs), so
        the residues are :meth:`encode`'s; rows past the FFT's 2^62 range go through SEAL, as there."""
        if not 1 <= level <= self.top:
            raise LevelError(f"no level {level} (1..{self.top})")
        if self._feed is not None:
            return self._fed(level, scale, len(values))
        if isinstance(values, torch.Tensor):          # [K, <= slots], already where it is encoded
            if values.ndim != 2 or values.shape[1] > self.slots:
                raise ShapeError(f"need [K, <= {self.slots}] values, got shape {tuple(values.shape)}")
            rows, dense = list(values.detach().cpu().double().numpy()) if self.encoder != "fft" else None, values
        else:
            rows = [np.asarray(v, np.float64) for v in values]
            if any(v.ndim != 1 or len(v) > self.slots for v in rows):
                raise ShapeError(f"need vectors of <= {self.slots} values")
            dense = None
        if self.encoder != "fft" or (dense is None and len(rows) < 2):
            return [self.encode(v, level, scale) for v in rows]
        n = self.params.poly_modulus_degree
        host_fits = (ASYNC_ENCODE and rows is not None and dense is None
                     and all(_fits_on_host(v, scale, n) for v in rows))
        if dense is None:
            dense = np.zeros((len(rows), max(len(v) for v in rows)))
            for i, v in enumerate(rows):
                dense[i, : len(v)] = v
            dense = torch.from_numpy(dense)
        if len(dense) == 0:
            return []
        width = dense.shape[1]
        spread = torch.zeros(len(dense), 2 * n, dtype=torch.complex128, device=self.device)   # [K, 2N]
        spread[:, self._slot_indices()[:width]] = _upload(dense, self.device)
        coeffs = torch.fft.fft(spread, dim=-1).real[:, :n] * (2.0 * scale / n)               # [K, N]
        fits = [True] * len(dense) if host_fits else (coeffs.abs().amax(dim=-1) < 2.0 ** 62).tolist()
        tab = self.ctx.level(level).data
        ints = torch.round(coeffs).to(torch.int64)
        residues = ntt(torch.remainder(ints[:, None, :].expand(len(dense), level, n), tab.primes), tab,
                       inplace=True)                                                      # [K, L, N]
        return [GpuPlaintext(residues[i], float(scale)) if ok
                else self.encode(dense[i].detach().cpu().double().numpy(), level, scale) for i, ok in enumerate(fits)]

    def _fed(self, level: int, scale: float, count: int) -> list[GpuPlaintext]:
        """The next ``count`` static plaintexts of the step being captured (whole_step.py): the same level and
        scale as the shadow run recorded, or the step is not the one its signature says (ShapeError)."""
        out = [next(self._feed, None) for _ in range(count)]
        if any(p is None or p.data.shape[0] != level or p.scale != float(scale) for p in out):
            raise ShapeError("a captured step encodes other plaintexts than its shadow run did")
        return out

    def run_step(self, body, inputs: Sequence[GpuCiphertext], keys: GpuKeys) -> list[GpuCiphertext]:
        """``body(ev, inputs, keys) -> outputs``, as one CUDA graph replay where whole-step graphs are on
        (:class:`~fhe.backends.gpu.whole_step.WholeSteps`; ``body`` must reach the device only through ``ev``
        and leave its inputs alone), else called on this evaluator. Same residues either way."""
        if self.whole_steps is None:
            return list(body(self, list(inputs), keys))
        return self.whole_steps.run(body, list(inputs), keys)

    def _slot_indices(self) -> torch.Tensor:
        """3^i mod 2N for each slot i: where slot i's value goes in the length-2N FFT."""
        if not hasattr(self, "_slot_index"):
            n = self.params.poly_modulus_degree
            self._slot_index = torch.tensor([pow(3, i, 2 * n) for i in range(self.slots)], device=self.device)
        return self._slot_index

    def _encode_fft(self, values: np.ndarray, level: int, scale: float) -> GpuPlaintext | None:
        """SEAL's CKKS encoding as one float64 FFT on the device (None: coefficients too large for it).

        Slot i is the polynomial's value at zeta^(3^i) (zeta = e^(i pi / N); its conjugate at zeta^-(3^i)),
        so the coefficients are m_k = (2/N) Re sum_i z_i zeta^(-3^i k) * scale: an FFT of length 2N with
        z_i at index 3^i mod 2N. Rounded, reduced into each prime, NTT'd. Not SEAL's floating-point order:
        a coefficient can differ from SEAL's by one where SEAL's value sits at a half (the decoded value
        then differs by ~1/scale; tests measure it), hence opt-in (``encoder="fft"``)."""
        n = self.params.poly_modulus_degree
        spread = torch.zeros(2 * n, dtype=torch.complex128, device=self.device)
        spread[self._slot_indices()[: len(values)]] = _upload(values, self.device)
        coeffs = torch.fft.fft(spread).real[:n] * (2.0 * scale / n)
        if not (ASYNC_ENCODE and _fits_on_host(values, scale, n)) and not bool(coeffs.abs().max() < 2.0 ** 62):
            # SEAL's multi-precision path: let SEAL do it
            return None
        coeffs = torch.round(coeffs).to(torch.int64)
        tab = self.ctx.level(level).data
        residues = ntt(torch.remainder(coeffs.expand(level, n), tab.primes), tab, inplace=True)
        return GpuPlaintext(residues, float(scale))

    # --- arithmetic -------------------------------------------------------------------------------
    def _add_data(self, a: torch.Tensor, b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        if a.shape[0] < b.shape[0]:
            a, b = b, a
        out = a.clone()
        out[: b.shape[0]] = addmod(a[: b.shape[0]], b, q)
        return out

    def add(self, a: GpuCiphertext, b: GpuCiphertext) -> GpuCiphertext:
        self._same_level(a, b)
        if not _are_close(a.scale, b.scale):
            raise LevelError(f"scales {a.scale} and {b.scale} differ")
        return GpuCiphertext(self._add_data(a.data, b.data, self._q(a.level)), a.scale)

    def add_inplace(self, a: GpuCiphertext, b: GpuCiphertext) -> None:
        a.data = self.add(a, b).data

    def add_many(self, cts: Sequence[GpuCiphertext]) -> GpuCiphertext:
        if not cts:
            raise ShapeError("add_many of nothing")
        if self.device.type == "cuda" and len(cts) > 2 and len({c.data.shape for c in cts}) == 1:
            for c in cts[1:]:                                        # SEAL's checks, as the loop below makes them
                self._same_level(cts[0], c)
                if not _are_close(cts[0].scale, c.scale):
                    raise LevelError(f"scales {cts[0].scale} and {c.scale} differ")
            return GpuCiphertext(self._dot(cts, None), cts[0].scale)
        out = cts[0]
        for c in cts[1:]:
            out = self.add(out, c)
        return out if len(cts) > 1 else GpuCiphertext(out.data.clone(), out.scale)

    def add_plain(self, ct: GpuCiphertext, pt: GpuPlaintext) -> GpuCiphertext:
        self._same_level(ct, pt)
        if not _are_close(ct.scale, pt.scale):
            raise LevelError(f"scales {ct.scale} and {pt.scale} differ")
        out = ct.data.clone()
        out[0] = addmod(ct.data[0], pt.data, self._q(ct.level))
        return GpuCiphertext(out, ct.scale)

    def add_plain_inplace(self, ct: GpuCiphertext, pt: GpuPlaintext) -> None:
        ct.data = self.add_plain(ct, pt).data

    def mul_plain(self, ct: GpuCiphertext, pt: GpuPlaintext) -> GpuCiphertext:
        self._same_level(ct, pt)
        scale = self._check_scale(ct.scale * pt.scale, ct.level)
        return GpuCiphertext(mulmod(ct.data, pt.data, self._q(ct.level)), scale)

    def dot_plain(self, pairs: Sequence[tuple[GpuCiphertext, GpuPlaintext]]) -> GpuCiphertext:
        if not pairs:
            raise ShapeError("dot_plain of nothing")
        if self.device.type != "cuda" or len(pairs) < 2 or len({c.data.shape for c, _ in pairs}) > 1:
            return self.add_many([self.mul_plain(c, p) for c, p in pairs])
        scale = self._dot_scale(pairs)                               # the checks before the kernel
        return GpuCiphertext(self._dot([c for c, _ in pairs], [p for _, p in pairs]), scale)

    def _dot_scale(self, pairs: Sequence[tuple[GpuCiphertext, GpuPlaintext]]) -> float:
        """The scale of ``sum_j c_j * p_j`` after mul_plain's and add's checks, in their order."""
        scales = []
        for c, p in pairs:
            self._same_level(c, p)
            scales.append(self._check_scale(c.scale * p.scale, c.level))
            if not _are_close(scales[0], scales[-1]):
                raise LevelError(f"scales {scales[0]} and {scales[-1]} differ")
        return scales[0]

    def dot_with(self, cts: Sequence[GpuCiphertext]):
        """``dot(pts) = dot_plain(zip(cts, pts))`` for several plaintext sets on the same ciphertexts (optional
        protocol capability, found by ``getattr``): a packed map's babies serve its 64 band shifts, so on CUDA they
        are stacked once (``[K, size, L, N]``, not per shift: ~100 MB a shift at 12 primes) and plaintexts that are
        one block already (as ``encode_many`` makes them) are read where they are. The same kernel on the same
        operands: :meth:`dot_plain`'s residues."""
        cts = list(cts)
        if self.device.type != "cuda" or len(cts) < 2 or len({c.data.shape for c in cts}) > 1 or \
                any(not _are_close(c.scale, cts[0].scale) for c in cts):
            return lambda pts: self.dot_plain(list(zip(cts, pts, strict=True)))
        from fhe.backends.gpu import triton_ops

        stacked = torch.stack([c.data for c in cts])                            # [K, size, L, N]

        def dot(pts: Sequence[GpuPlaintext]) -> GpuCiphertext:
            if len(pts) != len(cts):
                raise ShapeError(f"{len(cts)} ciphertexts but {len(pts)} plaintexts")
            scale = self._dot_scale(list(zip(cts, pts, strict=True)))         # dot_plain's checks
            block = plain_block(pts)
            block = torch.stack([p.data for p in pts]) if block is None else block   # [K, L, N]
            return GpuCiphertext(triton_ops.dot_rows(stacked, block, self.ctx.q.view(-1)), scale)

        return dot

    def _dot(self, cts: Sequence[GpuCiphertext], pts: Sequence[GpuPlaintext] | None) -> torch.Tensor:
        """One kernel for sum_j c_j (* p_j): the same canonical residues as the loop of ops it replaces."""
        from fhe.backends.gpu import triton_ops

        c = torch.stack([x.data for x in cts])                              # [K, size, L, N]
        p = None if pts is None else torch.stack([x.data for x in pts])    # [K, L, N]
        return triton_ops.dot_rows(c, p, self.ctx.q.view(-1))

    def mul(self, a: GpuCiphertext, b: GpuCiphertext) -> GpuCiphertext:
        self._same_level(a, b)
        if self.size(a) != 2 or self.size(b) != 2:
            raise LevelError("mul needs two ciphertexts of size 2")
        q = self._q(a.level)
        (a0, a1), (b0, b1) = a.data, b.data
        c1 = addmod(mulmod(a0, b1, q), mulmod(a1, b0, q), q)
        data = torch.stack((mulmod(a0, b0, q), c1, mulmod(a1, b1, q)))
        return GpuCiphertext(data, self._check_scale(a.scale * b.scale, a.level))

    def square(self, ct: GpuCiphertext) -> GpuCiphertext:
        if self.size(ct) != 2:
            raise LevelError("square needs a ciphertext of size 2")
        q = self._q(ct.level)
        c0, c1 = ct.data
        cross = mulmod(c0, c1, q)
        data = torch.stack((mulmod(c0, c0, q), addmod(cross, cross, q), mulmod(c1, c1, q)))
        return GpuCiphertext(data, self._check_scale(ct.scale * ct.scale, ct.level))

    def relinearize(self, ct: GpuCiphertext, keys: GpuKeys) -> GpuCiphertext:
        if self.size(ct) != 3:
            raise LevelError("relinearize needs a ciphertext of size 3")
        lt, key, q = self.ctx.level(ct.level), keys.relin_key(ct.level), self._q(ct.level)

        def relin(x: torch.Tensor) -> torch.Tensor:
            return addmod(x[:2], ks.switch_key(x[2], key, lt), q)

        if self.graphs is not None:                                   # the whole op, one replay (keys own it)
            return GpuCiphertext(self._key_graphs(keys).run(("relin",), relin, ct.data).clone(), ct.scale)
        delta = self._switch_key(ct.data[2], key, lt)
        return GpuCiphertext(addmod(ct.data[:2], delta, q), ct.scale)

    def rescale(self, ct: GpuCiphertext) -> GpuCiphertext:
        lev = ct.level
        if lev < 2:
            raise LevelError("cannot rescale at the last level")
        lt = self.ctx.level(lev)
        keep = lt.data.take(slice(0, lev - 1))

        def drop(x: torch.Tensor) -> torch.Tensor:
            return drop_last_rounded(x, keep, lt.last, lt.inv_qlast, lt.q_ext_ints[lev - 1])

        # fixed shape per (size, level): one graph replay instead of ~40 launches (the copy frees its buffer)
        data = drop(ct.data) if self.graphs is None else self.graphs.run("rescale", drop, ct.data).clone()
        return GpuCiphertext(data, self._check_scale(ct.scale / float(self.ctx.primes[lev - 1]), lev - 1))

    def rescale_inplace(self, ct: GpuCiphertext) -> None:
        out = self.rescale(ct)
        ct.data, ct.scale = out.data, out.scale

    def mod_switch(self, ct: GpuCiphertext, level: int) -> GpuCiphertext:
        if level > ct.level or level < 1:
            raise LevelError(f"ciphertext at level {ct.level} cannot go to level {level}")
        if level == ct.level:
            return ct
        return GpuCiphertext(ct.data[:, :level].clone(), ct.scale)

    # --- rotations ------------------------------------------------------------------------------------
    def _perm(self, elt: int) -> torch.Tensor:
        if elt not in self._perms:
            self._perms[elt] = ntt_permutation(elt, self.params.poly_modulus_degree).to(self.device)
        return self._perms[elt]

    def rotate(self, ct: GpuCiphertext, step: int, keys: GpuKeys) -> GpuCiphertext:
        if step % self.slots == 0:
            return ct
        if self.size(ct) != 2:
            raise LevelError("rotate needs a ciphertext of size 2 (relinearize first)")
        elt, key = keys.galois_key(step, ct.level)
        perm, lt, q = self._perm(elt), self.ctx.level(ct.level), self._q(ct.level)
        if self.graphs is not None:                                   # the whole op, one replay (keys own it)

            def rot(x: torch.Tensor) -> torch.Tensor:
                rotated = x[..., perm]
                delta = ks.switch_key(rotated[1], key, lt)
                return torch.stack((addmod(delta[0], rotated[0], q), delta[1]))

            return GpuCiphertext(self._key_graphs(keys).run(("rotate", elt), rot, ct.data).clone(), ct.scale)
        rotated = ct.data[..., perm]                                   # sigma on c0 and c1
        delta = self._switch_key(rotated[1], key, lt)
        out = delta.clone()
        out[0] = addmod(delta[0], rotated[0], q)
        return GpuCiphertext(out, ct.scale)

    def _key_graphs(self, keys: GpuKeys):
        """Graphs of whole key switches with ``keys`` (they capture the key's address, so they live and die
        with the key set: never replayed for another one), in this evaluator's memory pool."""
        if keys.graphs is None:
            from fhe.backends.gpu.graphs import GraphCache

            keys.graphs = GraphCache(self.graphs.pool)
        return keys.graphs

    def rotate_many(self, ct: GpuCiphertext, steps: Iterable[int], keys: GpuKeys) -> dict[int, GpuCiphertext]:
        """Hoisted: c1 is decomposed once; each step permutes the digits (bit-identical to :meth:`rotate`)."""
        steps = [int(s) for s in steps]
        todo = [s for s in steps if s % self.slots]
        out = {s: ct for s in steps if not s % self.slots}
        if not todo:
            return out
        if self.size(ct) != 2:
            raise LevelError("rotate needs a ciphertext of size 2 (relinearize first)")
        lt = self.ctx.level(ct.level)
        found = {s: keys.galois_key(s, ct.level) for s in todo}       # every key checked before any work
        digits, D = self._decompose(ct.data[1], lt)
        if self._zero_flag is not None:                               # a captured step: flag it, check after
            torch.logical_or(self._zero_flag, (digits == 0).any(), out=self._zero_flag)
        elif bool((digits == 0).any()):                               # -0 = 0 needs no fix: plain path
            return out | {s: self.rotate(ct, s, keys) for s in todo}
        q = self._q(ct.level)
        if BATCH_SWITCHES and len(found) > 1:                          # the steps' finishes as one batch
            acc = self._accumulators(len(found), D)                                        # [B, 2, L+1, N]
            for i, (elt, key) in enumerate(found.values()):
                ks.hoisted_inner(D, self._perm(elt), key, self._correction(keys, elt, key, lt), lt, out=acc[i])
            perms = torch.stack([self._perm(elt) for elt, _ in found.values()])           # [B, N]
            delta = ks.finish(acc, lt)                                                     # [B, 2, L, N]
            c0 = ct.data[0]
            c0 = torch.gather(c0.expand(len(perms), *c0.shape), 2, perms[:, None, :].expand(len(perms), *c0.shape))
            delta[:, 0] = addmod(delta[:, 0], c0, q)
            return out | {s: GpuCiphertext(delta[i], ct.scale) for i, s in enumerate(found)}
        for s, (elt, key) in found.items():
            perm = self._perm(elt)
            acc = ks.hoisted_inner(D, perm, key, self._correction(keys, elt, key, lt), lt)
            delta = self._finish(acc, lt).clone()                     # the graph's buffer is reused next step
            delta[0] = addmod(delta[0], ct.data[0][..., perm], q)
            out[s] = GpuCiphertext(delta, ct.scale)
        return out

    def rotate_each(self, cts: Sequence[GpuCiphertext], steps: Sequence[int], keys: GpuKeys) -> list[GpuCiphertext]:
        """``[rotate(ct, step) for ct, step in zip(cts, steps)]`` (bit-identical): with :data:`BATCH_SWITCHES`, the
        ciphertexts of one level are rotated and decomposed as one batch ``[B, L, N]``, each then multiplied by
        its own key, and finished together (a BSGS product's giant steps, :mod:`fhe.linalg`)."""
        cts, steps = list(cts), [int(s) for s in steps]
        if len(cts) != len(steps):
            raise ShapeError(f"{len(cts)} ciphertexts but {len(steps)} steps")
        todo = [i for i, s in enumerate(steps) if s % self.slots]
        if (not BATCH_SWITCHES or len(todo) < 2 or any(self.size(cts[i]) != 2 for i in todo)
                or len({cts[i].level for i in todo}) != 1):
            return [self.rotate(ct, s, keys) for ct, s in zip(cts, steps, strict=True)]
        lev = cts[todo[0]].level
        found = [keys.galois_key(steps[i], lev) for i in todo]         # every key checked before any work
        lt, q = self.ctx.level(lev), self._q(lev)
        perms = torch.stack([self._perm(elt) for elt, _ in found])                          # [B, N]
        data = torch.stack([cts[i].data for i in todo])                                     # [B, 2, L, N]
        rotated = torch.gather(data, 3, perms[:, None, None, :].expand(data.shape))         # sigma per row
        t = rotated[:, 1].contiguous()                                                      # [B, L, N]
        D = ks.expand(intt(t, lt.data), t, lt)                                              # [B, L, L+1, N]
        acc = self._accumulators(len(found), D[0])                                          # [B, 2, L+1, N]
        for b, (_, key) in enumerate(found):
            ks.inner_product(D[b], key, lt, out=acc[b])
        delta = ks.finish(acc, lt)                                                          # [B, 2, L, N]
        delta[:, 0] = addmod(delta[:, 0], rotated[:, 0], q)
        out = list(cts)
        for b, i in enumerate(todo):
            out[i] = GpuCiphertext(delta[b], cts[i].scale)
        return out

    @staticmethod
    def _accumulators(b: int, D: torch.Tensor) -> torch.Tensor:
        """``[b, 2, L+1, N]`` for ``b`` key switches' inner products of digits ``D [L, L+1, N]``."""
        lev, r, n = D.shape
        return torch.empty((b, 2, r, n), dtype=torch.int64, device=D.device)

    # --- key switching: graphs around the fixed-shape halves on CUDA --------------------------------
    def _decompose(self, t: torch.Tensor, lt) -> tuple[torch.Tensor, torch.Tensor]:
        if self.graphs is None:
            return ks.decompose(t, lt)
        return self.graphs.run("decompose", lambda x: ks.decompose(x, lt), t)

    def _finish(self, acc: torch.Tensor, lt) -> torch.Tensor:
        if self.graphs is None:
            return ks.finish(acc, lt)
        return self.graphs.run("finish", lambda x: ks.finish(x, lt), acc)

    def _switch_key(self, t: torch.Tensor, key: torch.Tensor, lt) -> torch.Tensor:
        """``ks.switch_key`` (bit-identical: the same kernels), through the graphs where there are some;
        the result may be a graph's buffer: consume it before the next switch."""
        _, D = self._decompose(t, lt)
        return self._finish(ks.inner_product(D, key, lt), lt)

    def _correction(self, keys: GpuKeys, elt: int, key: torch.Tensor, lt) -> torch.Tensor:
        lev = len(lt.q_ext_ints) - 1
        if (elt, lev) not in keys.corrections:
            neg = ks.negated_positions(elt, self.params.poly_modulus_degree)
            keys.corrections[(elt, lev)] = ks.hoisted_correction(key, neg, lt)
        return keys.corrections[(elt, lev)]

    # --- serialization ------------------------------------------------------------------------------------
    def to_raw(self, ct: GpuCiphertext) -> sealio.RawCiphertext:
        return sealio.RawCiphertext(self.ctx.parms_ids[ct.level], ct.scale, ct.data.cpu().numpy().astype(np.uint64))

    def serialize(self, ct: GpuCiphertext, compress: bool = True) -> bytes:
        """SEAL's bytes of ``ct``; ``compress=False``: without zstd (residues barely compress: 6–10 %), for
        bytes SEAL loads at once in the same process (the worker's step results)."""
        return sealio.write_ciphertext(self.to_raw(ct), compress)

    def deserialize(self, data: bytes) -> GpuCiphertext:
        """Untrusted SEAL bytes -> ciphertext. Seeded uploads are expanded by SEAL first (it validates too)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise WireError(f"expected bytes, got {type(data).__name__}")
        try:
            raw = sealio.read_ciphertext(bytes(data), self.params.poly_modulus_degree, self.top)
        except WireError:
            raw = sealio.read_ciphertext(seal.to_bytes(seal.from_bytes("ciphertext", self.kit, bytes(data))),
                                         self.params.poly_modulus_degree, self.top)
        return self.from_raw(raw)

    def deserialize_fresh(self, payload: bytes) -> GpuCiphertext | None:
        """A client's fresh upload (the SEAL payload of a wire blob whose envelope was checked) read straight
        into a device ciphertext, without SEAL's load and save: None where it is not a ciphertext this parser
        takes, and the caller then goes through SEAL (:meth:`deserialize`), which refuses with a typed error what
        SEAL refuses.

        Full (unseeded) uploads and seeded ones (SEAL's save of an encryption made with its seed: c0 and the seed
        of c1, about half the bytes): c1 is then expanded on the device from the seed
        (:func:`fhe.backends.gpu.uniform.sample_poly_uniform`, SEAL's ``sample_poly_uniform`` with its Blake2xb
        PRNG, residue for residue). A seed of another PRNG (Shake256: SEAL's own build option, not what TenSEAL
        writes) is left to SEAL's load.

        What it accepts is what SEAL's load with ``is_valid_for`` and the worker's freshness check accept, no
        more: one SEAL object of exactly its declared size (uncompressed or one zstd frame) with no byte after
        the ciphertext (and, seeded, its seed in SEAL's uncompressed 81-byte frame), NTT form, size 2, ring
        degree N, the top level's parms_id, every residue of c0 and c1 below its prime, correction factor 1, the
        default scale; its residues are SEAL's, bit for bit."""
        return self.deserialize_fresh_many([payload])[0]

    def deserialize_fresh_many(self, payloads: Sequence[bytes]) -> list[GpuCiphertext | None]:
        """:meth:`deserialize_fresh` of a step's uploads at once: each one decompressed and checked on a thread
        pool (zstd, the step's host cost, and numpy release the GIL), the accepted full ones copied to the device
        in one transfer, each seeded one's c0 copied and its c1 expanded there."""
        parsed = (list(_parse_pool().map(self._fresh_residues, payloads)) if len(payloads) > 1
                  else [self._fresh_residues(p) for p in payloads])
        out: list[GpuCiphertext | None] = [None] * len(parsed)
        ok = [i for i, r in enumerate(parsed) if r is not None and r[2] is None]
        if ok:
            # residues < primes < 2^62: the uint64 words read as int64 unchanged; np.stack is the one host copy
            data = torch.from_numpy(np.stack([parsed[i][0] for i in ok]).view(np.int64)).to(self.device)
            for row, i in zip(data, ok, strict=True):
                out[i] = GpuCiphertext(row, parsed[i][1])
        for i, r in enumerate(parsed):
            if r is not None and r[2] is not None:
                out[i] = self._expand_seeded(*r)
        return out

    def _expand_seeded(self, c0: np.ndarray, scale: float, seed: bytes) -> GpuCiphertext:
        """The device ciphertext of a checked seeded upload: c0 [L, N] copied, c1 expanded from ``seed`` in place."""
        lev, n = c0.shape
        data = torch.empty((2, lev, n), dtype=torch.int64, device=self.device)
        data[0].copy_(torch.from_numpy(c0.view(np.int64).copy()))      # (a copy: the upload's bytes are read-only)
        sample_poly_uniform(seed, list(self.ctx.primes[:lev]), n, data[1])
        return GpuCiphertext(data, scale)

    def _fresh_residues(self, payload: bytes) -> tuple[np.ndarray, float, bytes | None] | None:
        """(uint64 residues [2, top, N] of a full upload, a view of its bytes; scale; None) or (c0 [top, N]; scale;
        the Blake2xb seed) of a seeded one, or None (see :meth:`deserialize_fresh`)."""
        n = self.params.poly_modulus_degree
        try:
            r = sealio.open_object(payload, 2 * self.top * n * 8 + 4096)
            raw = sealio.read_fresh_ct_members(r, n)
        except (WireError, ShapeError):
            return None
        seeded = isinstance(raw, sealio.SeededCiphertext)
        arr = raw.c0[None] if seeded else raw.data
        size, lev, _ = (2, *raw.c0.shape) if seeded else raw.data.shape
        if (r.pos != len(r.buf) or raw.correction_factor != 1 or lev != self.top or size != 2
                or self.ctx.parms_ids.get(lev) != raw.parms_id
                or (seeded and raw.prng_type != sealio.PRNG_BLAKE2XB)
                or not abs(raw.scale / self.scale - 1) <= 1e-9):   # (a NaN scale fails this test too)
            return None
        primes = np.asarray(self.ctx.primes[:lev], dtype=np.uint64).reshape(1, -1, 1)
        if np.any(arr >= primes):
            return None
        return (raw.c0, float(raw.scale), raw.seed) if seeded else (raw.data, float(raw.scale), None)

    def from_raw(self, raw: sealio.RawCiphertext) -> GpuCiphertext:
        size, lev, _ = raw.data.shape
        if self.ctx.parms_ids.get(lev) != raw.parms_id:
            raise WireError("ciphertext made for another prime chain")
        if size != 2:
            raise ShapeError(f"ciphertext of size {size} (expected 2)")
        primes = np.asarray(self.ctx.primes[:lev], dtype=np.uint64).reshape(1, -1, 1)
        if np.any(raw.data >= primes) or not np.isfinite(raw.scale) or raw.scale <= 0:
            raise WireError("ciphertext residue or scale out of range")
        return GpuCiphertext(torch.from_numpy(raw.data.astype(np.int64)).to(self.device), float(raw.scale))

    def load_keys(self, blobs: Mapping[str, bytes], rotation_steps: Iterable[int] | KeyLevels) -> GpuKeys:
        return load_keys(self.ctx, blobs, rotation_steps)

    def keys_from_server(self, server: ServerKeys) -> GpuKeys:
        """SEAL keys already through the allow-list (what the private worker holds) -> device keys."""
        return keys_from_server(self.ctx, server)


def make_evaluator(params: CKKSParams) -> GpuEvaluator:
    """The backend factory :func:`fhe.backends.evaluator_for` calls (CUDA when available)."""
    return GpuEvaluator(params)



@functools.cache
def _parse_pool() -> ThreadPoolExecutor:
    """Threads for parsing a step's uploads (:meth:`GpuEvaluator.deserialize_fresh_many`): the cores, up to 8."""
    return ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="ckks-parse")


__all__ = ["GpuCiphertext", "GpuEvaluator", "GpuPlaintext", "make_evaluator"]
