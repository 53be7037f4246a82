"""The weight maps of one encrypted attention block: the projections, RoPE + repack, V repack, the
output map and z's map, as slot maps (:mod:`fhe.linalg`) built in the clear from public geometry and
server-side weights, and the rotation steps (Galois keys) they need.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.config import ModelConfig
from fhe.geometry import Geometry
from fhe.linalg import HybridMatvec, SlotMap, Steps
from fhe.linalg import rotate_sum_steps as _rs_steps
from fhe.packing import BandLayout
from fhe.params import CKKSParams, KeyLevels


def _rope_triples(lay: BandLayout, src_of: np.ndarray, heads: np.ndarray):
    """RoPE + repack triples (dst, src, dim, is_sin, sign) into row 0, dest head ``heads[i]``.

    ``src_of[i, d]`` is the projection slot of the unrotated value for destination ``heads[i]``.
    rotate_half(x)_d = -x_{d+D/2} (d < D/2), x_{d-D/2} (d >= D/2).
    """
    d_half = lay.head_dim // 2
    dst, src, dim, is_sin, sign = [], [], [], [], []
    for i, h_dst in enumerate(heads):
        for d in range(lay.head_dim):
            partner, sg = (d + d_half, -1.0) if d < d_half else (d - d_half, 1.0)
            slot = int(lay.slot(d, 0, h_dst))
            dst += [slot, slot]
            src += [int(src_of[i, d]), int(src_of[i, partner])]
            dim += [d, d]
            is_sin += [False, True]
            sign += [1.0, sg]
    return tuple(np.asarray(a) for a in (dst, src, dim, is_sin, sign))


@dataclass
class RopeMap:
    """A repack slot map whose weights are cos/sin of the current position."""

    map: SlotMap
    dim: np.ndarray
    is_sin: np.ndarray
    sign: np.ndarray

    @classmethod
    def build(cls, lay: BandLayout, src_of: np.ndarray, heads: np.ndarray, steps: Steps) -> RopeMap:
        dst, src, dim, is_sin, sign = _rope_triples(lay, src_of, heads)
        return cls(SlotMap(lay.slots, dst, src, np.ones(len(dst)), steps), dim, is_sin, sign)

    def weights(self, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        return np.where(self.is_sin, sin[self.dim], cos[self.dim]) * self.sign


def _out_triples(lay: BandLayout, wo: np.ndarray):
    """Output map: u_h (row 0, dims d) -> y_h[o] = sum_d u_hd Wo[o, hD+d] at the output slots."""
    ys, _ = lay.output_slots()
    dst, src, w = [], [], []
    d = np.arange(lay.head_dim)
    for h in range(lay.num_heads):
        dst.append(np.repeat(ys[h], lay.head_dim))                        # [hidden*D], o-major
        src.append(np.tile(lay.slot(d, 0, h), lay.hidden))
        w.append(wo[:, h * lay.head_dim:(h + 1) * lay.head_dim].ravel())  # [hidden, D] row-major
    return np.concatenate(dst), np.concatenate(src), np.concatenate(w)


@dataclass
class BlockMaps:
    """The weight-dependent slot maps of one layer (built in the clear, encoded by the layer)."""

    qk: HybridMatvec
    v: HybridMatvec
    q_rope: RopeMap
    k_rope: RopeMap
    v_repack: SlotMap
    out: SlotMap
    z: SlotMap

    @classmethod
    def build(cls, geo: Geometry, wq: np.ndarray, wk: np.ndarray, wv: np.ndarray,
              wo: np.ndarray) -> BlockMaps:
        lay, s, e_n = geo.layout, geo.params.slots, geo.bands_per_period
        q_src, kv_src = geo.q_slots(), geo.kv_slots()
        qk = HybridMatvec(s, np.concatenate([wq, wk]), np.concatenate([q_src.ravel(), kv_src.ravel()]),
                          geo.period, geo.fold)
        v = HybridMatvec(s, wv, kv_src.ravel(), geo.period, geo.fold)
        q_steps = Steps(0, -(lay.band - lay.num_heads), e_n, s // 2, 2)
        kv_pre, kv_baby = int(geo.k_pos(0, 0)), geo.k_stride - lay.band
        k_steps = Steps(kv_pre, kv_baby, e_n, s // 2, 2)
        q_rope = RopeMap.build(lay, q_src, np.arange(lay.num_heads), q_steps)
        k_heads = np.arange(lay.num_kv_heads) * lay.group          # k_g lands on head G*g, then expanded
        k_rope = RopeMap.build(lay, kv_src, k_heads, k_steps)
        v_dst = lay.slot(np.arange(lay.head_dim)[None, :], 0, k_heads[:, None])
        v_repack = SlotMap(s, v_dst.ravel(), kv_src.ravel(), np.ones(v_dst.size), Steps(kv_pre, kv_baby, e_n))
        n_rows = lay.hidden // lay.head_dim
        # 9 x 64 diagonals: babies over rows and two bands, giants over band pairs (48 rotations, not 71)
        half = 2 if lay.head_dim % 2 == 0 else 1
        out = SlotMap(s, *_out_triples(lay, wo), Steps(0, -lay.num_heads, n_rows, half * lay.band,
                                                       lay.head_dim // half, lay.band, half))
        _, zs = lay.output_slots()
        z = SlotMap(s, zs, lay.slot(0, 0, np.arange(lay.num_heads)), np.ones(lay.num_heads),
                    Steps(0, -lay.num_heads, n_rows + 1))
        return cls(qk, v, q_rope, k_rope, v_repack, out, z)

    def rotation_steps(self, geo: Geometry) -> set[int]:
        lay = geo.layout
        steps = (self.qk.rotation_steps | self.v.rotation_steps | self.q_rope.map.rotation_steps
                 | self.k_rope.map.rotation_steps | self.v_repack.rotation_steps | self.out.rotation_steps
                 | self.z.rotation_steps)
        steps |= set(_rs_steps(lay.band, lay.head_dim))                   # sum over bands (tree)
        steps |= set(_rs_steps(-lay.num_heads, lay.block_tokens))         # copy q to all rows (tree)
        steps |= {-1, -lay.num_heads, lay.num_heads}                      # GQA expand, copy/roll, row sums
        return {s % geo.params.slots for s in steps} - {0}

    def rotation_levels(self, geo: Geometry) -> dict[int, int]:
        """Step (mod S) -> the highest level at which the block rotates by it: the level its Galois key is
        made at (:class:`fhe.params.KeyLevels`). Follows ``EncryptedAttentionLayer``: a slot map rotates at
        its input level and rescales after; a matvec folds after that rescale."""
        lay, top, lqk, lv, lu = geo.layout, geo.top, geo.level_qk, geo.level_v, geo.level_u
        uses = [
            (self.qk.map.rotation_steps, top),                                   # projection diagonals
            (_rs_steps(self.qk.window, self.qk.fold), top - 1),                  # its folds
            (self.q_rope.map.rotation_steps | self.k_rope.map.rotation_steps, top - 1),
            (_rs_steps(-lay.num_heads, lay.block_tokens), lqk),                  # copy q to all rows
            ({-1, -lay.num_heads}, lqk),                                         # GQA-expand k, roll K
            (self.v.map.rotation_steps, lv + 2),                                 # V from x at lv + 2
            (_rs_steps(self.v.window, self.v.fold), lv + 1),
            (self.v_repack.rotation_steps, lv + 1),
            ({-1, -lay.num_heads}, lv),                                          # GQA-expand v, roll V
            (_rs_steps(lay.band, lay.head_dim), lqk - 1),                        # band sums of q * K_b
            ({lay.num_heads}, lu),                                               # row sums of u and z
            (self.out.rotation_steps | self.z.rotation_steps, lu),               # output maps
        ]
        if geo.packed_chunk:  # packed prefill (fhe.packed): babies by +1 from the fresh input, giants by W
            uses += [({1}, top), ({lay.band}, top - 1),                          # after one rescale,
                     ({-lay.num_heads}, top - 1)]                                # q moved down rows
        levels: dict[int, int] = {}
        for steps, level in uses:
            for s in steps:
                s %= geo.params.slots
                if s:
                    levels[s] = max(levels.get(s, 0), level)
        return levels


def _ones_maps(geo: Geometry) -> BlockMaps:
    """The block's maps for all-ones weights: their structure (steps, levels) depends on shapes only."""
    lay = geo.layout
    n_q, n_kv = lay.num_heads * lay.head_dim, lay.num_kv_heads * lay.head_dim
    ones = np.ones
    return BlockMaps.build(geo, ones((n_q, lay.hidden)), ones((n_kv, lay.hidden)), ones((n_kv, lay.hidden)),
                           ones((lay.hidden, n_q)))


def block_key_levels(geo: Geometry, maps: BlockMaps) -> KeyLevels:
    """The block's key levels: every Galois key at its step's highest level, the relinearization key at
    q.k's level (the highest product: the squarings and p.V come below it)."""
    return KeyLevels.build(geo.params, maps.rotation_levels(geo), geo.level_qk)


def required_key_levels(cfg: ModelConfig, params: CKKSParams, kind: str = "sqexp",
                        squarings: int = 6) -> KeyLevels:
    """:func:`required_rotation_steps` with the level of each key (public, weight-independent)."""
    geo = Geometry.build(cfg, params, kind, squarings)
    return block_key_levels(geo, _ones_maps(geo))


def required_rotation_steps(cfg: ModelConfig, params: CKKSParams, kind: str = "sqexp",
                            squarings: int = 6) -> tuple[int, ...]:
    """Rotation steps (Galois keys) the block needs for this model shape: public, weight-independent."""
    geo = Geometry.build(cfg, params, kind, squarings)
    return tuple(sorted(_ones_maps(geo).rotation_steps(geo)))
