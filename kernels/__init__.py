"""cipherlm's kernels: Triton kernels with typed launchers and their torch references.

Each launcher checks its arguments' dtypes, shapes, strides and devices (raising :class:`KernelInputError`,
a ValueError) and runs the Triton kernel on CUDA tensors when Triton imports, the torch reference otherwise
(``backend="torch"`` / ``"triton"`` forces one). Exceptions: see :mod:`kernels.errors`. The KV kernels also
take fp8 (e4m3) pools with per-KV-head scales (:mod:`kernels.kv_quant`).
"""

from ._pdl import pdl_enabled, set_pdl
from .decode_layer import (
    DecodeLayerTuning,
    gemv_add_residual,
    gemv_add_residual_reference,
    norm_gate_up_silu,
    norm_gate_up_silu_reference,
    norm_qkv_rope_store,
    norm_qkv_rope_store_reference,
)
from .errors import BackendUnavailableError, KernelError, KernelInputError
from .gemv import (
    GemvTuning,
    gemv,
    gemv_reference,
    gemv_rms_norm,
    gemv_rms_norm_reference,
    gemv_silu_mul,
    gemv_silu_mul_reference,
)
from .gemv_fp8 import (
    GemvFp8Tuning,
    dequantize_fp8_rows,
    gemv_fp8,
    gemv_fp8_reference,
    set_tuning_fp8,
    tuning_fp8,
)
from .gemv_int4 import GemvInt4Tuning, dequantize_int4_rows, gemv_int4, gemv_int4_reference, pack_int4_rows
from .gemv_int4_w32 import (
    GemvInt4W32Tuning,
    dequantize_int4_w32,
    gemv_int4_w32,
    gemv_int4_w32_reference,
    gemv_int4_w32_rms_norm,
    gemv_int4_w32_silu_mul,
    repack_int4_w32,
    set_tuning_int4_w32,
    tuning_int4_w32,
)
from .kv_quant import dequantize_kv, quantize_kv
from .paged_decode import paged_decode_attention, paged_decode_attention_reference
from .paged_prefill import paged_prefill_attention, paged_prefill_attention_reference
from .rms_norm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference
from .rope import rope, rope_reference
from .rope_store_kv import rope_store_kv, rope_store_kv_reference
from .scaled_mm_fp8 import (
    quantize_fp8_rows,
    quantize_fp8_rows_reference,
    scaled_mm_fp8,
    scaled_mm_fp8_reference,
)
from .silu_mul import silu_mul, silu_mul_reference
from .store_kv import store_kv, store_kv_reference

__all__ = [
    "pdl_enabled",
    "set_pdl",
    "BackendUnavailableError",
    "DecodeLayerTuning",
    "gemv_add_residual",
    "gemv_add_residual_reference",
    "norm_gate_up_silu",
    "norm_gate_up_silu_reference",
    "norm_qkv_rope_store",
    "norm_qkv_rope_store_reference",
    "GemvTuning",
    "gemv",
    "gemv_reference",
    "gemv_rms_norm",
    "gemv_rms_norm_reference",
    "gemv_silu_mul",
    "gemv_silu_mul_reference",
    "GemvFp8Tuning",
    "dequantize_fp8_rows",
    "gemv_fp8",
    "gemv_fp8_reference",
    "quantize_fp8_rows",
    "quantize_fp8_rows_reference",
    "scaled_mm_fp8",
    "scaled_mm_fp8_reference",
    "set_tuning_fp8",
    "tuning_fp8",
    "GemvInt4Tuning",
    "dequantize_int4_rows",
    "gemv_int4",
    "gemv_int4_reference",
    "pack_int4_rows",
    "GemvInt4W32Tuning",
    "dequantize_int4_w32",
    "gemv_int4_w32",
    "gemv_int4_w32_reference",
    "gemv_int4_w32_rms_norm",
    "gemv_int4_w32_silu_mul",
    "repack_int4_w32",
    "set_tuning_int4_w32",
    "tuning_int4_w32",
    "add_rms_norm",
    "add_rms_norm_reference",
    "KernelError",
    "KernelInputError",
    "dequantize_kv",
    "quantize_kv",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "paged_prefill_attention",
    "paged_prefill_attention_reference",
    "rms_norm",
    "rms_norm_reference",
    "rope",
    "rope_reference",
    "rope_store_kv",
    "rope_store_kv_reference",
    "silu_mul",
    "silu_mul_reference",
    "store_kv",
    "store_kv_reference",
]
