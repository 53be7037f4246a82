"""GEMV prologues: the elementwise op before a decode GEMV, done while the GEMV loads its input row.

A batch-1 decode layer ran RMSNorm and SiLU·mul as kernels of their own, each a launch of ~1.5-2 µs that
moves a few kilobytes (docs/benchmarks.md, "Where a batch-1 step goes"). Here the GEMV kernels
(``kernels.gemv``, ``kernels.gemv_int4_w32``) apply them to x as they load it:

* ``NORM`` / ``ADD_NORM``: ``y = W (h * inv * g)`` is computed as ``inv * (W (h * g))`` with
  ``inv = rsqrt(mean(h^2) + eps)``: every program already walks the whole row of x, so it sums h^2 on the
  way and scales its outputs once at the end (no pass over x before the weights stream). ``ADD_NORM`` first
  forms ``h = x + residual`` rounded to x's dtype (as ``kernels.add_rms_norm``) and the programs of the
  first column block write h, the next residual stream. The only numeric difference from the unfused pair
  is that the normed row is not rounded to bf16 before the product (fp32 instead: slightly more exact).
* ``SILU``: x is a fused gate/up row ``[gate | up]`` and the GEMV's input is ``silu(gate) * up`` rounded
  once to x's dtype, bit for bit what ``kernels.silu_mul`` writes.
"""

from __future__ import annotations

from ._common import HAS_TRITON, tl, triton

NONE, NORM, ADD_NORM, SILU = 0, 1, 2, 3

# (kernel "gemv" | "w32", prologue, N, K) -> a launch measured best here (bench/gemv_prologue_gpu.py records
# its sweep); the launchers fall back to their defaults
_TUNED: dict[tuple[str, int, int, int], object] = {}


def set_tuning(kernel: str, prologue: int, n: int, k: int, tuning: object | None) -> None:
    """Launch the ``kernel`` GEMV with ``prologue`` on an [N, K] weight with ``tuning`` (None: default)."""
    if tuning is None:
        _TUNED.pop((kernel, prologue, n, k), None)
    else:
        _TUNED[(kernel, prologue, n, k)] = tuning


def tuned(kernel: str, prologue: int, n: int, k: int) -> object | None:
    """The recorded launch of :func:`set_tuning`, or None."""
    return _TUNED.get((kernel, prologue, n, k))

if HAS_TRITON:

    @triton.jit
    def prologue_load(x_row, r_row, g_ptr, h_row, cols, mask, half, h_cols,
                      PROLOGUE: tl.constexpr, MASKED: tl.constexpr):
        """(GEMV input at ``cols`` in fp32, the values whose squares the norm sums) of one row.

        x_row / r_row / h_row: the row's x, residual and residual-out pointers; g_ptr: the norm gain;
        half: the gate/up split (SILU); h_cols: columns of h this program writes (ADD_NORM: K or 0; a
        bound, not a bool, since Triton's interpreter refuses a scalar bool in a mask).
        """
        if PROLOGUE == 3:
            if MASKED:
                gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
                up = tl.load(x_row + half + cols, mask=mask, other=0.0).to(tl.float32)
            else:
                gate = tl.load(x_row + cols).to(tl.float32)
                up = tl.load(x_row + half + cols).to(tl.float32)
            val = (gate / (1.0 + tl.exp(-gate)) * up).to(x_row.dtype.element_ty).to(tl.float32)
            sq = val
        else:
            if MASKED:
                x = tl.load(x_row + cols, mask=mask, other=0.0)
            else:
                x = tl.load(x_row + cols)
            if PROLOGUE == 2:
                if MASKED:
                    r = tl.load(r_row + cols, mask=mask, other=0.0)
                    x = (x.to(tl.float32) + r.to(tl.float32)).to(h_row.dtype.element_ty)  # rounded like x + r
                    tl.store(h_row + cols, x, mask=mask & (cols < h_cols))
                else:
                    r = tl.load(r_row + cols)
                    x = (x.to(tl.float32) + r.to(tl.float32)).to(h_row.dtype.element_ty)
                    tl.store(h_row + cols, x, mask=cols < h_cols)
            sq = x.to(tl.float32)
            val = sq
            if PROLOGUE != 0:
                if MASKED:
                    val = sq * tl.load(g_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                else:
                    val = sq * tl.load(g_ptr + cols).to(tl.float32)
        return val, sq
