"""Several sessions' ciphertexts through one launch per operation (issue 16: batching across sessions).

The offload plan's linear steps (:mod:`fhe.mlp`, the client-aided attention's projections) are stateless
and share their plaintext diagonals across sessions; only the input ciphertexts and the key sets differ.
:class:`BatchedEvaluator` runs the evaluator protocol's linear-step operations (add, dot_plain,
mul_plain, rotate, rescale, mod_switch) on a :class:`GpuBatch` — ``data [B, size, L, N]``, one session per
row — so an :class:`fhe.linalg.EncodedMatvec` written for one ciphertext runs B sessions unchanged, each
kernel B times fuller. Key switching takes each row's own key: :class:`BatchKeys` stacks the sessions'
keys per Galois element into ``[B, Lk, 2, Lk+1, N]`` once per batch.

Every row's result is the one-session evaluator's, residue for residue (the same modular arithmetic on
canonical residues; tests/fhe/test_gpu_backend_batched.py checks it against the one-by-one path). Not
here: relinearization and hoisted rotations (the linear steps use neither). CUDA graphs of whole steps
per batch size: :mod:`fhe.backends.gpu.step`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from fhe.backends.gpu.evaluator import GpuCiphertext, GpuEvaluator, GpuPlaintext, _are_close
from fhe.backends.gpu.galois import galois_elt
from fhe.backends.gpu.keys import GpuKeys
from fhe.backends.gpu.keyswitch import expand
from fhe.backends.gpu.modarith import addmod, mulmod
from fhe.backends.gpu.rns import LevelTables, drop_last_rounded, intt, summod
from fhe.errors import KeyMismatchError, LevelError, ShapeError
from fhe.params import CKKSParams


@dataclass
class GpuBatch:
    """``data [B, size, L, N]`` int64 residues in NTT form (row b: session b's ciphertext); one scale."""

    data: torch.Tensor
    scale: float

    @property
    def level(self) -> int:
        return self.data.shape[-2]

    @property
    def batch(self) -> int:
        return self.data.shape[0]


@dataclass
class BatchKeys:
    """The sessions' key sets, row b = session b's, stacked per Galois element (``[B, Lk, 2, Lk+1, N]``)."""

    backend: ClassVar[str] = "gpu"
    params: CKKSParams
    galois: dict[int, torch.Tensor]
    batch: int

    @classmethod
    def of(cls, keys: Sequence[GpuKeys]) -> BatchKeys:
        """Stack ``keys`` (one per row, same parameters and Galois elements): B x the key set's bytes."""
        if not keys:
            raise ShapeError("a batch of no sessions")
        first = keys[0]
        if any(k.params != first.params or set(k.galois) != set(first.galois) for k in keys):
            raise KeyMismatchError("the sessions' key sets differ in parameters or Galois elements")
        galois = {e: torch.stack([k.galois[e] for k in keys]) for e in first.galois}
        return cls(first.params, galois, len(keys))

    @classmethod
    def shared(cls, keys: GpuKeys, batch: int) -> BatchKeys:
        """One key set for every row (a step's several positions): stride-0 views, no copy."""
        return cls(keys.params, {e: t.expand(batch, *t.shape) for e, t in keys.galois.items()}, batch)

    def galois_key(self, step: int, level: int) -> tuple[int, torch.Tensor]:
        elt = galois_elt(step, self.params.slots)
        if elt not in self.galois:
            raise KeyMismatchError(f"no Galois key for rotation step {step % self.params.slots}")
        key = self.galois[elt]
        if level > key.shape[1]:
            raise LevelError(f"rotation by {step} at level {level}: its key serves levels <= {key.shape[1]}")
        return elt, key

    def nbytes(self) -> int:
        return sum(t.numel() * 8 for t in self.galois.values())


class BatchedEvaluator(GpuEvaluator):
    """The linear-step operations of :class:`GpuEvaluator` over :class:`GpuBatch` rows (see module doc)."""

    def __init__(self, ev: GpuEvaluator) -> None:   # noqa: D107 - shares ev's context, tables and encoder
        self.__dict__.update(ev.__dict__)
        self.graphs = None

    # --- batches in and out ---------------------------------------------------------------------------
    def stack(self, cts: Sequence[GpuCiphertext]) -> GpuBatch:
        """One session's ciphertext per row (same size, level and scale, as fresh inputs are)."""
        if not cts or any(c.data.shape != cts[0].data.shape or not _are_close(c.scale, cts[0].scale) for c in cts):
            raise ShapeError("a batch needs ciphertexts of one size, level and scale")
        return GpuBatch(torch.stack([c.data for c in cts]), cts[0].scale)

    @staticmethod
    def unstack(batch: GpuBatch) -> list[GpuCiphertext]:
        return [GpuCiphertext(row.clone(), batch.scale) for row in batch.data]

    # --- queries --------------------------------------------------------------------------------------
    def level(self, ct: GpuBatch) -> int:
        return ct.data.shape[-2]

    def size(self, ct: GpuBatch) -> int:
        return ct.data.shape[-3]

    # --- arithmetic -------------------------------------------------------------------------------------
    def add(self, a: GpuBatch, b: GpuBatch) -> GpuBatch:
        self._same_level(a, b)
        if a.data.shape != b.data.shape or not _are_close(a.scale, b.scale):
            raise LevelError("batched add needs operands of one shape and scale")
        return GpuBatch(addmod(a.data, b.data, self._q(a.level)), a.scale)

    def add_many(self, cts: Sequence[GpuBatch]) -> GpuBatch:
        out = cts[0]
        for c in cts[1:]:
            out = self.add(out, c)
        return out

    def add_plain(self, ct: GpuBatch, pt: GpuPlaintext) -> GpuBatch:
        self._same_level(ct, pt)
        if not _are_close(ct.scale, pt.scale):
            raise LevelError(f"scales {ct.scale} and {pt.scale} differ")
        out = ct.data.clone()
        out[:, 0] = addmod(ct.data[:, 0], pt.data, self._q(ct.level))
        return GpuBatch(out, ct.scale)

    def mul_plain(self, ct: GpuBatch, pt: GpuPlaintext) -> GpuBatch:
        self._same_level(ct, pt)
        scale = self._check_scale(ct.scale * pt.scale, ct.level)
        return GpuBatch(mulmod(ct.data, pt.data, self._q(ct.level)), scale)

    def dot_plain(self, pairs: Sequence[tuple[GpuBatch, GpuPlaintext]]) -> GpuBatch:
        """sum_j c_j * p_j for every row: on CUDA one kernel for all rows and terms (rows folded into size)."""
        if not pairs:
            raise ShapeError("dot_plain of nothing")
        scales = []
        for c, p in pairs:                                           # mul_plain's and add's checks, in order
            self._same_level(c, p)
            scales.append(self._check_scale(c.scale * p.scale, c.level))
            if not _are_close(scales[0], scales[-1]) or c.data.shape != pairs[0][0].data.shape:
                raise LevelError("batched dot_plain needs operands of one shape and scale")
        if self.device.type != "cuda":
            return self.add_many([self.mul_plain(c, p) for c, p in pairs])
        from fhe.backends.gpu import triton_ops

        b, size, lev, n = pairs[0][0].data.shape
        c = torch.stack([x.data for x, _ in pairs]).view(len(pairs), b * size, lev, n)   # [K, B*size, L, N]
        p = torch.stack([x.data for _, x in pairs])                                      # [K, L, N]
        return GpuBatch(triton_ops.dot_rows(c, p, self.ctx.q.view(-1)).view(b, size, lev, n), scales[0])

    def rescale(self, ct: GpuBatch) -> GpuBatch:
        lev = ct.level
        if lev < 2:
            raise LevelError("cannot rescale at the last level")
        lt = self.ctx.level(lev)
        data = drop_last_rounded(ct.data, lt.data.take(slice(0, lev - 1)), lt.last, lt.inv_qlast,
                                 lt.q_ext_ints[lev - 1])
        return GpuBatch(data, self._check_scale(ct.scale / float(self.ctx.primes[lev - 1]), lev - 1))

    def mod_switch(self, ct: GpuBatch, level: int) -> GpuBatch:
        if level > ct.level or level < 1:
            raise LevelError(f"ciphertext at level {ct.level} cannot go to level {level}")
        return ct if level == ct.level else GpuBatch(ct.data[..., :level, :].clone(), ct.scale)

    def rotate(self, ct: GpuBatch, step: int, keys: BatchKeys) -> GpuBatch:
        if step % self.slots == 0:
            return ct
        if self.size(ct) != 2:
            raise LevelError("rotate needs a ciphertext of size 2 (relinearize first)")
        if keys.batch != ct.batch:
            raise ShapeError(f"{ct.batch} rows but {keys.batch} key sets")
        elt, key = keys.galois_key(step, ct.level)
        perm, lt, q = self._perm(elt), self.ctx.level(ct.level), self._q(ct.level)
        rotated = ct.data[..., perm]                                  # sigma on every row's c0 and c1
        delta = switch_key(rotated[:, 1], key, lt)                    # [B, 2, L, N]
        if delta.is_cuda and triton_ops_addsub(delta[:, 0], rotated[:, 0], q):
            return GpuBatch(delta, ct.scale)
        delta[:, 0] = addmod(delta[:, 0], rotated[:, 0], q)
        return GpuBatch(delta, ct.scale)

    def rotate_many(self, ct: GpuBatch, steps, keys: BatchKeys) -> dict[int, GpuBatch]:
        return {int(s): self.rotate(ct, int(s), keys) for s in steps}   # not hoisted: the linear steps need none


def triton_ops_addsub(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor) -> bool:
    """a += b mod q in place with one launch where the layout allows (False: nothing done)."""
    from fhe.backends.gpu import triton_ops

    return triton_ops.FUSED and triton_ops.addsub_rows(a, b, q.view(-1).contiguous(), out=a) is not None


def switch_key(t: torch.Tensor, key: torch.Tensor, lt: LevelTables) -> torch.Tensor:
    """Row b's ``t [B, L, N]`` switched with row b's ``key [B, Lk, 2, Lk+1, N]`` -> ``[B, 2, L, N]``
    (:func:`fhe.backends.gpu.keyswitch.switch_key` per row, the same digits, products and rounding)."""
    digits = expand(intt(t, lt.data), t, lt)                          # [B, L, L+1, N]
    acc = inner_product(digits, key, lt)                              # [B, 2, L+1, N]
    return drop_last_rounded(acc, lt.data, lt.special, lt.inv_p, lt.q_ext_ints[-1])


def inner_product(D: torch.Tensor, key: torch.Tensor, lt: LevelTables) -> torch.Tensor:
    """acc [B, 2, L+1, N] = sum_J D[b, J] * key[b, J] over the ext rows (the special prime: key's last row)."""
    lev = D.shape[1]
    q = lt.ext.primes
    if D.is_cuda:
        from fhe.backends.gpu import triton_ops

        return triton_ops.inner_product(D.contiguous(), key, q.view(-1).contiguous())
    data = mulmod(D[:, :, None, :lev], key[:, :lev, :, :lev], q[:lev], None)        # [B, L, 2, L, N]
    spec = mulmod(D[:, :, None, lev:], key[:, :lev, :, -1:], q[lev:], None)          # [B, L, 2, 1, N]
    return torch.cat((summod(data, q[:lev], dim=1), summod(spec, q[lev:], dim=1)), dim=2)





def run_linear(bev: BatchedEvaluator, encoded, batch: GpuBatch, keys: BatchKeys, level: int = 1) -> GpuBatch:
    """One linear step (an :class:`fhe.linalg.EncodedMatvec`, encoded once with the one-session evaluator
    whose plaintexts ``bev`` shares) over every row, mod-switched to ``level`` (the steps' smallest download)."""
    return bev.mod_switch(encoded(bev, batch, keys), level)


__all__ = ["BatchKeys", "BatchedEvaluator", "GpuBatch", "inner_product", "run_linear", "switch_key"]
