"""The encrypted attention block of one Llama-family layer, with a per-session encrypted KV cache.

Server side (:class:`EncryptedAttentionLayer`, public keys only), per token at position t:

1. ``qk = W_qk x``           hybrid BSGS product from the replicated input (level L -> L-1); Wq rows
   carry the RMSNorm gain, the head's scale ``alpha_h / sqrt(D)`` and the normalizer gamma^(1/n).
2. RoPE + repack             two slot maps with position-dependent weights (cos/sin at t) put q and
   the GQA-expanded k in token row 0 of the band layout (L-1 -> L-2); V likewise on a lower level.
3. q is copied to all B rows; k, v enter the session's current cache block (the block's rows are
   rolled down by one row first, so the newest token is always row 0).
4. per cache block: ``s = q * K_b`` (relin, rescale), summed over the 64 bands (every band then
   holds s_hj), ``+ beta_h`` on valid rows, the squarings (sqexp: R; 2quad: 1), then ``p * V_b``.
5. sum over blocks (one relinearization), over token rows -> ``u_h = sum_j p_hj v_j`` in row 0,
   and the same row sum of p -> ``z_h``; the output map applies Wo_h per head and places ``y_h``
   and ``z_h`` in the output layout (last level).

Client side (:class:`BlockClient`): encrypt the replicated normalized residual, decrypt, and finish:
``attn_out = sum_h y_h / z_h``. Both sides are checked against ``fhe.simulator.simulate_block``.
Layouts: :mod:`fhe.packing`; costs and what each side learns: ``docs/fhe.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.config import ModelConfig
from engine.model import DecoderLayer, RotaryEmbedding
from fhe.ckks import CKKSClient, ServerKeys
from fhe.errors import LevelError, OutputRangeError, ParameterError, PlanMismatchError, ShapeError
from fhe.hazmat.seal import Ciphertext, Kit
from fhe.linalg import HybridMatvec, SlotMap, Steps, replicate_input, rotate_sum
from fhe.linalg import rotate_sum_steps as _rs_steps
from fhe.packing import BandLayout
from fhe.params import CKKSParams, block_depth
from fhe.plan import LayerPlan, Plan
from fhe.simulator import BlockWeights, block_weights

#: Outputs (y, z) must stay below 2^(first prime - scale - 2) at the last level.
OUTPUT_HEADROOM_BITS = 2
#: Margin over the plan's observed max of a s + b when sizing p (calibration's own margin is 1.25).
X_MARGIN = 1.5
#: Margin over the plan's observed largest denominator and normalized output when sizing p.
OUTPUT_MARGIN = 2.0


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

    @classmethod
    def build(cls, cfg: ModelConfig, params: CKKSParams, kind: str, squarings: int) -> Geometry:
        lay = BandLayout(params.slots, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                         cfg.head_dim)
        if params.depth < block_depth(kind, squarings):
            raise ParameterError(f"{params} has depth {params.depth} < {block_depth(kind, squarings)}")
        period = lay.band
        while period < lay.hidden:
            period *= 2
        geo = cls(params, lay, period, squarings if kind == "sqexp" else 1)
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
        """Level of p (after q.k and the squarings) = level of the V cache."""
        return self.level_qk - 1 - self.squarings


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
class _RopeMap:
    """A repack slot map whose weights are cos/sin of the current position."""

    map: SlotMap
    dim: np.ndarray
    is_sin: np.ndarray
    sign: np.ndarray

    @classmethod
    def build(cls, lay: BandLayout, src_of: np.ndarray, heads: np.ndarray, steps: Steps) -> _RopeMap:
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
    q_rope: _RopeMap
    k_rope: _RopeMap
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
        q_rope = _RopeMap.build(lay, q_src, np.arange(lay.num_heads), q_steps)
        k_heads = np.arange(lay.num_kv_heads) * lay.group          # k_g lands on head G*g, then expanded
        k_rope = _RopeMap.build(lay, kv_src, k_heads, k_steps)
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


def required_rotation_steps(cfg: ModelConfig, params: CKKSParams, kind: str = "sqexp",
                            squarings: int = 6) -> tuple[int, ...]:
    """Rotation steps (Galois keys) the block needs for this model shape: public, weight-independent."""
    geo = Geometry.build(cfg, params, kind, squarings)
    lay = geo.layout
    n_q, n_kv = lay.num_heads * lay.head_dim, lay.num_kv_heads * lay.head_dim
    ones = np.ones
    maps = BlockMaps.build(geo, ones((n_q, lay.hidden)), ones((n_kv, lay.hidden)), ones((n_kv, lay.hidden)),
                           ones((lay.hidden, n_q)))
    return tuple(sorted(maps.rotation_steps(geo)))


def _base_max(plan: LayerPlan) -> float:
    """Largest squared base on the calibrated range: the plan's observed max of x = a s + b (times
    :data:`X_MARGIN`, capped by the bound) when it has one, else the bound."""
    approx = plan.approx
    x_hi = approx.bound
    if plan.observed_range is not None:
        x_hi = min(approx.bound, X_MARGIN * max(abs(plan.observed_range[1]), 1.0))
    return 1.0 + x_hi / 2 ** approx.squarings if approx.kind == "sqexp" else max(approx.bound, 1e-6)


def _fold_scores(bw: BlockWeights, plan: LayerPlan, g: float, boost: float = 1.0):
    """Fold the score scaling into the projections: Wq, bq, Wk, bk and beta, all float64.

    The squared base is ``g * (alpha_h s + beta_h)`` with ``s = q.k / sqrt(D)``; the factor
    ``f_h = g * alpha_h / sqrt(D)`` is split between q and k (k's share per KV head ``c_g =
    sqrt(max_h |f_h|)``). Both are further multiplied by ``boost``: q and k then carry ``boost`` times
    larger values over the same absolute CKKS noise, and the q.k rescale by a prime ``boost^2`` times the
    scale takes the factor back out (see :meth:`EncryptedAttentionLayer._scale_chain`). Exact
    normalization on the client cancels the common factor g^n (n = 2^squarings).
    """
    approx = plan.approx
    alpha, beta = (np.asarray(v, np.float64) for v in approx.base_affine())
    f = alpha * g / math.sqrt(bw.head_dim)                                   # [Hq]
    grp = bw.num_heads // bw.num_kv_heads
    c = np.sqrt(np.abs(f).reshape(bw.num_kv_heads, grp).max(1)).clip(1e-12)  # [Hkv]
    fq = np.repeat(f / np.repeat(c, grp), bw.head_dim) * boost               # [Hq*D]
    fk = np.repeat(c, bw.head_dim) * boost                                   # [Hkv*D]

    def scaled(w, b, per_row):
        return w.numpy() * per_row[:, None], None if b is None else b.numpy() * per_row

    wq, bq = scaled(bw.wq, bw.bq, fq)
    wk, bk = scaled(bw.wk, bw.bk, fk)
    return wq, bq, wk, bk, beta * g


def _value_gain(bw: BlockWeights) -> float:
    """Bound on max_o |y_h[o]| / z_h: max over heads and outputs of ||(Wo_h Wv_g)[o, :]||_2 * sqrt(hidden).

    (y_h / z_h is a convex combination of v_j Wo_h, and a normalized input has norm sqrt(hidden).)
    """
    d, g = bw.head_dim, bw.num_heads // bw.num_kv_heads
    worst = 0.0
    for h in range(bw.num_heads):
        m = bw.wo[:, h * d:(h + 1) * d] @ bw.wv[(h // g) * d:(h // g + 1) * d]   # [hidden, hidden]
        worst = max(worst, float(m.norm(dim=1).max()))
    return worst * math.sqrt(bw.wq.shape[1])


@dataclass(frozen=True)
class _Extent:
    """Bounds on the block's outputs in the score map's units (p_j <= ``p_max``): z <= tokens * p_max and
    |y_h| <= z * ``gain`` always; when the plan measured them, z <= margin * z_obs and |y_h| <= z * margin
    * out_obs on its data, usually far tighter (SmolLM2 layers 2-5: out_obs ~5 vs gain ~100, z_obs ~1)."""

    p_max: float
    gain: float
    z_obs: float = math.inf
    out_obs: float = math.inf

    @classmethod
    def build(cls, plan: LayerPlan, p_max: float, gain: float) -> _Extent:
        if plan.observed_output is None:
            return cls(p_max, gain)
        z_obs, out_obs = plan.observed_output
        return cls(p_max, gain, OUTPUT_MARGIN * z_obs, OUTPUT_MARGIN * out_obs)

    def worst(self, tokens: int) -> float:
        """Worst-case max(z, |y|) at this context length (what the setup sizes g for)."""
        return tokens * self.p_max * self.gain

    def sized(self, tokens: int) -> float:
        """The bound a step at this context length sizes p for."""
        return min(tokens * self.p_max, self.z_obs) * max(1.0, min(self.gain, self.out_obs))


@dataclass
class EncryptedKVCache:
    """One session's encrypted K/V blocks for one layer (server memory; never leaves the server)."""

    block_tokens: int
    max_tokens: int
    k_blocks: list[Ciphertext] = field(default_factory=list)
    v_blocks: list[Ciphertext] = field(default_factory=list)
    length: int = 0

    def rows_in(self, b: int) -> int:
        """Tokens held by block b."""
        return min(self.block_tokens, self.length - b * self.block_tokens)

    def nbytes(self) -> int:
        """Approximate in-memory size (2 polynomials per ciphertext)."""
        return sum(2 * c.coeff_modulus_size() * c.poly_modulus_degree() * 8
                   for c in self.k_blocks + self.v_blocks)


class EncryptedAttentionLayer:
    """Server side of one encrypted attention block (holds plaintext weights, never a secret key).

    Args:
        layer: the model's decoder layer (weights; the plan's adjusted weights win).
        rope: the model's rotary embedding.
        layer_plan: the layer's approximation (``sqexp`` or ``2quad``) and adjusted weights.
        cfg: the model config.
        params: CKKS parameters (``ckks_params_for(kind, squarings)`` or the plan's).
    """

    def __init__(self, layer: DecoderLayer, rope: RotaryEmbedding, layer_plan: LayerPlan, cfg: ModelConfig,
                 params: CKKSParams, max_tokens: int = 1024) -> None:
        approx = layer_plan.approx
        if approx.kind not in ("sqexp", "2quad"):
            raise ParameterError(f"approximation {approx.kind!r} has no encrypted form")
        self.geo = Geometry.build(cfg, params, approx.kind, approx.squarings)
        self.kit = Kit(params)
        self.rope = rope
        self.index = layer_plan.index
        bw = block_weights(layer, layer_plan, torch.float64)
        self.max_tokens = max_tokens
        limit = 2.0 ** (params.coeff_mod_bit_sizes[0] - params.scale_bits - OUTPUT_HEADROOM_BITS)
        # p <= limit / bound keeps y, z below the last prime: g is sized for the worst case at max_tokens
        # here and raised per step to the plan's observed extent at the current context (:meth:`_step_gain`)
        self._n = 2 ** approx.num_squarings
        # q and k are computed qk_boost times larger; the q.k rescale by a prime of qk_boost^2 * scale
        # brings the product back (1 with uniform primes; a larger q.k prime buys q/k precision)
        self._qk_boost = math.sqrt(self.kit.prime(self.geo.level_qk) / self.kit.scale)
        self._extent = _Extent.build(layer_plan, _base_max(layer_plan) ** self._n, max(1.0, _value_gain(bw)))
        g = (limit / self._extent.worst(max_tokens)) ** (1.0 / self._n)
        wq, bq, wk, bk, self.beta = _fold_scores(bw, layer_plan, g, self._qk_boost)
        self.maps = BlockMaps.build(self.geo, wq, wk, bw.wv.numpy(), bw.wo.numpy())
        self._v_bias = None if bw.bv is None else bw.bv.numpy()
        self._bias = self._bias_vector(bq, bk)
        self._encode_static()

    @classmethod
    def from_plan(cls, model, plan: Plan, index: int, params: CKKSParams, *, expected_hash: str | None = None,
                  max_tokens: int = 1024) -> EncryptedAttentionLayer:
        """The block of layer ``index`` of a plan; PlanMismatchError if the plan is not the expected one."""
        if expected_hash is not None and plan.content_hash != expected_hash:
            raise PlanMismatchError(f"plan hash {plan.content_hash[:16]}... != "
                                    f"expected {expected_hash[:16]}...")
        layer = cls(model.layers[index], model.rotary, plan.layer(index), model.config, params, max_tokens)
        layer.plan_hash = plan.content_hash
        return layer

    def check_plan_hash(self, plan_hash: str) -> None:
        """Requests name the plan they were made for: refuse any other (PlanMismatchError)."""
        if plan_hash != getattr(self, "plan_hash", None):
            raise PlanMismatchError("request names another plan than the one this block was built from")

    # --- setup ---------------------------------------------------------------------------
    def _bias_vector(self, bq: np.ndarray | None, bk: np.ndarray | None) -> np.ndarray | None:
        if bq is None and bk is None:
            return None
        vec = np.zeros(self.kit.slots)
        vec[self.geo.q_slots().ravel()] = 0.0 if bq is None else bq
        vec[self.geo.kv_slots().ravel()] = 0.0 if bk is None else bk
        return vec

    def _scale_chain(self) -> None:
        """Scales after each stage, computed exactly as SEAL does (double ops)."""
        kit, geo = self.kit, self.geo
        delta = kit.scale
        s = delta * delta * self._qk_boost ** 2 / kit.prime(geo.level_qk)   # after q*K rescale (= delta)
        self.scale_s = s
        lvl = geo.level_qk - 1
        for _ in range(geo.squarings):
            s = s * s / kit.prime(lvl)
            lvl -= 1
        self.scale_p = s
        self.scale_u = s * delta / kit.prime(geo.level_p)

    def _encode_static(self) -> None:
        kit, geo, m = self.kit, self.geo, self.maps
        self._scale_chain()
        self.enc_qk = m.qk.encode(kit, geo.top)
        self.enc_v = m.v.encode(kit, geo.level_p + 2)
        self.enc_v_repack = m.v_repack.encode(kit, geo.level_p + 1)
        self.enc_out = m.out.encode(kit, geo.level_p - 1)
        self.enc_z = m.z.encode(kit, geo.level_p - 1, extra_scale=self.scale_u / self.scale_p)
        self._beta_cache: dict[int, object] = {}

    @property
    def rotation_steps(self) -> set[int]:
        return self.maps.rotation_steps(self.geo)

    def new_cache(self) -> EncryptedKVCache:
        """An empty per-session cache for this layer (holds up to ``max_tokens``)."""
        return EncryptedKVCache(self.geo.layout.block_tokens, self.max_tokens)

    # --- evaluation ------------------------------------------------------------------------
    def forward(self, cache: EncryptedKVCache, ct: Ciphertext, position: int, keys: ServerKeys) -> Ciphertext:
        """One token: input ciphertext (client layout) at ``position`` -> output ciphertext (y, z).

        The token's K/V are appended to ``cache`` (``position`` must equal ``cache.length``).
        """
        if position != cache.length:
            raise ShapeError(f"position {position} but the cache holds {cache.length} tokens")
        if cache.length >= cache.max_tokens:
            raise ShapeError(f"session cache full ({cache.max_tokens} tokens)")
        keys.check_input(ct)
        if keys.params != self.kit.params:
            raise LevelError("keys were made for other CKKS parameters")
        q, k0, v0 = self._project(ct, position, keys)
        self._insert(cache, k0, v0, keys)
        return self._attend(cache, q, keys)

    def prefill(self, cache: EncryptedKVCache, cts: list[Ciphertext], start: int,
                keys: ServerKeys) -> list[Ciphertext]:
        """Several tokens in order (causal: each attends to the cache so far and itself)."""
        return [self.forward(cache, c, start + i, keys) for i, c in enumerate(cts)]

    def _project(self, ct: Ciphertext, position: int, keys: ServerKeys):
        kit, geo, gk, lay = self.kit, self.geo, keys.galois, self.geo.layout
        qk = self.enc_qk(kit, ct, gk)
        qk.scale = kit.scale
        if self._bias is not None:
            qk = kit.add_plain_values(qk, self._bias)
        cos, sin = (t[0].double().numpy() for t in self.rope.cos_sin(torch.tensor([position])))
        w_q = self.maps.q_rope.weights(cos, sin) * self._step_gain(position + 1)
        q0 = self.maps.q_rope.map.encode(kit, geo.top - 1, w_q)(kit, qk, gk)
        k0 = self.maps.k_rope.map.encode(kit, geo.top - 1, self.maps.k_rope.weights(cos, sin))(kit, qk, gk)
        q0.scale = k0.scale = kit.scale
        q = rotate_sum(kit, q0, -lay.num_heads, lay.block_tokens, gk)      # tree: this level is expensive
        k0 = rotate_sum(kit, k0, -1, lay.group, gk, horner=True)          # GQA: k_g to its G heads
        xv = kit.drop_to(ct, geo.level_p + 2)
        v = self.enc_v(kit, xv, gk)
        v.scale = kit.scale
        if self._v_bias is not None:
            vec = np.zeros(kit.slots)
            vec[geo.kv_slots().ravel()] = self._v_bias
            v = kit.add_plain_values(v, vec)
        v0 = rotate_sum(kit, self.enc_v_repack(kit, v, gk), -1, lay.group, gk, horner=True)
        v0.scale = kit.scale
        return q, k0, v0

    def _insert(self, cache: EncryptedKVCache, k0: Ciphertext, v0: Ciphertext, keys: ServerKeys) -> None:
        kit, lay = self.kit, self.geo.layout
        if cache.length % lay.block_tokens == 0:
            cache.k_blocks.append(k0)
            cache.v_blocks.append(v0)
        else:  # roll rows down by one (the block is not full, nothing crosses a band)
            cache.k_blocks[-1] = kit.add(kit.rotate(cache.k_blocks[-1], -lay.num_heads, keys.galois), k0)
            cache.v_blocks[-1] = kit.add(kit.rotate(cache.v_blocks[-1], -lay.num_heads, keys.galois), v0)
        cache.length += 1

    def _step_gain(self, tokens: int) -> float:
        """Extra factor (>= 1) on the base at a context of ``tokens``: p is sized for this step's bound on
        max(z, |y|) instead of the setup's worst case, so it sits further above the noise floor."""
        ext = self._extent
        return (ext.worst(self.max_tokens) / ext.sized(max(1, tokens))) ** (1.0 / self._n)

    def _beta(self, rows: int, tokens: int):
        """Plaintext beta_h (times the step gain) on the first ``rows`` rows (cached within a step)."""
        key = (rows, tokens)
        if key not in self._beta_cache:
            if len(self._beta_cache) > 64:
                self._beta_cache.clear()
            vec = self.geo.layout.valid(rows, self.beta * self._step_gain(tokens))
            self._beta_cache[key] = self.kit.encode(vec, self.geo.level_qk - 1, self.scale_s)
        return self._beta_cache[key]

    def _block_p(self, q: Ciphertext, k_b: Ciphertext, rows: int, tokens: int,
                 keys: ServerKeys) -> Ciphertext:
        """Unnormalized weights p of one cache block, broadcast over all bands (level_p)."""
        kit, lay = self.kit, self.geo.layout
        s = kit.relin_rescale(kit.mul(q, k_b), keys.relin)
        s = rotate_sum(kit, s, lay.band, lay.head_dim, keys.galois)
        s.scale = self.scale_s
        kit.evaluator.add_plain_inplace(s, self._beta(rows, tokens))
        for _ in range(self.geo.squarings):
            kit.evaluator.square_inplace(s)
            s = kit.relin_rescale(s, keys.relin)
        s.scale = self.scale_p
        return s

    def _attend(self, cache: EncryptedKVCache, q: Ciphertext, keys: ServerKeys) -> Ciphertext:
        if cache.length == 1:
            return self._attend_single(cache, keys)
        kit, lay, gk = self.kit, self.geo.layout, keys.galois
        pv, ps = [], []
        for b, (k_b, v_b) in enumerate(zip(cache.k_blocks, cache.v_blocks, strict=True)):
            p = self._block_p(q, k_b, cache.rows_in(b), cache.length, keys)
            pv.append(kit.mul(p, v_b))
            ps.append(p)
        u = kit.relin_rescale(kit.add_many(pv), keys.relin)
        u = rotate_sum(kit, u, lay.num_heads, lay.block_tokens, gk, horner=True)
        u.scale = self.scale_u
        # z's row sum runs one level lower (where the z map reads it): same values, cheaper rotations
        z = kit.drop_to(kit.add_many(ps), self.geo.level_p - 1)
        z = rotate_sum(kit, z, lay.num_heads, lay.block_tokens, gk, horner=True)
        y = self.enc_out(kit, u, gk)
        zo = self.enc_z(kit, z, gk)
        zo.scale = y.scale
        return kit.add(y, zo)

    def _attend_single(self, cache: EncryptedKVCache, keys: ServerKeys) -> Ciphertext:
        """The first token attends only to itself: its normalized weight is exactly 1 for any p > 0,
        so the block returns y_h = v_0 Wo_h, z_h = 1 (the same quotient as the simulator's) without
        the score path — which would otherwise drown a tiny p_00 in CKKS noise."""
        kit, lay = self.kit, self.geo.layout
        v = cache.v_blocks[0]
        lvl = self.geo.level_p
        mask = kit.encode(lay.valid(1), lvl, self.scale_u * kit.prime(lvl) / v.scale)
        u = kit.mul_plain(v, mask)
        kit.evaluator.rescale_to_next_inplace(u)
        u.scale = self.scale_u
        y = self.enc_out(kit, u, keys.galois)
        ones = np.zeros(kit.slots)
        ones[lay.output_slots()[1]] = 1.0
        return kit.add_plain_values(y, ones)


@dataclass
class BlockClient:
    """Client side of the encrypted blocks: input layout, decryption and the exact normalization."""

    client: CKKSClient
    layout: BandLayout
    period: int

    @classmethod
    def for_model(cls, client: CKKSClient, cfg: ModelConfig, kind: str = "sqexp",
                  squarings: int = 6) -> BlockClient:
        geo = Geometry.build(cfg, client.params, kind, squarings)
        return cls(client, geo.layout, geo.period)

    def layout_input(self, x_row: torch.Tensor) -> np.ndarray:
        """One token's x̂ [hidden] -> its input slot vector [S] (replicated with the block's period)."""
        return replicate_input(x_row.detach().double().cpu().numpy(), self.layout.slots, self.period)

    def encrypt_input(self, x_normed: torch.Tensor) -> list[Ciphertext]:
        """x̂ [T, hidden] (RMS-normalized residual, no gain) -> one ciphertext per token."""
        if x_normed.ndim != 2 or x_normed.shape[1] != self.layout.hidden:
            raise ShapeError(f"expected [T, {self.layout.hidden}], got {tuple(x_normed.shape)}")
        x = x_normed.detach().double().cpu().numpy()
        return [self.client.encrypt(replicate_input(row, self.layout.slots, self.period)) for row in x]

    def decrypt_output(self, cts: list[Ciphertext]) -> tuple[torch.Tensor, torch.Tensor]:
        """Output ciphertexts -> y [T, Hq, hidden], z [T, Hq] (float64)."""
        ys, zs = zip(*(self.layout.split_output(self.client.decrypt(c)) for c in cts), strict=True)
        return torch.from_numpy(np.stack(ys)), torch.from_numpy(np.stack(zs))

    @staticmethod
    def finish(y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """attn_out [T, hidden] = sum_h y_h / z_h (the exact normalization, on the client).

        Every z_h is a sum of positive weights; a z <= 0 or a non-finite value means the server's
        values overflowed the last prime (inputs far outside the plan's calibrated range) or were
        tampered with: OutputRangeError rather than a silently wrong token.
        """
        if not (torch.isfinite(y).all() and torch.isfinite(z).all() and (z > 0).all()):
            raise OutputRangeError("decrypted attention output out of range (z <= 0 or not finite)")
        return (y / z[..., None]).sum(1)
