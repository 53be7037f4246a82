"""Linear layers with weights pre-packed for oneDNN (the engine's fp32 CPU path).

``F.linear`` hands MKL a plain ``[out, in]`` weight, and MKL re-packs it into its blocked layout on every
call. For the few-row products of decode steps that packing costs as much as the arithmetic: on the
2-core EPYC the SmolLM2 LM head ``[32, 576] x [576, 49152]`` takes 32.6 ms through ``F.linear`` and
18.9 ms through oneDNN with the weight reordered once (``mkldnn._reorder_linear_weight``); MLP
projections gain 1.2-2x for 4-32 rows and ~1.15x at 512, and a one-row pass over all 210 projections of
the model (weights streamed from memory, as in a decode step) takes 29.5 instead of 36 ms. Results agree
with ``F.linear`` to ~1e-6 relative (fp32, a different summation order).

:func:`pack_linears` swaps every ``nn.Linear`` of a model for a :class:`PackedLinear` that keeps the
original ``weight``/``bias`` parameters (same names, same ``state_dict``, tied weights stay tied) and adds
the packed copy, so the model's other users (FHE slicing, the reference decode) see the same modules'
weights. The packed copy is made once: the engine owns its model and never changes weights after load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import f32_mm

# At one row the product streams the weight once; for a weight this large (the LM head) MKL's gemv over a
# transposed ``[in, out]`` copy streams it faster than oneDNN's packed layout (4.9-5.2 vs 6.9-7.4 ms for
# SmolLM2's 49152 x 576 head), so such a weight always keeps that copy. On the Sapphire Rapids box the same
# holds for every SmolLM2 projection at one thread (bench/gemv_cpu.py; with the fused products, batch-1
# decode went 11.9 -> 15.7 tokens per CPU-second, docs/benchmarks.md), so ``one_row_copy=True``
# (``EngineConfig.cpu_one_row_weights``) keeps it for every weight, at one more copy of the weights.
_ONE_ROW_MIN_NUMEL = 1 << 22
# On the AVX-512 AMD EPYC (Zen 4) box of 2026-12-04 MKL's gemv over that copy streams 11-20 GB/s at one thread
# and the native kernel (``kernels.cpu.f32_mm``: one weight row at a time over the weight as stored) 18-23
# (bench/gemv_cpu.py), so where the native kernels load (``EngineConfig.cpu_native_gemv``) one-row products
# take it and no transposed copy is made.


def onednn_available() -> bool:
    """Whether this torch build has the oneDNN packed-linear ops."""
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")
            and hasattr(ops, "_reorder_linear_weight"))


class PackedLinear(nn.Module):
    """``nn.Linear`` semantics over a oneDNN-packed copy of the weight (fp32, CPU, 2-D input)."""

    def __init__(self, linear: nn.Linear, rows_hint: int = 32, one_row_copy: bool | None = None,
                 native: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        w = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, rows_hint)
        self.native = native  # one-row products through kernels.cpu.f32_mm over ``weight`` itself
        keep = not native and (w.numel() >= _ONE_ROW_MIN_NUMEL if one_row_copy is None else one_row_copy)
        self.weight_t = w.t().contiguous() if keep else None  # [in, out], for one-row products

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]."""
        if x.dim() != 2 or x.requires_grad or self.packed is None:  # None: a part of a fused product
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] == 1 and (self.native or self.weight_t is not None):
            out = f32_mm(x, self.weight) if self.native else torch.mm(x, self.weight_t)
            return out if self.bias is None else out.add_(self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def pack_linears(model: nn.Module, one_row_copies: bool = False, native: bool = False) -> int:
    """Replace every fp32 CPU ``nn.Linear`` in ``model`` by a :class:`PackedLinear`; return how many.
    ``one_row_copies``: every weight (not only the large ones) keeps its transposed copy for one-row
    products (faster batch-1 decode, one more copy of the weights). ``native``: one-row products go through
    ``kernels.cpu.f32_mm`` over the weights as stored instead, and no copy is made (the caller checks that
    the native kernels loaded)."""
    if not onednn_available():
        return 0
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear and child.weight.dtype == torch.float32 and not child.weight.is_cuda]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, one_row_copy=True if one_row_copies else None, native=native))
    return len(swaps)


# ---- fused q/k/v and gate/up projections (batch-1 decode: fewer ops per layer) -------------------------
#
# A batch-1 decode step of SmolLM2 runs 210 projections; at one row each is a GEMV of a few tens of us, and
# the per-call cost around it (the bf16 cast of the activation and the fp32 cast back for the int4 kernel,
# output allocation, Python dispatch) is of the same order (measured in docs/benchmarks.md). Concatenating
# q/k/v and gate/up into one weight each runs 120 products per step instead of 210 on the same bytes.


def _fuse_packed(parts: list[PackedLinear]) -> PackedLinear:
    """One PackedLinear over the row-concatenated weights; the parts' weights become row views of it
    (no fp32 weight stored twice) and their own packed copies are dropped (they fall back to F.linear)."""
    w = torch.cat([p.weight.detach() for p in parts])
    b = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts])
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta")  # no init: replaced below
    lin.weight = nn.Parameter(w, requires_grad=False)
    if b is not None:
        lin.bias = nn.Parameter(b, requires_grad=False)
    fused = PackedLinear(lin, one_row_copy=any(p.weight_t is not None for p in parts) or None,
                         native=parts[0].native)
    row = 0
    for p in parts:
        n = p.out_features
        p.weight = nn.Parameter(w[row:row + n], requires_grad=False)
        if b is not None:
            p.bias = nn.Parameter(b[row:row + n], requires_grad=False)
        p.packed, p.weight_t, p.native = None, None, False
        row += n
    return fused


def _fuse_int4(parts: list):
    """One Int4Linear over the row-concatenated planes; the parts' packed data and scales become row views
    of the fused ones (each part keeps its own small bf16 kernel-scale copy)."""
    from engine.quant import Int4Linear, Int4Plane

    planes = []
    for i in range(len(parts[0].planes)):
        ps = [p.planes[i] for p in parts]
        planes.append(Int4Plane(torch.cat([p.packed for p in ps]), torch.cat([p.scale for p in ps]),
                                torch.cat([p.offset for p in ps])))
    bias = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts])
    fused = Int4Linear(planes, parts[0].group_size, parts[0].in_features, bias, kind=parts[0].kind)
    row = 0
    for p in parts:
        n = p.out_features
        p.planes = [Int4Plane(f.packed[row:row + n], f.scale[row:row + n], f.offset[row:row + n])
                    for f in planes]
        row += n
    return fused


def fuse_linears(parts: list[nn.Module]) -> nn.Module | None:
    """A module computing ``cat([p(x) for p in parts], -1)`` in one product, or None where the parts
    cannot share one weight (mixed kinds, group sizes, plane counts, biases or input widths)."""
    from engine.quant import Int4Linear

    first = parts[0]
    if len({p.in_features for p in parts}) != 1 or len({p.bias is None for p in parts}) != 1:
        return None
    if all(type(p) is PackedLinear and p.packed is not None for p in parts):
        return _fuse_packed(parts)
    same = all(type(p) is Int4Linear and p.group_size == first.group_size and p.kind == first.kind
               and len(p.planes) == len(first.planes)
               and all(q.scale.dtype == f.scale.dtype and q.offset.dtype == f.offset.dtype
                       for q, f in zip(p.planes, first.planes, strict=True)) for p in parts)
    return _fuse_int4(parts) if same else None


def fuse_projections(model: nn.Module) -> int:
    """Give every decoder layer a fused q/k/v and gate/up product where its projections allow; return
    how many were fused. The fused modules are plain attributes (``fused_qkv``, ``fused_gate_up``), not
    submodules: ``state_dict`` and the original projections (FHE slicing, tests) stay as they were."""
    done = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.fused_qkv is None:
            fused = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
            if fused is not None:
                object.__setattr__(attn, "fused_qkv", fused)
                done += 1
        if mlp.fused_gate_up is None:
            fused = fuse_linears([mlp.gate_proj, mlp.up_proj])
            if fused is not None:
                object.__setattr__(mlp, "fused_gate_up", fused)
                done += 1
    return done


def fused_modules(model: nn.Module) -> list[nn.Module]:
    """The fused products of :func:`fuse_projections` (they are not in ``model.modules()``)."""
    out = []
    for layer in model.model.layers:
        out += [m for m in (layer.self_attn.fused_qkv, layer.mlp.fused_gate_up) if m is not None]
    return out
