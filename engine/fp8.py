"""FP8 (e4m3) linears of the fused CUDA forward (``EngineConfig.cuda_weight_format = "fp8"``).

The scheme of vLLM's dynamic fp8 (``quantization="fp8"`` on a bf16 checkpoint, per-channel weight scales as
its compressed-tensors ``FP8_DYNAMIC``): each weight is quantized once, at load, to float8_e4m3fn with
one fp32 scale per output channel (``scale[n] = amax_k |w[n, k]| / 448``); activations are quantized per
token at run time. Which kernel a product takes depends on its rows:

* one row (batch-1 decode), or up to :data:`GEMV_MAX_ROWS` rows while rows x weight bytes stay under
  :data:`GEMV_MAX_BYTES` (small decode batches on the smaller GEMMs): ``kernels.gemv_fp8``, weight-only:
  the bf16 activations are not rounded to fp8, the GEMV streams one byte per weight (half of bf16's) and
  the tensor cores would idle at one row anyway;
* more rows, K and N multiples of 16: ``kernels.scaled_mm_fp8``, W8A8 — per-token e4m3 activations and
  ``torch._scaled_mm`` on the fp8 tensor cores (1372 vs 786 TFLOP/s bf16 measured on an H100, 8192^3);
* more rows, other shapes (a vocabulary such as 97 that is no multiple of 16): a transient dequantized copy
  of the weight and ``F.linear``, as the int4 layers prefill.

On CPU the kernels run their torch references (the same quantized operands, fp32 products): that is what
CI tests and what the quality bench measures on the real default model; the CPU engine itself has its own
formats (``EngineConfig.weight_format``). fp8 tensor cores need compute capability 8.9 (Ada, Hopper);
:func:`check_device` refuses an older GPU with :class:`~engine.errors.UnsupportedModelError`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

import kernels
from engine.errors import UnsupportedModelError

# which products run the weight-only GEMV: one row always; up to GEMV_MAX_ROWS rows while rows x weight bytes
# stay under GEMV_MAX_BYTES (the GEMV re-reads W per row; the W8A8 path costs ~7-25 us at any few rows).
# Fitted to the H100 run of 2026-12-06 (docs/benchmarks.md, "FP8 weights on the GPU"): at 2 rows the GEMV
# won on every Llama-1B / Qwen-0.5B layer GEMM but Llama's gate_up (64 MiB) and the heads; at 4 rows on
# those under ~35 MB. Measured per GEMM, not yet as engine steps at batch 2 and 4.
GEMV_MAX_ROWS = 4
GEMV_MAX_BYTES = 48 << 20
MIN_CAPABILITY = (8, 9)


@dataclasses.dataclass
class Fp8Linear:
    """A linear's weight in e4m3 with per-output-channel fp32 scales: ``w[n, k] = scale[n] * weight[n, k]``.

    Called as ``lin(x, bias)``: ``x [T, K] -> [T, N]`` in x's dtype, through the kernel its row count picks
    (module docstring).
    """

    weight: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor   # [N] fp32

    @classmethod
    @torch.no_grad()
    def quantize(cls, w: torch.Tensor) -> Fp8Linear:
        """Round-to-nearest e4m3 of a [N, K] weight (any float dtype, on its device), one scale per row:
        the activations' per-row rule (``kernels.quantize_fp8_rows_reference``) applied to W's rows."""
        q, scale = kernels.quantize_fp8_rows_reference(w)
        return cls(q, scale[:, 0].contiguous())

    @property
    def gemm_ok(self) -> bool:
        """Whether ``torch._scaled_mm`` takes this shape (K and N multiples of 16)."""
        n, k = self.weight.shape
        return n % 16 == 0 and k % 16 == 0

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        if rows == 1 or (rows <= GEMV_MAX_ROWS and rows * self.weight.numel() <= GEMV_MAX_BYTES):
            return kernels.gemv_fp8(x, self.weight, self.scale, bias)
        if self.gemm_ok:
            return kernels.scaled_mm_fp8(x, self.weight, self.scale, bias)
        return F.linear(x, self.dequantize(x.dtype), bias)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight ``scale * weight`` [N, K] in ``dtype`` (exact in fp32)."""
        return kernels.dequantize_fp8_rows(self.weight, self.scale).to(dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale))


def check_device(device: torch.device) -> None:
    """Refuse fp8 weights on a CUDA GPU without fp8 tensor cores (CPU runs the torch references)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < MIN_CAPABILITY:
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise UnsupportedModelError(f"cuda_weight_format 'fp8' needs a GPU of compute capability >= 8.9 "
                                    f"(Ada, Hopper), this one is {cap}: use 'bf16' or 'int4'")
