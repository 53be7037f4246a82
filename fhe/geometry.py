"""Geometry of the encrypted attention block: where every value sits, and at which level.

Depends only on public shapes (the model config) and the CKKS parameters, never on weights or a
backend. Slot layouts are drawn in ``docs/fhe.md`` §2; the band layout itself is :mod:`fhe.packing`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.config import ModelConfig
from fhe.errors import ParameterError, ShapeError
from fhe.packing import BandLayout
from fhe.params import CKKSParams, block_depth, min_block_depth, score_depth


def packed_chunk_of(lay: BandLayout) -> int:
    """Tokens per packed prefill ciphertext for a band layout: B, or 0 (no packed path)."""
    ok = lay.hidden % lay.head_dim == 0 and lay.hidden // lay.head_dim <= lay.num_heads
    return lay.block_tokens if ok else 0


def packed_chunk_for(cfg: ModelConfig, params: CKKSParams) -> int:
    """:func:`packed_chunk_of` from public facts only (the server's step check and its manifest)."""
    return packed_chunk_of(BandLayout(params.slots, cfg.hidden_size, cfg.num_attention_heads,
                                      cfg.num_key_value_heads, cfg.head_dim))


@dataclass(frozen=True)
class Geometry:
    """Everything about the block's layout that depends only on public shapes and parameters.

    The input period P is the smallest ``W * 2^i >= hidden`` dividing S (E = P/W bands per period,
    so the projection's ``fold = E`` partial sums wrap cyclically). Projection outputs (d = E*p + e):
    ``q_hd`` at ``P*p + h + Hq*e``, ``k_gd`` / ``v_gd`` at ``P*p + Hq*E + G*g + s_k*e`` (G query
    heads per KV head, ``s_k = G*(Hkv-1) + 1``), chosen so that moving them to row 0 of band d needs
    rotations by only ``-(W - Hq)*e`` (q) or ``Hq*E + (s_k - W)*e`` (k, v), plus S/2 for RoPE's
    partner dims: few diagonals, few Galois keys.
    """

    params: CKKSParams
    layout: BandLayout
    period: int
    squarings: int
    #: polyexp at one level less than :func:`fhe.params.block_depth`: ``p * V`` folded into P (the V cache
    #: then sits at level_qk beside K, and u comes out at level_p)
    fold_v: bool = False

    @classmethod
    def build(cls, cfg: ModelConfig, params: CKKSParams, kind: str, squarings: int) -> Geometry:
        lay = BandLayout(params.slots, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                         cfg.head_dim)
        if params.depth < min_block_depth(kind, squarings):
            raise ParameterError(f"{params} has depth {params.depth} < {min_block_depth(kind, squarings)}")
        period = lay.band
        while period < lay.hidden:
            period *= 2
        fold_v = params.depth < block_depth(kind, squarings)
        geo = cls(params, lay, period, score_depth(kind, squarings), fold_v)
        if params.slots % period or geo.k_pos(lay.num_kv_heads - 1, geo.bands_per_period - 1) >= lay.band:
            raise ShapeError(f"model shape {lay} does not fit the band layout at "
                             f"N = {params.poly_modulus_degree}")
        return geo

    @property
    def bands_per_period(self) -> int:
        """E = P / W."""
        return self.period // self.layout.band

    @property
    def fold(self) -> int:
        """Partial sums per projection output: P / w, w = the smallest power of two above every output's
        in-period position (fewer offsets = fewer top-level rotations than w = W)."""
        top = int(self.k_pos(self.layout.num_kv_heads - 1, self.bands_per_period - 1)) + 1
        w = 1
        while w < top:
            w *= 2
        return self.period // w

    @property
    def k_stride(self) -> int:
        lay = self.layout
        return lay.group * (lay.num_kv_heads - 1) + 1

    def k_pos(self, g, e):
        """In-band position of k/v of KV head g, dim class e, in the projection output."""
        lay = self.layout
        base = lay.num_heads * self.bands_per_period
        return base + lay.group * np.asarray(g) + self.k_stride * np.asarray(e)

    def q_slots(self) -> np.ndarray:
        """[Hq, D] projection output slots of q."""
        lay = self.layout
        h, d = np.meshgrid(np.arange(lay.num_heads), np.arange(lay.head_dim), indexing="ij")
        p, e = np.divmod(d, self.bands_per_period)
        return self.period * p + h + lay.num_heads * e

    def kv_slots(self) -> np.ndarray:
        """[Hkv, D] projection output slots of k (and, in their own ciphertext, v)."""
        lay = self.layout
        g, d = np.meshgrid(np.arange(lay.num_kv_heads), np.arange(lay.head_dim), indexing="ij")
        p, e = np.divmod(d, self.bands_per_period)
        return self.period * p + self.k_pos(g, e)

    @property
    def packed_chunk(self) -> int:
        """Tokens per packed prefill ciphertext (:mod:`fhe.packed`): B, or 0 where a token's hidden vector
        does not fit one band row per head dim (hidden must be k*D with k <= Hq)."""
        return packed_chunk_of(self.layout)

    def packed_input_slots(self, n: int) -> np.ndarray:
        """[n, hidden] slots of a packed chunk's input: token i (position start + i) on row n-1-i (newest in
        row 0, as in the cache), hidden index h'*D + d' at ``slot(d', row, h') + Hq - 1`` (the shift makes
        every in-row offset of the projection non-negative: its babies need only the +1 key)."""
        lay = self.layout
        if not self.packed_chunk or not 1 <= n <= self.packed_chunk:
            raise ShapeError(f"a packed chunk holds 1..{self.packed_chunk} tokens, got {n}")
        i = np.arange(lay.hidden)
        rows = (n - 1 - np.arange(n))[:, None]
        return (lay.slot(i % lay.head_dim, rows, i // lay.head_dim) + lay.num_heads - 1) % lay.slots

    # levels (number of data primes) at each stage
    @property
    def top(self) -> int:
        return self.params.depth + 1

    @property
    def level_qk(self) -> int:
        """Level of q, k after projection + repack."""
        return self.top - 2

    @property
    def level_p(self) -> int:
        """Level of p (after q.k and the squarings)."""
        return self.level_qk - 1 - self.squarings

    @property
    def level_v(self) -> int:
        """Level of the V cache: level_p (p * V one level below), or level_qk with ``fold_v`` (P(s) * V
        takes v one level above s)."""
        return self.level_qk if self.fold_v else self.level_p

    @property
    def level_u(self) -> int:
        """Level of u = sum_j p_j v_j and of z's row sum (the output maps' input; the output is one lower)."""
        return self.level_p if self.fold_v else self.level_p - 1
