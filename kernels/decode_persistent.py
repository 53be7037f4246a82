"""Every decoder layer of a batch-1 decode step in ONE persistent Triton launch (issue 19 item 2).

Why: a batch-1 Qwen2.5-0.5B layer was ~10 launches of 1-7 µs (~24 µs) against a 9.9 µs weight floor, and the
per-op fusions (GEMV prologues, ``kernels.decode_layer``'s four launches a layer) measured slower on an H100
(docs/benchmarks.md, "Decode fusions"). Launch gaps and the tails of small grids are what is left; here there
is one launch for all layers (not the embedding, not the final norm and head).

Grid: P persistent programs (default: one per SM, so all are co-resident). Per layer five stages, each ended by
a grid barrier:

* S1 ``rms_norm(h)`` (each program sums h^2 itself: h is <= a few thousand values) → QKV GEMV (+ bias) → RoPE
  (neox rotate-half) of q and k → k, v into the paged cache slot, q into a workspace. A program owns a range of
  row *pairs* (d, d + D/2) of a head, so the rotation needs no other program's output.
* S2 attention of the new q over the context: work items (KV head, partition), the G = Hq / Hkv query heads of
  a KV head together (one K/V read for all); the context is cut at run time into ``splits`` partitions (the
  context length is read on the device: no host sync, graph-safe). Each item writes its normalized partial
  output and log2-sum-exp.
* S3 O GEMV whose input loads merge the partitions (every program merges the columns it multiplies: the
  partials are L2-resident), epilogue ``h += o`` on the program's own rows, rounded as the unfused path.
* S4 ``rms_norm(h)`` → gate/up GEMV (a program owns a range of MLP channels: gate row j and up row j + I)
  → ``silu(gate) * up`` into a workspace.
* S5 down GEMV, ``h += y``.

Rows of every GEMV stage are split into P contiguous ranges of "units" (a unit is a row pair: a RoPE pair, a
gate/up channel, or two adjacent rows), ⌊U/P⌋ or ⌈U/P⌉ units a program, walked in chunks of ``BU`` units and
K steps of ``BK`` columns. Numerics are those of the unfused ops (the ``*_reference`` functions): the normed row
and every GEMV output are rounded to the activations' dtype where the unfused kernels store them.

Barrier: a counter per (layer, stage) in an int32 workspace. A program arrives with ``bar.sync`` (every thread's
stores issued) then one release ``atomic_add`` at GPU scope, and polls with acquire ``atomic_add(…, 0)`` until
the counter reaches P. Data written by other programs of the same launch is loaded with ``cache_modifier=".cg"``
(L2: the L1 is not coherent across SMs). The last stage of the last layer has no wait (nothing reads h after
it in this launch): the program that arrives last there zeroes every counter, so the next launch (the next
graph replay) starts clean. Every poll loop is bounded (``MAX_POLLS``): a program that gives up sets the error
flag (:meth:`PersistentDecodeLayers.failed`) and stops waiting at later barriers, so a grid whose programs are
not all resident ends with a wrong answer and a flag instead of a hang.

Weight prefetch across barriers, two ways (weights do not depend on any barrier):

* registers: between its arrival (the release) and its poll loop a program issues the loads of its *next* GEMV
  stage's first weight tiles; a load's result is an SSA value, so the tiles are in flight while it polls and are
  waited for at their first use, after the loop (issued after the release, so the release does not wait for
  them; before the acquire polls, which order only what follows them). Every K step likewise loads the next
  step's tiles and x (h and the gain, or the SiLU·mul vector; the next chunk's first ones at a chunk's last step)
  before it multiplies the current ones, so a step waits only for loads issued a step earlier. The
  amount in flight is bounded by registers: ``2 tile_elems`` weights a step, 16 KB in bf16, twice that with
  the next step's. S1's tiles of the next layer are issued at S5's barrier, S3's at S1's (held across the
  attention).
* L2: registers cannot hold a stage's share (Qwen2.5-0.5B's gate/up is ~132 KB a program), so on sm_90 each
  program also pulls the first ``l2_prefetch_kb`` of its share of a later stage into L2 with Hopper's
  ``cp.async.bulk.prefetch.L2.global`` (Triton has no prefetch op: ``tl.inline_asm_elementwise``, one
  instruction a weight row, nothing written, so results cannot depend on it): the O and gate/up shares when S1
  starts, the down share when S4 starts, the next layer's QKV when S5 starts. HBM then streams while the
  latency-bound stages (norms, attention, merges) and the barriers run, and the GEMV loads hit L2. Triton's
  interpreter cannot run inline asm: there (and below sm_90) this is off.

Under Triton's CPU interpreter the programs of a grid run one after another, so with P > 1 the first program
would poll forever (bounded: it gives up and sets the flag) while the others have not started: interpreter runs
use P = 1 (tests/kernels/test_decode_persistent.py).

Per-layer weights and KV pools are reached through a device table of int64 addresses (``[L, 6]``: qkv, o,
gate/up, down, k pool, v pool), cast in the kernel with ``tl.pointer_type``: the engine keeps each layer's fused
weights and pools as separate tensors, and stacking them would copy ~all of the model's weights (or re-point
the engine's parameters at a stacked tensor, a change of its load path); the norm gains and qkv biases are small
and are stacked (``[L, H]``, ``[L, N_qkv]``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

from ._common import (
    FLOAT_DTYPES,
    HAS_TRITON,
    Backend,
    cdiv,
    check_cache_pair,
    check_heads,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
    dot_precision,
    next_pow2,
    num_sms,
    tl,
    triton,
    use_triton,
)
from .decode_layer import (
    gemv_add_residual_reference,
    norm_gate_up_silu_reference,
    norm_qkv_rope_store_reference,
)
from .errors import KernelInputError
from .paged_decode import paged_decode_attention_reference

__all__ = ["DecodeLayerWeights", "PersistentDecodeLayers", "PersistentDecodeTuning", "decode_persistent",
           "decode_persistent_reference"]

STAGES = 5          # barriers a layer
TABLE = 6           # addresses a layer: qkv, o, gate_up, down, k pool, v pool
TRACE_EVENTS = 11   # _stamp's events a layer: S1 start, S1 end, barrier 0 passed, ... barrier 4 passed
MAX_POLLS = 1 << 20  # polls before a program gives up on a barrier (~0.5-1 s; a real wait is < 100 µs)


class DecodeLayerWeights(NamedTuple):
    """One decoder layer as the persistent kernel reads it (``engine.fused.FusedLayerWeights`` + the norms).

    Shapes: input_norm, post_norm [H]; qkv [(Hq + 2 Hkv) D, H] (q rows, then k, then v); qkv_bias
    [(Hq + 2 Hkv) D] or None; o [H, Hq D]; gate_up [2 I, H] (gate rows first); down [H, I].
    """

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclasses.dataclass(frozen=True)
class PersistentDecodeTuning:
    """Launch parameters. None picks from the shapes (:func:`_plan`).

    Attributes:
        programs: P, the grid (None: the SM count). Every program must be resident at once.
        splits: attention partitions per KV head (None: enough for ~16 work items, at most 16).
        tile_elems: weights a row tile of a K step (a power of two): a GEMV stage's chunk is ``BU`` row pairs,
            the next power of two of a program's share capped at ``max_units``, and its K step
            ``tile_elems / BU`` columns (at most the next power of two of K): every stage streams
            ``2 tile_elems`` weights a step (16 KB in bf16 at 4096), the next step's in flight meanwhile.
        block_k: a fixed K step for every stage instead (a power of two), or None.
        max_units: most row pairs a GEMV chunk (a power of two).
        block_t: context tokens a K/V tile in the attention (>= 16: tl.dot).
        num_warps: warps a program.
        prefetch: issue the next stage's first weight tiles before each barrier (False: at the stage's start).
        l2_prefetch_kb: KB of a program's share of a later GEMV stage pulled into L2 ahead of time (Hopper's
            ``cp.async.bulk.prefetch.L2``, one instruction a weight row): the gate/up share when S1 starts, the
            down share when S4 starts, the next layer's QKV share when S5 starts. 0: off. Only on compute
            capability 9.0+ CUDA devices with 16-byte aligned rows (else off); never under the interpreter.
    """

    programs: int | None = None
    splits: int | None = None
    tile_elems: int = 4096
    block_k: int | None = None
    max_units: int = 8
    block_t: int = 16
    num_warps: int = 8
    prefetch: bool = True
    l2_prefetch_kb: int = 96


@dataclasses.dataclass
class PersistentDecodeLayers:
    """Everything the kernel needs that does not change between steps, built once (:meth:`build`): the layer
    tensors (for the reference), the address table, the stacked norms and biases, the barrier counters and the
    workspaces. Keep it alive as long as the kernel may run (the table holds raw addresses)."""

    layers: list[DecodeLayerWeights]
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    num_heads: int
    num_kv_heads: int
    eps: float
    table: torch.Tensor          # [L, 6] int64 addresses
    norms: torch.Tensor          # [L, 2, H]: input_norm, post_norm
    biases: torch.Tensor | None  # [L, N_qkv]
    sync: torch.Tensor           # [L * 5 + 1] int32: barrier counters, then the error flag
    _work: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def build(cls, layers: list[DecodeLayerWeights], k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
              num_heads: int, num_kv_heads: int, eps: float) -> PersistentDecodeLayers:
        """Check the layers and pools (KernelInputError) and build the tables on their device."""
        _check_layers(layers, k_caches, v_caches, num_heads, num_kv_heads)
        w0, dev = layers[0], layers[0].qkv.device
        addrs = [[t.data_ptr() for t in (w.qkv, w.o, w.gate_up, w.down, kc, vc)]
                 for w, kc, vc in zip(layers, k_caches, v_caches, strict=True)]
        table = torch.tensor(addrs, dtype=torch.int64, device=dev)
        norms = torch.stack([torch.stack([w.input_norm, w.post_norm]) for w in layers]).contiguous()
        biases = (None if w0.qkv_bias is None else torch.stack([w.qkv_bias for w in layers]).contiguous())
        sync = torch.zeros(len(layers) * STAGES + 1, dtype=torch.int32, device=dev)
        return cls(list(layers), list(k_caches), list(v_caches), num_heads, num_kv_heads, float(eps), table,
                   norms, biases, sync)

    def failed(self) -> bool:
        """Whether a launch gave up waiting at a barrier (its programs were not all resident); a host sync."""
        return bool(self.sync[-1].item())

    def clear_error(self) -> None:
        self.sync[-1].zero_()

    def workspace(self, splits: int) -> tuple[torch.Tensor, ...]:
        """(q [Hq D], act [I], partial out [Hq, S, D] fp32, partial lse [Hq, S] fp32), made once per ``splits``
        (the first call of a step shape: outside graph capture in the engine, whose warm-up runs first)."""
        if splits not in self._work:
            w0 = self.layers[0]
            hq, d = self.num_heads, self.k_caches[0].shape[-1]
            dev, dt = w0.qkv.device, w0.qkv.dtype
            self._work[splits] = (torch.empty(hq * d, dtype=dt, device=dev),
                                  torch.empty(w0.gate_up.shape[0] // 2, dtype=dt, device=dev),
                                  torch.empty(hq, splits, d, dtype=torch.float32, device=dev),
                                  torch.empty(hq, splits, dtype=torch.float32, device=dev))
        return self._work[splits]


def _check_layers(layers, k_caches, v_caches, hq: int, hkv_arg: int) -> None:
    if not layers or len(layers) != len(k_caches) or len(layers) != len(v_caches):
        raise KernelInputError(f"need one k and one v pool a layer, got {len(layers)} layers, "
                               f"{len(k_caches)} k and {len(v_caches)} v pools")
    w0 = layers[0]
    h = w0.qkv.shape[1] if w0.qkv.dim() == 2 else -1
    _, _, hkv, d = check_cache_pair(k_caches[0], v_caches[0])
    check_heads(hq, hkv)
    if hkv_arg != hkv or d % 2:
        raise KernelInputError(f"need Hkv = the pools' {hkv} and an even head_dim, got Hkv={hkv_arg}, D={d}")
    if h % 2:
        raise KernelInputError(f"the hidden size must be even (row pairs of the O and down GEMVs), got {h}")
    inter = w0.gate_up.shape[0] // 2 if w0.gate_up.dim() == 2 else -1
    n_qkv = (hq + 2 * hkv) * d
    shapes = dict(input_norm=(h,), post_norm=(h,), qkv=(n_qkv, h), o=(h, hq * d), gate_up=(2 * inter, h),
                  down=(h, inter))
    for i, (w, kc, vc) in enumerate(zip(layers, k_caches, v_caches, strict=True)):
        for name, shape in shapes.items():
            t = check_tensor(f"layers[{i}].{name}", getattr(w, name), len(shape), FLOAT_DTYPES)
            check_shape(f"layers[{i}].{name}", t, shape)
            if not t.is_contiguous():
                raise KernelInputError(f"layers[{i}].{name} must be contiguous")
        if (w.qkv_bias is None) != (w0.qkv_bias is None):
            raise KernelInputError("either every layer has a qkv bias or none has")
        if w.qkv_bias is not None:
            check_tensor(f"layers[{i}].qkv_bias", w.qkv_bias, 1, FLOAT_DTYPES)
            check_shape(f"layers[{i}].qkv_bias", w.qkv_bias, (n_qkv,))
        check_cache_pair(kc, vc)
        check_shape(f"k_caches[{i}]", kc, tuple(k_caches[0].shape))
        if kc.stride() != k_caches[0].stride() or vc.stride() != v_caches[0].stride():
            raise KernelInputError("every layer's pools must share strides")
        more = {} if w.qkv_bias is None else {"qkv_bias": w.qkv_bias}
        check_same_dtype(qkv=w.qkv, o=w.o, gate_up=w.gate_up, down=w.down, input_norm=w.input_norm,
                         post_norm=w.post_norm, k_cache=kc, v_cache=vc, **more)
        check_same_device(qkv=w.qkv, o=w.o, gate_up=w.gate_up, down=w.down, k_cache=kc, v_cache=vc,
                          layer0=w0.qkv, **more)


# ---- reference ------------------------------------------------------------------------------------------

def decode_persistent_reference(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                                block_tables: torch.Tensor, context_lens: torch.Tensor,
                                layers: PersistentDecodeLayers) -> torch.Tensor:
    """Torch reference of :func:`decode_persistent`, layer by layer with the unfused ops' references
    (``norm_qkv_rope_store_reference``, ``paged_decode_attention_reference``, ``gemv_add_residual_reference``,
    ``norm_gate_up_silu_reference``): h [1, H] updated in place and returned, k/v stored."""
    hq, hkv, eps = layers.num_heads, layers.num_kv_heads, layers.eps
    scale = 1.0 / math.sqrt(layers.k_caches[0].shape[-1])
    for w, kc, vc in zip(layers.layers, layers.k_caches, layers.v_caches, strict=True):
        q = norm_qkv_rope_store_reference(h, w.input_norm, eps, w.qkv, w.qkv_bias, hq, hkv, cos, sin, kc, vc,
                                          slot_mapping)                        # [1, Hq, D]
        o = paged_decode_attention_reference(q, kc, vc, block_tables, context_lens, scale)
        gemv_add_residual_reference(o.reshape(1, -1), w.o, h)
        act = norm_gate_up_silu_reference(h, w.post_norm, eps, w.gate_up)   # [1, I]
        gemv_add_residual_reference(act, w.down, h)
    return h


# ---- kernel ---------------------------------------------------------------------------------------------

if HAS_TRITON:
    from .l2_prefetch import bulk_prefetch_l2
    from .paged_decode import online_softmax_step

    @triton.jit
    def _arrive(sync_ptr, idx):
        """Arrive at barrier counter ``idx``: every thread's stores issued (bar.sync), then one release add."""
        tl.debug_barrier()
        tl.atomic_add(sync_ptr + idx, 1, sem="release", scope="gpu")

    @triton.jit
    def _wait(sync_ptr, idx, err_idx, P, failed, MAX: tl.constexpr):
        """Poll counter ``idx`` (acquire) until P programs have arrived, at most MAX polls; a program that gives up
        sets the error flag and stops waiting at later barriers. Returns the updated ``failed``."""
        seen = tl.atomic_add(sync_ptr + idx, 0, sem="acquire", scope="gpu")
        polls = 0
        while (seen < P) & (polls < MAX) & (failed == 0):
            seen = tl.atomic_add(sync_ptr + idx, 0, sem="acquire", scope="gpu")
            polls += 1
        if seen < P:
            if failed == 0:
                tl.atomic_xchg(sync_ptr + err_idx, 1, sem="relaxed", scope="gpu")
        failed = tl.where(seen < P, 1, failed)
        tl.debug_barrier()
        return failed

    @triton.jit
    def _stamp(trace_ptr, layer, ev, pid, P, TRACE: tl.constexpr):
        """With TRACE: this program's SM clock (``%clock64``) at event ``ev`` of ``layer`` into
        ``trace[layer, ev, pid]`` (bench/decode_persistent_gpu.py turns the deltas into stage and barrier times)."""
        if TRACE:
            NEV: tl.constexpr = 11  # TRACE_EVENTS
            t = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [pid], dtype=tl.int64, is_pure=False,
                                          pack=1)
            tl.store(trace_ptr + (layer * NEV + ev) * P + pid, t)

    @triton.jit
    def _units(pid, P, U):
        """This program's unit range [u0, u1) of U: contiguous, ⌊U/P⌋ or ⌈U/P⌉ units."""
        return pid * U // P, (pid + 1) * U // P

    @triton.jit
    def _pair_rows(units, KIND: tl.constexpr, HALF, SECOND):
        """Row pair of each unit. KIND 0: RoPE halves (d, d + D/2) of a head; 1: rows (2u, 2u + 1);
        2: gate/up rows (u, u + SECOND)."""
        if KIND == 0:
            lo = (units // HALF) * (2 * HALF) + units % HALF
            hi = lo + HALF
        elif KIND == 1:
            lo = 2 * units
            hi = lo + 1
        else:
            lo = units
            hi = units + SECOND
        return lo, hi

    @triton.jit
    def _tiles(w, units, ok, k0, K, KIND: tl.constexpr, HALF, SECOND, BK: tl.constexpr):
        """Weight tiles [BU, BK] of the units' two rows at columns [k0, k0 + BK) (masked rows load nothing)."""
        lo, hi = _pair_rows(units, KIND, HALF, SECOND)
        cols = k0 + tl.arange(0, BK)
        m = ok[:, None] & (cols < K)[None, :]
        a = tl.load(w + lo.to(tl.int64)[:, None] * K + cols[None, :], mask=m, other=0.0,
                    eviction_policy="evict_first")
        b = tl.load(w + hi.to(tl.int64)[:, None] * K + cols[None, :], mask=m, other=0.0,
                    eviction_policy="evict_first")
        return a, b

    @triton.jit
    def _first_tiles(w, pid, P, U, K, KIND: tl.constexpr, HALF, SECOND, valid, BU: tl.constexpr,
                     BK: tl.constexpr):
        """A program's first tiles of a GEMV stage (``valid`` 0: none, e.g. past the last layer)."""
        u0, u1 = _units(pid, P, U)
        units = u0 + tl.arange(0, BU)
        return _tiles(w, units, units < u0 + (u1 - u0) * valid, 0, K, KIND, HALF, SECOND, BK)

    @triton.jit
    def _l2_prefetch(w, pid, P, U, K, KIND: tl.constexpr, HALF, SECOND, budget, valid, ON: tl.constexpr):
        """Pull the first ``budget`` bytes' worth of this program's rows of a GEMV stage into L2 (one bulk
        prefetch a row, ``K * 2`` bytes; a hint: nothing is written, results do not depend on it)."""
        if ON:
            PF_U: tl.constexpr = 64
            u0, u1 = _units(pid, P, U)
            ELT: tl.constexpr = w.dtype.element_ty.primitive_bitwidth // 8
            row_bytes = K * ELT
            lim = tl.minimum(u1, u0 + budget // (2 * row_bytes)) * valid + u0 * (1 - valid)
            units = u0 + tl.arange(0, PF_U)
            on = (units < lim).to(tl.int32)
            lo, hi = _pair_rows(units, KIND, HALF, SECOND)
            size = tl.zeros([PF_U], tl.int32) + row_bytes
            # addresses as int64 ("l" operands): no pointer operand in the asm
            bulk_prefetch_l2((w + lo.to(tl.int64) * K).to(tl.int64), size, on)
            bulk_prefetch_l2((w + hi.to(tl.int64) * K).to(tl.int64), size, on)

    @triton.jit
    def _x_cols(cols, c_ok, X: tl.constexpr, src, g, inv, lse_ptr, ctx_part, S, D, DT: tl.constexpr,
                BLOCK_S: tl.constexpr):
        """The GEMV input at ``cols`` in fp32, as the unfused op before it stores it (rounded to DT).
        X 0: rms_norm(h) (src h, g gain, inv); 1: the attention partitions of src (partial outputs), merged;
        2: a plain vector (src)."""
        if X == 0:
            x = tl.load(src + cols, mask=c_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            x = (x * inv * tl.load(g + cols, mask=c_ok, other=0.0).to(tl.float32)).to(DT).to(tl.float32)
        elif X == 1:
            head = cols // D
            d = cols % D
            s = tl.arange(0, BLOCK_S)
            m = ((s < ctx_part) & (s < S))[:, None] & c_ok[None, :]   # partitions that saw a token
            row = head[None, :] * S + s[:, None]                   # [BLOCK_S, BK]
            lse = tl.load(lse_ptr + row, mask=m, other=float("-inf"), cache_modifier=".cg")
            o = tl.load(src + row * D + d[None, :], mask=m, other=0.0, cache_modifier=".cg")
            mx = tl.max(lse, 0)
            mx = tl.where(mx == float("-inf"), 0.0, mx)
            wgt = tl.where(m, tl.exp2(lse - mx[None, :]), 0.0)
            den = tl.sum(wgt, 0)
            x = tl.sum(wgt * o, 0) / tl.where(den > 0.0, den, 1.0)
            x = x.to(DT).to(tl.float32)
        else:
            x = tl.load(src + cols, mask=c_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        return x

    @triton.jit
    def _x_raw(cols, c_ok, X: tl.constexpr, src, g, BK: tl.constexpr):
        """The loads behind :func:`_x_cols` for X 0 (h, gain) and 2 (the vector), issued a K step ahead; X 1
        (the merge: a [S, BK] tile of partials, too many registers to hold a step ahead) loads at its use."""
        if X == 0:
            a = tl.load(src + cols, mask=c_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            b = tl.load(g + cols, mask=c_ok, other=0.0).to(tl.float32)
        elif X == 2:
            a = tl.load(src + cols, mask=c_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            b = tl.zeros([BK], tl.float32)
        else:
            a = tl.zeros([BK], tl.float32)
            b = tl.zeros([BK], tl.float32)
        return a, b

    @triton.jit
    def _gemv_stage(w, pid, P, U, K, w_lo, w_hi, KIND: tl.constexpr, HALF, SECOND,
                    X: tl.constexpr, src, g, inv, lse_ptr, ctx_part, S, D,
                    EPI: tl.constexpr, out, bias, cos, sin, kc, vc, slot, slot_ok, HQ, HKV,
                    s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, BS: tl.constexpr,
                    DT: tl.constexpr, BU: tl.constexpr, BK: tl.constexpr, BLOCK_S: tl.constexpr,
                    HAS_BIAS: tl.constexpr):
        """A GEMV stage over this program's units; ``w_lo, w_hi``: its first tiles, already loaded.

        EPI 0: RoPE, q into ``out``, k/v into the pools; 1: ``out[row] += y`` (the residual stream);
        2: ``out[u] = silu(y_lo) * y_hi``."""
        u0, u1 = _units(pid, P, U)
        cols0 = tl.arange(0, BK)
        xa, xb = _x_raw(cols0, cols0 < K, X, src, g, BK)          # the first step's x loads
        for c in range(u0, u1, BU):
            units = c + tl.arange(0, BU)
            ok = units < u1
            acc_lo = tl.zeros([BU, BK], dtype=tl.float32)
            acc_hi = tl.zeros([BU, BK], dtype=tl.float32)
            for k0 in range(0, K, BK):
                # the next step's tiles and x (the next chunk's first ones after this chunk's last step) in
                # flight while this step multiplies: a step waits for loads issued a step earlier
                wrap = k0 + BK >= K
                nk = tl.where(wrap, 0, k0 + BK)
                n_units = tl.where(wrap, units + BU, units)
                n_lo, n_hi = _tiles(w, n_units, n_units < u1, nk, K, KIND, HALF, SECOND, BK)
                ncols = nk + tl.arange(0, BK)
                nxa, nxb = _x_raw(ncols, ncols < K, X, src, g, BK)
                cols = k0 + tl.arange(0, BK)
                if X == 0:    # rms_norm(h), rounded as the unfused norm stores it
                    x = (xa * inv * xb).to(DT).to(tl.float32)
                elif X == 2:
                    x = xa
                else:
                    x = _x_cols(cols, cols < K, X, src, g, inv, lse_ptr, ctx_part, S, D, DT, BLOCK_S)
                acc_lo += w_lo.to(tl.float32) * x[None, :]
                acc_hi += w_hi.to(tl.float32) * x[None, :]
                w_lo, w_hi = n_lo, n_hi
                xa, xb = nxa, nxb
            y_lo = tl.sum(acc_lo, 1)
            y_hi = tl.sum(acc_hi, 1)
            lo, hi = _pair_rows(units, KIND, HALF, SECOND)
            if HAS_BIAS:
                y_lo += tl.load(bias + lo, mask=ok, other=0.0).to(tl.float32)
                y_hi += tl.load(bias + hi, mask=ok, other=0.0).to(tl.float32)
            y_lo = y_lo.to(DT).to(tl.float32)   # the GEMV's output as the unfused kernel stores it
            y_hi = y_hi.to(DT).to(tl.float32)
            if EPI == 0:
                head = units // HALF
                dd = units % HALF
                c_ = tl.load(cos + dd, mask=ok, other=0.0)
                s_ = tl.load(sin + dd, mask=ok, other=0.0)
                is_v = head >= HQ + HKV
                a_lo = tl.where(is_v, y_lo, y_lo * c_ - y_hi * s_).to(DT)
                a_hi = tl.where(is_v, y_hi, y_hi * c_ + y_lo * s_).to(DT)
                q_ok = ok & (head < HQ)
                tl.store(out + lo, a_lo, mask=q_ok)
                tl.store(out + hi, a_hi, mask=q_ok)
                kh = tl.where(is_v, head - HQ - HKV, head - HQ)
                kh = tl.where(head >= HQ, kh, 0)
                kv_ok = ok & (head >= HQ) & (dd < tl.where(slot_ok, HALF, 0))   # padding slot: nothing stored
                blk = slot // BS
                off = slot % BS
                k_dst = kc + blk * s_kb + off * s_ks + kh * s_kh + dd
                v_dst = vc + blk * s_vb + off * s_vs + kh * s_vh + dd
                tl.store(k_dst, a_lo, mask=kv_ok & (head < HQ + HKV))
                tl.store(k_dst + HALF, a_hi, mask=kv_ok & (head < HQ + HKV))
                tl.store(v_dst, a_lo, mask=kv_ok & is_v)
                tl.store(v_dst + HALF, a_hi, mask=kv_ok & is_v)
            elif EPI == 1:  # each program adds only its own rows: in place, no other program reads them now
                r_lo = tl.load(out + lo, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
                r_hi = tl.load(out + hi, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
                tl.store(out + lo, (y_lo + r_lo).to(DT), mask=ok)
                tl.store(out + hi, (y_hi + r_hi).to(DT), mask=ok)
            else:
                tl.store(out + units, (y_lo / (1.0 + tl.exp(-y_lo)) * y_hi).to(DT), mask=ok)

    @triton.jit
    def _inv_rms(h_ptr, H, eps, BLOCK_H: tl.constexpr):
        """rsqrt(mean(h^2) + eps) of the whole (L2-fresh) residual stream."""
        cols = tl.arange(0, BLOCK_H)
        x = tl.load(h_ptr + cols, mask=cols < H, other=0.0, cache_modifier=".cg").to(tl.float32)
        return tl.rsqrt(tl.sum(x * x, 0) / H + eps)

    @triton.jit
    def _attention(pid, P, q_ws, kc, vc, bt_ptr, ctx, part, po_ptr, pl_ptr, sm_scale_log2,
                   s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, HKV, G, S, D,
                   BS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
                   DOT_PREC: tl.constexpr):
        """Work items (KV head, partition) i = pid, pid + P, ...: an online softmax over the partition's tokens
        for the G query heads of the KV head; partial output [G, D] and log2-sum-exp written (an empty
        partition: lse -inf)."""
        g = tl.arange(0, BLOCK_G)
        dd = tl.arange(0, BLOCK_D)
        gmask = g < G
        dmask = dd < D
        for item in range(pid, HKV * S, P):
            h = item // S
            s = item % S
            start = s * part
            end = tl.minimum(start + part, ctx)
            heads = h * G + g
            q = tl.load(q_ws + heads[:, None] * D + dd[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0,
                        cache_modifier=".cg")
            m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            for n0 in range(start, end, BLOCK_T):
                offs = n0 + tl.arange(0, BLOCK_T)
                nmask = offs < end
                blk = tl.load(bt_ptr + offs // BS, mask=nmask, other=0).to(tl.int64)
                within = offs % BS
                kv_mask = nmask[:, None] & dmask[None, :]
                k = tl.load(kc + blk[:, None] * s_kb + within[:, None] * s_ks + h * s_kh + dd[None, :],
                            mask=kv_mask, other=0.0, cache_modifier=".cg")
                v = tl.load(vc + blk[:, None] * s_vb + within[:, None] * s_vs + h * s_vh + dd[None, :],
                            mask=kv_mask, other=0.0, cache_modifier=".cg")
                m_i, l_i, acc = online_softmax_step(q, k, v, nmask, m_i, l_i, acc, sm_scale_log2, DOT_PREC)
            l_safe = tl.where(l_i > 0.0, l_i, 1.0)
            row = heads * S + s
            tl.store(pl_ptr + row, tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf")), mask=gmask)
            tl.store(po_ptr + row[:, None] * D + dd[None, :], acc / l_safe[:, None],
                     mask=gmask[:, None] & dmask[None, :])

    @triton.jit
    def _decode_persistent_kernel(
        h_ptr, cos_ptr, sin_ptr, slot_ptr, bt_ptr, ctx_ptr, table_ptr, norms_ptr, bias_ptr, sync_ptr,
        q_ws, act_ws, po_ptr, pl_ptr, trace_ptr,
        L, H, INTER, HQ, HKV, G, D, S, max_blocks, num_slots, eps, sm_scale_log2, pf_budget,
        s_kb, s_ks, s_kh, s_vb, s_vs, s_vh,
        BS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
        BU1: tl.constexpr, BU3: tl.constexpr, BU4: tl.constexpr, BU5: tl.constexpr,
        BK1: tl.constexpr, BK3: tl.constexpr, BK4: tl.constexpr, BK5: tl.constexpr,
        HAS_BIAS: tl.constexpr, PREFETCH: tl.constexpr, DOT_PREC: tl.constexpr, MAX: tl.constexpr,
        L2PF: tl.constexpr, TRACE: tl.constexpr,
    ):
        pid = tl.program_id(0)
        P = tl.num_programs(0)
        DT: tl.constexpr = h_ptr.dtype.element_ty
        PT: tl.constexpr = tl.pointer_type(DT)
        HALF = D // 2
        N_QKV = (HQ + 2 * HKV) * D
        U1, U3, U4, U5 = N_QKV // 2, H // 2, INTER, H // 2
        K3 = HQ * D
        err = L * 5
        # this step's row: slot (-1 = padding: nothing stored), context (clamped to the table), partition
        slot = tl.load(slot_ptr)
        slot_ok = (slot >= 0) & (slot < num_slots)
        slot = tl.where(slot_ok, slot, 0)
        ctx = tl.minimum(tl.load(ctx_ptr), max_blocks * BS)
        part = tl.maximum(tl.cdiv(tl.cdiv(ctx, S), BLOCK_T) * BLOCK_T, BLOCK_T)  # >= 1 tile (ctx 0: padding)
        n_part = tl.cdiv(ctx, part)          # partitions that hold a token
        failed = pid * 0
        V0: tl.constexpr = 1 if PREFETCH else 0
        pre_lo, pre_hi = _first_tiles(tl.load(table_ptr).to(PT), pid, P, U1, H, 0, HALF, 0, V0, BU1, BK1)
        for layer in range(L):
            tab = table_ptr + layer * 6
            w_qkv = tl.load(tab).to(PT)
            w_o = tl.load(tab + 1).to(PT)
            w_gu = tl.load(tab + 2).to(PT)
            w_dn = tl.load(tab + 3).to(PT)
            kc = tl.load(tab + 4).to(PT)
            vc = tl.load(tab + 5).to(PT)
            g1 = norms_ptr + layer * 2 * H
            g2 = g1 + H
            _stamp(trace_ptr, layer, 0, pid, P, TRACE)
            # S1: rms_norm -> QKV (+ bias) -> RoPE -> q to the workspace, k/v to the pools; the O and gate/up
            # shares start streaming into L2 now, under S1, the barriers and the attention
            _l2_prefetch(w_o, pid, P, U3, K3, 1, HALF, 0, pf_budget, 1, L2PF)
            _l2_prefetch(w_gu, pid, P, U4, H, 2, HALF, INTER, pf_budget, 1, L2PF)
            if not PREFETCH:
                pre_lo, pre_hi = _first_tiles(w_qkv, pid, P, U1, H, 0, HALF, 0, 1, BU1, BK1)
            inv = _inv_rms(h_ptr, H, eps, BLOCK_H)
            _gemv_stage(w_qkv, pid, P, U1, H, pre_lo, pre_hi, 0, HALF, 0, 0, h_ptr, g1, inv, pl_ptr, n_part, S,
                        D, 0, q_ws, bias_ptr + layer * N_QKV, cos_ptr, sin_ptr, kc, vc, slot, slot_ok, HQ, HKV,
                        s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, BS, DT, BU1, BK1, BLOCK_S, HAS_BIAS)
            _stamp(trace_ptr, layer, 1, pid, P, TRACE)
            _arrive(sync_ptr, layer * 5)
            if PREFETCH:  # in flight while this program waits (after the release: it does not wait for them)
                o_lo, o_hi = _first_tiles(w_o, pid, P, U3, K3, 1, HALF, 0, 1, BU3, BK3)
            failed = _wait(sync_ptr, layer * 5, err, P, failed, MAX)
            _stamp(trace_ptr, layer, 2, pid, P, TRACE)
            # S2: attention partitions
            _attention(pid, P, q_ws, kc, vc, bt_ptr, ctx, part, po_ptr, pl_ptr, sm_scale_log2,
                       s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, HKV, G, S, D, BS, BLOCK_G, BLOCK_D, BLOCK_T, DOT_PREC)
            _stamp(trace_ptr, layer, 3, pid, P, TRACE)
            _arrive(sync_ptr, layer * 5 + 1)
            failed = _wait(sync_ptr, layer * 5 + 1, err, P, failed, MAX)
            _stamp(trace_ptr, layer, 4, pid, P, TRACE)
            # S3: merge the partitions -> O GEMV -> h += o
            if not PREFETCH:
                o_lo, o_hi = _first_tiles(w_o, pid, P, U3, K3, 1, HALF, 0, 1, BU3, BK3)
            _gemv_stage(w_o, pid, P, U3, K3, o_lo, o_hi, 1, HALF, 0, 1, po_ptr, g1, inv, pl_ptr, n_part, S, D,
                        1, h_ptr, bias_ptr, cos_ptr, sin_ptr, kc, vc, slot, slot_ok, HQ, HKV,
                        s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, BS, DT, BU3, BK3, BLOCK_S, False)
            _stamp(trace_ptr, layer, 5, pid, P, TRACE)
            _arrive(sync_ptr, layer * 5 + 2)
            if PREFETCH:
                gu_lo, gu_hi = _first_tiles(w_gu, pid, P, U4, H, 2, HALF, INTER, 1, BU4, BK4)
            failed = _wait(sync_ptr, layer * 5 + 2, err, P, failed, MAX)
            _stamp(trace_ptr, layer, 6, pid, P, TRACE)
            # S4: rms_norm -> gate/up -> silu(gate) * up
            if not PREFETCH:
                gu_lo, gu_hi = _first_tiles(w_gu, pid, P, U4, H, 2, HALF, INTER, 1, BU4, BK4)
            _l2_prefetch(w_dn, pid, P, U5, INTER, 1, HALF, 0, pf_budget, 1, L2PF)
            inv2 = _inv_rms(h_ptr, H, eps, BLOCK_H)
            _gemv_stage(w_gu, pid, P, U4, H, gu_lo, gu_hi, 2, HALF, INTER, 0, h_ptr, g2, inv2, pl_ptr, n_part, S, D,
                        2, act_ws, bias_ptr, cos_ptr, sin_ptr, kc, vc, slot, slot_ok, HQ, HKV,
                        s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, BS, DT, BU4, BK4, BLOCK_S, False)
            _stamp(trace_ptr, layer, 7, pid, P, TRACE)
            _arrive(sync_ptr, layer * 5 + 3)
            if PREFETCH:
                dn_lo, dn_hi = _first_tiles(w_dn, pid, P, U5, INTER, 1, HALF, 0, 1, BU5, BK5)
            failed = _wait(sync_ptr, layer * 5 + 3, err, P, failed, MAX)
            _stamp(trace_ptr, layer, 8, pid, P, TRACE)
            # S5: down GEMV -> h += y
            if not PREFETCH:
                dn_lo, dn_hi = _first_tiles(w_dn, pid, P, U5, INTER, 1, HALF, 0, 1, BU5, BK5)
            nxt = layer + 1 < L
            nxt_qkv = tl.load(table_ptr + tl.minimum(layer + 1, L - 1) * 6).to(PT)
            _l2_prefetch(nxt_qkv, pid, P, U1, H, 0, HALF, 0, pf_budget, nxt.to(tl.int32), L2PF)
            _gemv_stage(w_dn, pid, P, U5, INTER, dn_lo, dn_hi, 1, HALF, 0, 2, act_ws, g2, inv2, pl_ptr, n_part, S, D,
                        1, h_ptr, bias_ptr, cos_ptr, sin_ptr, kc, vc, slot, slot_ok, HQ, HKV,
                        s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, BS, DT, BU5, BK5, BLOCK_S, False)
            _stamp(trace_ptr, layer, 9, pid, P, TRACE)
            if nxt:
                _arrive(sync_ptr, layer * 5 + 4)
            if PREFETCH:  # the next layer's QKV tiles (none after the last layer)
                pre_lo, pre_hi = _first_tiles(nxt_qkv, pid, P, U1, H, 0, HALF, 0, nxt.to(tl.int32), BU1, BK1)
            if nxt:
                failed = _wait(sync_ptr, layer * 5 + 4, err, P, failed, MAX)
            _stamp(trace_ptr, layer, 10, pid, P, TRACE)
        # the last stage: arrive only; the last program to arrive zeroes every counter for the next launch
        tl.debug_barrier()
        last = tl.atomic_add(sync_ptr + L * 5 - 1, 1, sem="acq_rel", scope="gpu")
        if last == P - 1:
            for i0 in range(0, L * 5, BLOCK_H):
                offs = i0 + tl.arange(0, BLOCK_H)
                tl.store(sync_ptr + offs, tl.zeros([BLOCK_H], tl.int32), mask=offs < L * 5)


# ---- launcher -------------------------------------------------------------------------------------------

def _plan(layers: PersistentDecodeLayers, device: torch.device, tune: PersistentDecodeTuning) -> dict:
    """Grid, partitions and tile sizes from the shapes."""
    w0 = layers.layers[0]
    h, inter = w0.qkv.shape[1], w0.gate_up.shape[0] // 2
    hq, hkv, d = layers.num_heads, layers.num_kv_heads, layers.k_caches[0].shape[-1]
    p = tune.programs or num_sms(device)
    s = tune.splits or max(1, min(16, cdiv(16, hkv)))
    pow2 = [tune.tile_elems, tune.max_units] + ([tune.block_k] if tune.block_k else [])
    if p < 1 or s < 1 or any(v < 1 or v & (v - 1) for v in pow2):
        raise KernelInputError(f"need programs, splits >= 1 and power-of-two tile_elems / block_k / max_units, "
                               f"got {tune}")
    if tune.block_t < 16 or tune.block_t & (tune.block_t - 1):
        raise KernelInputError(f"block_t must be a power of two >= 16, got {tune.block_t}")

    def bu(units: int) -> int:
        return min(tune.max_units, next_pow2(cdiv(units, p)))

    def bk(units: int, k: int) -> int:
        return tune.block_k or max(16, min(next_pow2(k), tune.tile_elems // bu(units)))

    stages = {"1": ((hq + 2 * hkv) * d // 2, h), "3": (h // 2, hq * d), "4": (inter, h), "5": (h // 2, inter)}
    tiles = {f"BU{n}": bu(u) for n, (u, _) in stages.items()} | {f"BK{n}": bk(u, k) for n, (u, k) in stages.items()}
    return dict(programs=p, splits=s, **tiles, BLOCK_H=next_pow2(max(h, layers.sync.numel())),
                BLOCK_G=max(16, next_pow2(hq // hkv)), BLOCK_D=max(16, next_pow2(d)), BLOCK_T=tune.block_t,
                BLOCK_S=next_pow2(s))


def _l2_prefetch_ok(layers: PersistentDecodeLayers, h: torch.Tensor, tune: PersistentDecodeTuning) -> bool:
    """The bulk L2 prefetch needs sm_90 PTX and 16-byte aligned rows (K * 2 bytes apart from an aligned base)."""
    if tune.l2_prefetch_kb <= 0 or not h.is_cuda or torch.cuda.get_device_capability(h.device)[0] < 9:
        return False
    return all(t.data_ptr() % 16 == 0 and (t.shape[1] * t.element_size()) % 16 == 0
               for w in layers.layers for t in (w.qkv, w.o, w.gate_up, w.down))


def decode_persistent(
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    layers: PersistentDecodeLayers,
    *,
    tuning: PersistentDecodeTuning | None = None,
    trace: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Every decoder layer of one batch-1 decode step: h, the residual stream, updated in place.

    Args:
        h: [1, H] the embedding's output (bf16, fp16 or fp32: the layers' dtype); on return the residual stream
            after the last layer (the final norm and head are the caller's).
        cos, sin: [1, D] fp32 RoPE tables of the token's position (halves equal).
        slot_mapping: [1] int64 the token's flat cache slot (-1: padding, nothing stored).
        block_tables: [1, max_blocks] int32; context_lens: [1] int32 (the new token included).
        layers: :meth:`PersistentDecodeLayers.build` (weights, pools, tables, workspaces).
        tuning: launch parameters (Triton only); backend: "auto", "triton" or "torch".
        trace: optional int64 [L * 11 * P] (Triton on CUDA only): each program's ``%clock64`` at the 11 events of
            every layer (S1 start, S1 end, barrier 0 passed, S2 end, barrier 1 passed, S3 end, barrier 2 passed,
            S4 end, barrier 3 passed, S5 end, barrier 4 passed), ``[layer, event, program]``.

    Returns:
        h (the same tensor).

    Raises:
        KernelInputError: a dtype, shape, stride or device mismatch.
    """
    w0, kc0 = layers.layers[0], layers.k_caches[0]
    hid, d = w0.qkv.shape[1], kc0.shape[-1]
    check_tensor("h", h, 2, FLOAT_DTYPES)
    check_shape("h", h, (1, hid))
    if not h.is_contiguous():
        raise KernelInputError("h must be contiguous")
    check_same_dtype(h=h, qkv=w0.qkv)
    for name, table in (("cos", cos), ("sin", sin)):
        check_tensor(name, table, 2, (torch.float32,))
        check_shape(name, table, (1, d))
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,))
    check_shape("slot_mapping", slot_mapping, (1,))
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    check_shape("block_tables", block_tables, (1, block_tables.shape[1]))
    check_tensor("context_lens", context_lens, 1, (torch.int32,))
    check_shape("context_lens", context_lens, (1,))
    check_same_device(h=h, cos=cos, sin=sin, slot_mapping=slot_mapping, block_tables=block_tables,
                      context_lens=context_lens, qkv=w0.qkv)
    if not use_triton(backend, h, cos, sin, slot_mapping, block_tables, context_lens, w0.qkv, kc0):
        return decode_persistent_reference(h, cos, sin, slot_mapping, block_tables, context_lens, layers)
    tune = tuning or PersistentDecodeTuning()
    plan = _plan(layers, h.device, tune)
    s = plan["splits"]
    q_ws, act_ws, part_out, part_lse = layers.workspace(s)
    nb, bs, hkv, _ = kc0.shape
    vc0 = layers.v_caches[0]
    bias = layers.biases if layers.biases is not None else layers.norms
    if trace is not None:
        check_tensor("trace", trace, 1, (torch.int64,))
        check_shape("trace", trace, (len(layers.layers) * TRACE_EVENTS * plan["programs"],))
        if not trace.is_cuda:
            raise KernelInputError("trace needs a CUDA launch (%clock64 is inline asm)")
    _decode_persistent_kernel[(plan["programs"],)](
        h, cos, sin, slot_mapping, block_tables, context_lens, layers.table, layers.norms, bias, layers.sync,
        q_ws, act_ws, part_out, part_lse, trace if trace is not None else layers.sync,
        len(layers.layers), hid, w0.gate_up.shape[0] // 2, layers.num_heads, hkv, layers.num_heads // hkv, d, s,
        block_tables.shape[1], nb * bs, layers.eps, 1.4426950408889634 / math.sqrt(d), tune.l2_prefetch_kb * 1024,
        kc0.stride(0), kc0.stride(1), kc0.stride(2), vc0.stride(0), vc0.stride(1), vc0.stride(2),
        BS=bs, BLOCK_H=plan["BLOCK_H"], BLOCK_G=plan["BLOCK_G"], BLOCK_D=plan["BLOCK_D"],
        BLOCK_T=plan["BLOCK_T"], BLOCK_S=plan["BLOCK_S"], **{k: v for k, v in plan.items() if k[:2] in ("BU", "BK")},
        HAS_BIAS=layers.biases is not None, PREFETCH=tune.prefetch,
        DOT_PREC=dot_precision(h.dtype), MAX=MAX_POLLS, L2PF=_l2_prefetch_ok(layers, h, tune), TRACE=trace is not None,
        num_warps=tune.num_warps,
    )
    return h
