"""The server layer of the encrypted attention block of one Llama-family layer.

Server side (:class:`EncryptedAttentionLayer`, public keys only), per token at position t:

1. ``qk = W_qk x``           hybrid BSGS product from the replicated input (level L -> L-1); Wq rows
   carry the RMSNorm gain, the head's scale ``alpha_h / sqrt(D)`` and the normalizer gamma^(1/n).
2. RoPE + repack             two slot maps with position-dependent weights (cos/sin at t) put q and
   the GQA-expanded k in token row 0 of the band layout (L-1 -> L-2); V likewise on a lower level.
3. q is copied to all B rows; k, v enter the session's current cache block (the block's rows are
   rolled down by one row first, so the newest token is always row 0).
4. per cache block: ``s = q * K_b`` (relin, rescale), summed over the 64 bands (every band then
   holds s_hj), ``+ beta_h`` on valid rows, the squarings (sqexp: R; 2quad: 1) or the degree 2^R - 1
   polynomial (polyexp, :mod:`fhe.poly`, depth R), then ``p * V_b``. polyexp at one level less
   (``Geometry.fold_v``: depth 4 + R, N = 16384 for R = 5) computes ``P(s) * V_b`` inside the polynomial
   at P's own depth (:meth:`fhe.poly.PolyEvaluator.with_values`, Chebyshev basis), V cached at q.k's level.
5. sum over blocks (one relinearization), over token rows -> ``u_h = sum_j p_hj v_j`` in row 0,
   and the same row sum of p -> ``z_h``; the output map applies Wo_h per head and places ``y_h``
   and ``z_h`` in the output layout (last level).

Every operation goes through an :class:`fhe.evaluator.Evaluator` (SEAL by default, any backend by name),
so nothing here names a CKKS library. The pieces live beside it: :mod:`fhe.geometry` (layout and
levels), :mod:`fhe.weight_maps` (the slot maps), :mod:`fhe.sizing` (value sizing), :mod:`fhe.kv_cache`
(the encrypted cache), :mod:`fhe.block_client` (the client half: encrypt, decrypt, ``sum_h y_h / z_h``).
Both sides are checked against ``fhe.simulator.simulate_block``. Costs and what each side learns:
``docs/fhe.md``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from engine.config import ModelConfig
from engine.model import DecoderLayer, RotaryEmbedding
from fhe.block_client import BlockClient
from fhe.errors import ParameterError, PlanMismatchError, ShapeError
from fhe.evaluator import Ciphertext, EvalKeys, Evaluator, add_plain_values, check_fresh, relin_rescale
from fhe.geometry import Geometry
from fhe.kv_cache import EncryptedKVCache
from fhe.linalg import rotate_sum
from fhe.params import CKKSParams, KeyLevels
from fhe.plan import LayerPlan, Plan
from fhe.poly import PolyEvaluator
from fhe.simulator import block_weights
from fhe.sizing import OUTPUT_HEADROOM_BITS, Extent, base_max, fold_scores, value_gain
from fhe.weight_maps import BlockMaps, block_key_levels, required_key_levels, required_rotation_steps


class EncryptedAttentionLayer:
    """Server side of one encrypted attention block (holds plaintext weights, never a secret key).

    Args:
        layer: the model's decoder layer (weights; the plan's adjusted weights win).
        rope: the model's rotary embedding.
        layer_plan: the layer's approximation (``sqexp`` or ``2quad``) and adjusted weights.
        cfg: the model config.
        params: CKKS parameters (``ckks_params_for(kind, squarings)`` or the plan's).
        max_tokens: the longest session this block serves (g is sized for it).
        evaluator: the backend that evaluates (default: SEAL for ``params``); its parameters must be
            ``params``.

    Attributes:
        processes: 1 (default) or 2: each step forks a copy-on-write child for part of it (:mod:`fhe.fork`;
            the results are the same).
    """

    def __init__(self, layer: DecoderLayer, rope: RotaryEmbedding, layer_plan: LayerPlan, cfg: ModelConfig,
                 params: CKKSParams, max_tokens: int = 1024, *, evaluator: Evaluator | None = None) -> None:
        approx = layer_plan.approx
        if approx.kind not in ("sqexp", "2quad", "polyexp"):
            raise ParameterError(f"approximation {approx.kind!r} has no encrypted form")
        self.geo = Geometry.build(cfg, params, approx.kind, approx.squarings)
        self.ev = evaluator if evaluator is not None else _default_evaluator(params)
        if self.ev.params != params:
            raise ParameterError(f"evaluator {self.ev.name!r} runs {self.ev.params}, the block needs {params}")
        self.rope = rope
        self.index = layer_plan.index
        bw = block_weights(layer, layer_plan, torch.float64)
        self.max_tokens = max_tokens
        limit = 2.0 ** (params.coeff_mod_bit_sizes[0] - params.scale_bits - OUTPUT_HEADROOM_BITS)
        # p <= limit / bound keeps y, z below the last prime: g is sized for the worst case at max_tokens
        # here and raised per step to the plan's observed extent at the current context (:meth:`_step_gain`)
        # polyexp: p is a polynomial, not a power of the base, so the gain goes on its coefficients
        self._poly = approx.poly_coefficients() if approx.kind == "polyexp" else None
        self._n = 1 if self._poly is not None else 2 ** approx.num_squarings
        # q and k are computed qk_boost times larger; the q.k rescale by a prime of qk_boost^2 * scale
        # brings the product back (1 with uniform primes; a larger q.k prime buys q/k precision)
        self._qk_boost = math.sqrt(self.ev.prime(self.geo.level_qk) / self.ev.scale)
        self._extent = Extent.build(layer_plan, base_max(layer_plan) ** self._n, max(1.0, value_gain(bw)))
        g = (limit / self._extent.worst(max_tokens)) ** (1.0 / self._n)
        self._p_gain = g if self._poly is not None else 1.0
        wq, bq, wk, bk, self.beta = fold_scores(bw, layer_plan, g / self._p_gain, self._qk_boost)
        self.maps = BlockMaps.build(self.geo, wq, wk, bw.wv.numpy(), bw.wo.numpy())
        self._v_bias = None if bw.bv is None else bw.bv.numpy()
        # the packed prefill (fhe.packed) builds its per-chunk diagonals from the same folded weights
        self.packed_weights = (wq, bq, wk, bk, bw.wv.numpy(), self._v_bias)
        #: and keeps their encodings between chunks of the same public shape (fhe.packed.PlainCache, made there)
        self.packed_plaintexts = None
        self._bias = self._bias_vector(bq, bk)
        self._encode_static()
        #: processes one step runs on: 2 forks a copy of this process per step for part of it (fhe.fork)
        self.processes = 1

    @classmethod
    def from_plan(cls, model, plan: Plan, index: int, params: CKKSParams, *, expected_hash: str | None = None,
                  max_tokens: int = 1024, evaluator: Evaluator | None = None) -> EncryptedAttentionLayer:
        """The block of layer ``index`` of a plan; PlanMismatchError if the plan is not the expected one."""
        if expected_hash is not None and plan.content_hash != expected_hash:
            raise PlanMismatchError(f"plan hash {plan.content_hash[:16]}... != "
                                    f"expected {expected_hash[:16]}...")
        layer = cls(model.layers[index], model.rotary, plan.layer(index), model.config, params, max_tokens,
                    evaluator=evaluator)
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
        vec = np.zeros(self.ev.slots)
        vec[self.geo.q_slots().ravel()] = 0.0 if bq is None else bq
        vec[self.geo.kv_slots().ravel()] = 0.0 if bk is None else bk
        return vec

    def _scale_chain(self) -> None:
        """Scales after each stage, computed exactly as SEAL does (double ops)."""
        ev, geo = self.ev, self.geo
        delta = ev.scale
        s = delta * delta * self._qk_boost ** 2 / ev.prime(geo.level_qk)   # after q*K rescale (= delta)
        self.scale_s = s
        lvl = geo.level_qk - 1
        if self._poly is not None:
            s = delta          # the polynomial evaluator lands on any scale asked for: the default
        for _ in range(0 if self._poly is not None else geo.squarings):
            s = s * s / ev.prime(lvl)
            lvl -= 1
        self.scale_p = s
        # fold_v: P(s) * V lands on scale_p itself (the polynomial steers its scale), so z needs no factor
        self.scale_u = s if geo.fold_v else s * delta / ev.prime(geo.level_p)

    def _encode_static(self) -> None:
        ev, geo, m = self.ev, self.geo, self.maps
        self._scale_chain()
        self.enc_qk = m.qk.encode(ev, geo.top)
        self.enc_v = m.v.encode(ev, geo.level_v + 2)
        self.enc_v_repack = m.v_repack.encode(ev, geo.level_v + 1)
        self.enc_out = m.out.encode(ev, geo.level_u)
        self.enc_z = m.z.encode(ev, geo.level_u, extra_scale=self.scale_u / self.scale_p)
        self._beta_cache: dict[int, object] = {}

    @property
    def rotation_steps(self) -> set[int]:
        return self.maps.rotation_steps(self.geo)

    @property
    def key_levels(self) -> KeyLevels:
        """Which key is made at which level (the client generates exactly these; the server requires them)."""
        return block_key_levels(self.geo, self.maps)

    def new_cache(self) -> EncryptedKVCache:
        """An empty per-session cache for this layer (holds up to ``max_tokens``)."""
        return EncryptedKVCache(self.geo.layout.block_tokens, self.max_tokens, evaluator=self.ev)

    # --- evaluation ------------------------------------------------------------------------
    def forward(self, cache: EncryptedKVCache, ct: Ciphertext, position: int, keys: EvalKeys) -> Ciphertext:
        """One token: input ciphertext (client layout) at ``position`` -> output ciphertext (y, z) at level 1.

        The token's K/V are appended to ``cache`` (``position`` must equal ``cache.length``).
        """
        if position != cache.length:
            raise ShapeError(f"position {position} but the cache holds {cache.length} tokens")
        if cache.length >= cache.max_tokens:
            raise ShapeError(f"session cache full ({cache.max_tokens} tokens)")
        check_fresh(self.ev, keys, ct)
        if self.processes > 1:
            # the client only decrypts: the lowest level is the smallest download (a no-op when the block's
            # depth uses the whole chain, as the shipped plans do)
            return self.ev.mod_switch(self._forward_forked(cache, ct, position, keys), 1)
        run_step = getattr(self.ev, "run_step", None)
        if run_step is None:
            return self._step(self.ev, cache, ct, position, keys)
        # a backend that runs whole steps (the gpu backend: one CUDA graph replay) gets the step as a pure
        # function of its ciphertexts: the input and the cache blocks in, the output and the blocks out
        n, length = len(cache.k_blocks), cache.length

        def body(ev, cts, keys):
            tmp = EncryptedKVCache(cache.block_tokens, cache.max_tokens, list(cts[1::2]), list(cts[2::2]), length)
            out = self._step(ev, tmp, cts[0], position, keys)
            return [out, *tmp.k_blocks, *tmp.v_blocks]

        blocks = [c for kv in zip(cache.k_blocks, cache.v_blocks, strict=True) for c in kv]   # k0, v0, k1, v1...
        res = run_step(body, [ct, *blocks], keys)
        m = (len(res) - 1) // 2
        if m not in (n, n + 1):
            raise ShapeError(f"a step returned {m} cache blocks for a cache of {n}")
        cache.k_blocks, cache.v_blocks, cache.length = res[1:1 + m], res[1 + m:], length + 1
        return res[0]

    def _step(self, ev: Evaluator, cache: EncryptedKVCache, ct: Ciphertext, position: int,
              keys: EvalKeys) -> Ciphertext:
        """project, insert into ``cache``, attend, all through ``ev`` (this block's, or a backend's shadow or
        capture of the step: its per-step plaintext cache starts empty so every run of a step encodes alike)."""
        saved = self.ev, self._beta_cache
        self.ev, self._beta_cache = ev, {}
        try:
            q, k0, v0 = self._project(ct, position, keys)
            self._insert(cache, k0, v0, keys)
            # the client only decrypts: the lowest level is the smallest download (see above)
            return ev.mod_switch(self._attend(cache, q, keys), 1)
        finally:
            self.ev, self._beta_cache = saved

    def _forward_forked(self, cache: EncryptedKVCache, ct: Ciphertext, position: int, keys: EvalKeys) -> Ciphertext:
        """:meth:`forward` on two cores (:mod:`fhe.fork`): a forked child makes v (the V path) while this
        process projects q and k, then scores the earliest full cache blocks (unchanged by this step's
        insert) while this process scores the rest and, after adding the child's partial sums, runs the
        row sums and output maps. Same operations, so the same values up to the child's one extra
        relinearization of its partial Σ p·V."""
        from fhe.fork import Forked

        ev, lay = self.ev, self.geo.layout
        tokens = cache.length + 1
        n_blocks = -(-tokens // lay.block_tokens)
        # the child's blocks: full before this step (so the same in both copies); the parent keeps the
        # rest and the output side (~1.5 blocks' worth of work)
        mine = list(range(min(cache.length // lay.block_tokens, (n_blocks + 2) // 2)))
        cos_sin = self._cos_sin(position)        # torch before the fork: the child runs none

        def child(ch):
            ch.send([self._project_v(ct, keys)])
            if tokens == 1 or not mine:
                return []
            (q,) = ch.recv()
            pv, ps = self._blocks_p(cache, q, mine, tokens, keys)
            return [ev.relinearize(ev.add_many(pv), keys), ev.add_many(ps)]

        with Forked(ev, child) as ch:
            q, k0 = self._project_qk(ct, position, keys, cos_sin)
            (v0,) = ch.recv()
            self._insert(cache, k0, v0, keys)
            if cache.length == 1:
                return self._attend_single(cache, keys)
            if mine:
                ch.send([q])
            rest = [b for b in range(len(cache.k_blocks)) if b not in mine]
            pv, ps = self._blocks_p(cache, q, rest, tokens, keys)
            u = ev.relinearize(ev.add_many(pv), keys)
            if mine:
                pv_c, p_c = ch.recv()
                ev.add_inplace(u, pv_c)
                ps.append(p_c)
        ev.rescale_inplace(u)
        return self._finish(u, ps, keys)

    def prefill(self, cache: EncryptedKVCache, cts: list[Ciphertext], start: int,
                keys: EvalKeys) -> list[Ciphertext]:
        """Several tokens in order (causal: each attends to the cache so far and itself)."""
        return [self.forward(cache, c, start + i, keys) for i, c in enumerate(cts)]

    @property
    def packed_chunk(self) -> int:
        """Tokens per packed prefill ciphertext (0: this model shape has no packed path)."""
        return self.geo.packed_chunk

    def prefill_packed(self, cache: EncryptedKVCache, chunks: list[Ciphertext], start: int, count: int,
                       keys: EvalKeys) -> list[Ciphertext]:
        """``count`` tokens at ``start..`` sent as ``ceil(count / packed_chunk)`` packed ciphertexts
        (:meth:`fhe.geometry.Geometry.packed_input_slots`) -> one output ciphertext per token.

        ``start`` must be a cache block boundary (ShapeError otherwise); K/V fill whole cache blocks, so
        later decode steps run unchanged.
        """
        from fhe.packed import PackedPrefill

        b = self.packed_chunk
        if not b:
            raise ShapeError(f"model shape {self.geo.layout} has no packed prefill")
        if count < 1 or len(chunks) != -(-count // b):
            raise ShapeError(f"{count} tokens come in {-(-count // b) if count > 0 else 0} packed "
                             f"ciphertexts of {b}, got {len(chunks)}")
        run = PackedPrefill(self)
        outs: list[Ciphertext] = []
        for i, ct in enumerate(chunks):
            outs += run.run(cache, ct, start + i * b, min(b, count - i * b), keys)
        return outs

    def _cos_sin(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        return tuple(t[0].double().numpy() for t in self.rope.cos_sin(torch.tensor([position])))

    def _project(self, ct: Ciphertext, position: int, keys: EvalKeys):
        q, k0 = self._project_qk(ct, position, keys, self._cos_sin(position))
        return q, k0, self._project_v(ct, keys)

    def _project_qk(self, ct: Ciphertext, position: int, keys: EvalKeys, cos_sin):
        """q copied to the B rows and k0 expanded to its G heads, both in row 0's band layout (level_qk)."""
        ev, geo, lay = self.ev, self.geo, self.geo.layout
        qk = self.enc_qk(ev, ct, keys)
        ev.set_scale(qk, ev.scale)
        if self._bias is not None:
            qk = add_plain_values(ev, qk, self._bias)
        cos, sin = cos_sin
        w_q = self.maps.q_rope.weights(cos, sin) * self._step_gain(position + 1)
        q0 = self.maps.q_rope.map.encode(ev, geo.top - 1, w_q)(ev, qk, keys)
        k0 = self.maps.k_rope.map.encode(ev, geo.top - 1, self.maps.k_rope.weights(cos, sin))(ev, qk, keys)
        ev.set_scale(q0, ev.scale)
        ev.set_scale(k0, ev.scale)
        q = rotate_sum(ev, q0, -lay.num_heads, lay.block_tokens, keys)     # tree: this level is expensive
        k0 = rotate_sum(ev, k0, -1, lay.group, keys, horner=True)         # GQA: k_g to its G heads
        return q, k0

    def _project_v(self, ct: Ciphertext, keys: EvalKeys) -> Ciphertext:
        """v0 in row 0 of the band layout, expanded to the G heads of its group (level_v)."""
        ev, geo, lay = self.ev, self.geo, self.geo.layout
        xv = ev.mod_switch(ct, geo.level_v + 2)
        v = self.enc_v(ev, xv, keys)
        ev.set_scale(v, ev.scale)
        if self._v_bias is not None:
            vec = np.zeros(ev.slots)
            vec[geo.kv_slots().ravel()] = self._v_bias
            v = add_plain_values(ev, v, vec)
        v0 = rotate_sum(ev, self.enc_v_repack(ev, v, keys), -1, lay.group, keys, horner=True)
        ev.set_scale(v0, ev.scale)
        return v0

    def _insert(self, cache: EncryptedKVCache, k0: Ciphertext, v0: Ciphertext, keys: EvalKeys) -> None:
        ev, lay = self.ev, self.geo.layout
        if cache.length % lay.block_tokens == 0:
            cache.k_blocks.append(k0)
            cache.v_blocks.append(v0)
        else:  # roll rows down by one (the block is not full, nothing crosses a band)
            cache.k_blocks[-1] = ev.add(ev.rotate(cache.k_blocks[-1], -lay.num_heads, keys), k0)
            cache.v_blocks[-1] = ev.add(ev.rotate(cache.v_blocks[-1], -lay.num_heads, keys), v0)
        cache.length += 1

    def _step_gain(self, tokens: int) -> float:
        """Extra factor (>= 1) on the base at a context of ``tokens``: p is sized for this step's bound on
        max(z, |y|) instead of the setup's worst case, so it sits further above the noise floor."""
        if self._poly is not None:  # polyexp: the gain is on p itself (:meth:`_poly_eval`), not the base
            return 1.0
        return self._size_gain(tokens)

    def _size_gain(self, tokens: int) -> float:
        ext = self._extent
        return (ext.worst(self.max_tokens) / ext.sized(max(1, tokens))) ** (1.0 / self._n)

    def _poly_eval(self, rows: int, tokens: int) -> PolyEvaluator:
        """P times this step's gain, constants on the first ``rows`` rows (cached within a step)."""
        return self.poly_evaluator(("rows", rows), lambda: self.geo.layout.valid(rows), tokens)

    def poly_evaluator(self, key, mask, tokens: int) -> PolyEvaluator:
        """polyexp: P times the gain at a context of ``tokens``, its constants on the slots of ``mask()``
        (cached under ``key`` within a step; a packed chunk passes its own rows)."""
        key = ("poly", key, tokens)
        if key not in self._beta_cache:
            if len(self._beta_cache) > 64:
                self._beta_cache.clear()
            coeffs = self._poly * (self._p_gain * self._size_gain(tokens))
            # the depth-9 block runs at a 2^36 scale: the Chebyshev tree keeps P's absolute noise small
            # where P itself is (rows far below the calibrated maximum), docs/fhe.md §3c
            basis = "chebyshev" if self.geo.fold_v else "power"
            self._beta_cache[key] = PolyEvaluator(self.ev, coeffs, self.scale_p, mask(), basis=basis)
        return self._beta_cache[key]

    def _beta(self, rows: int, tokens: int):
        """Plaintext beta_h (times the step gain) on the first ``rows`` rows (cached within a step)."""
        key = (rows, tokens)
        if key not in self._beta_cache:
            if len(self._beta_cache) > 64:
                self._beta_cache.clear()
            vec = self.geo.layout.valid(rows, self.beta * self._step_gain(tokens))
            self._beta_cache[key] = self.ev.encode(vec, self.geo.level_qk - 1, self.scale_s)
        return self._beta_cache[key]

    def _block_p(self, q: Ciphertext, k_b: Ciphertext, rows: int, tokens: int,
                 keys: EvalKeys) -> Ciphertext:
        """Unnormalized weights p of one cache block, broadcast over all bands (level_p)."""
        ev = self.ev
        s = self._scores(q, k_b, rows, tokens, keys)
        if self._poly is not None:
            return self._poly_eval(rows, tokens)(s, keys)
        for _ in range(self.geo.squarings):
            s = relin_rescale(ev, ev.square(s), keys)
        ev.set_scale(s, self.scale_p)
        return s

    def _blocks_p(self, cache: EncryptedKVCache, q: Ciphertext, blocks: list[int], tokens: int,
                  keys: EvalKeys) -> tuple[list[Ciphertext], list[Ciphertext]]:
        """p ⊙ V_b (size 3) and p of the cache blocks ``blocks`` at a context of ``tokens``."""
        pv, ps = [], []
        for b in blocks:
            rows = min(cache.block_tokens, tokens - b * cache.block_tokens)
            if self.geo.fold_v:
                p, p_v = self._block_p_v(q, cache.k_blocks[b], cache.v_blocks[b], rows, tokens, keys)
            else:
                p = self._block_p(q, cache.k_blocks[b], rows, tokens, keys)
                p_v = self.ev.mul(p, cache.v_blocks[b])
            pv.append(p_v)
            ps.append(p)
        return pv, ps

    def _scores(self, q: Ciphertext, k_b: Ciphertext, rows: int, tokens: int, keys: EvalKeys) -> Ciphertext:
        """a s + b of one cache block, broadcast over all bands (level_qk - 1)."""
        ev, lay = self.ev, self.geo.layout
        s = relin_rescale(ev, ev.mul(q, k_b), keys)
        s = rotate_sum(ev, s, lay.band, lay.head_dim, keys)
        ev.set_scale(s, self.scale_s)
        ev.add_plain_inplace(s, self._beta(rows, tokens))
        return s

    def _block_p_v(self, q: Ciphertext, k_b: Ciphertext, v_b: Ciphertext, rows: int, tokens: int,
                   keys: EvalKeys) -> tuple[Ciphertext, Ciphertext]:
        """fold_v: (p, p ⊙ V_b) of one cache block at the depth of p alone (p at level_p; p ⊙ V_b size 3
        one level up, summed over blocks before one relinearization and rescale to level_u)."""
        s = self._scores(q, k_b, rows, tokens, keys)
        return self._poly_eval(rows, tokens).with_values(s, v_b, self.scale_u, keys)

    def _attend(self, cache: EncryptedKVCache, q: Ciphertext, keys: EvalKeys) -> Ciphertext:
        if cache.length == 1:
            return self._attend_single(cache, keys)
        pv, ps = self._blocks_p(cache, q, list(range(len(cache.k_blocks))), cache.length, keys)
        return self._finish(relin_rescale(self.ev, self.ev.add_many(pv), keys), ps, keys)

    def _finish(self, u: Ciphertext, ps: list[Ciphertext], keys: EvalKeys) -> Ciphertext:
        """Σ_b p_b ⊙ V_b (relinearized, rescaled) and the p_b -> the output ciphertext (y, z)."""
        ev, lay = self.ev, self.geo.layout
        u = rotate_sum(ev, u, lay.num_heads, lay.block_tokens, keys, horner=True)
        ev.set_scale(u, self.scale_u)
        # z's row sum runs one level lower (where the z map reads it): same values, cheaper rotations
        z = ev.mod_switch(ev.add_many(ps), self.geo.level_u)
        z = rotate_sum(ev, z, lay.num_heads, lay.block_tokens, keys, horner=True)
        y = self.enc_out(ev, u, keys)
        zo = self.enc_z(ev, z, keys)
        ev.set_scale(zo, ev.scale_of(y))
        return ev.add(y, zo)

    def _attend_single(self, cache: EncryptedKVCache, keys: EvalKeys) -> Ciphertext:
        """The first token attends only to itself: its normalized weight is exactly 1 for any p > 0,
        so the block returns y_h = v_0 Wo_h, z_h = 1 (the same quotient as the simulator's) without
        the score path — which would otherwise drown a tiny p_00 in CKKS noise."""
        ev, lay = self.ev, self.geo.layout
        lvl = self.geo.level_u + 1
        v = ev.mod_switch(cache.v_blocks[0], lvl)
        mask = ev.encode(lay.valid(1), lvl, self.scale_u * ev.prime(lvl) / ev.scale_of(v))
        u = ev.mul_plain(v, mask)
        ev.rescale_inplace(u)
        ev.set_scale(u, self.scale_u)
        y = self.enc_out(ev, u, keys)
        ones = np.zeros(ev.slots)
        ones[lay.output_slots()[1]] = 1.0
        return add_plain_values(ev, y, ones)


def _default_evaluator(params: CKKSParams) -> Evaluator:
    from fhe.backends import evaluator_for  # lazy: the backend (a CKKS library) loads on first use

    return evaluator_for(params)


__all__ = ["BlockClient", "EncryptedAttentionLayer", "EncryptedKVCache", "Geometry", "required_key_levels",
           "required_rotation_steps"]
