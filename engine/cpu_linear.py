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

# At one row the product streams the weight once; for a weight this large (the LM head) MKL's gemv over a
# transposed ``[in, out]`` copy streams it faster than oneDNN's packed layout (4.9-5.2 vs 6.9-7.4 ms for
# SmolLM2's 49152 x 576 head), so such a weight also keeps that copy.
_ONE_ROW_MIN_NUMEL = 1 << 22


def onednn_available() -> bool:
    """Whether this torch build has the oneDNN packed-linear ops."""
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")
            and hasattr(ops, "_reorder_linear_weight"))


class PackedLinear(nn.Module):
    """``nn.Linear`` semantics over a oneDNN-packed copy of the weight (fp32, CPU, 2-D input)."""

    def __init__(self, linear: nn.Linear, rows_hint: int = 32) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        w = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, rows_hint)
        self.weight_t = w.t().contiguous() if w.numel() >= _ONE_ROW_MIN_NUMEL else None  # [in, out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]."""
        if x.dim() != 2 or x.requires_grad:
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] == 1 and self.weight_t is not None:
            out = torch.mm(x, self.weight_t)
            return out if self.bias is None else out.add_(self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def pack_linears(model: nn.Module) -> int:
    """Replace every fp32 CPU ``nn.Linear`` in ``model`` by a :class:`PackedLinear`; return how many."""
    if not onednn_available():
        return 0
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear and child.weight.dtype == torch.float32 and not child.weight.is_cuda]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)
