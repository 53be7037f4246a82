"""Public surface of `kernels` and the launchers' argument checks."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import (
    BackendUnavailableError,
    KernelInputError,
    paged_decode_attention,
    paged_prefill_attention,
    store_kv,
)


def test_exported_members():
    assert sorted(kernels.__all__) == sorted([
        "BackendUnavailableError", "KernelError", "KernelInputError",
        "paged_decode_attention", "paged_decode_attention_reference",
        "paged_prefill_attention", "paged_prefill_attention_reference",
        "store_kv", "store_kv_reference",
        "rms_norm", "rms_norm_reference", "add_rms_norm", "add_rms_norm_reference", "rope", "rope_reference",
        "silu_mul", "silu_mul_reference", "GemvTuning", "gemv", "gemv_reference",
        "GemvInt4Tuning", "dequantize_int4_rows", "gemv_int4", "gemv_int4_reference", "pack_int4_rows",
        "GemvInt4W32Tuning", "dequantize_int4_w32", "gemv_int4_w32", "gemv_int4_w32_reference",
        "repack_int4_w32", "set_tuning_int4_w32", "tuning_int4_w32",
        "gemv_rms_norm", "gemv_rms_norm_reference", "gemv_silu_mul", "gemv_silu_mul_reference",
        "gemv_int4_w32_rms_norm", "gemv_int4_w32_silu_mul", "rope_store_kv", "rope_store_kv_reference",
        "quantize_kv", "dequantize_kv",
        "GemvFp8Tuning", "dequantize_fp8_rows", "gemv_fp8", "gemv_fp8_reference", "set_tuning_fp8", "tuning_fp8",
        "quantize_fp8_rows", "quantize_fp8_rows_reference", "scaled_mm_fp8", "scaled_mm_fp8_reference",
        "set_pdl", "pdl_enabled",
        "DecodeLayerTuning", "gemv_add_residual", "gemv_add_residual_reference", "norm_gate_up_silu",
        "norm_gate_up_silu_reference", "norm_qkv_rope_store", "norm_qkv_rope_store_reference",
    ])
    for name in kernels.__all__:
        assert getattr(kernels, name).__module__.startswith("kernels.")


def test_kernel_input_error_is_a_value_error():
    assert issubclass(KernelInputError, ValueError) and issubclass(KernelInputError, kernels.KernelError)


def _decode_args():
    k_cache = torch.randn(4, 16, 2, 64)
    return dict(
        q=torch.randn(2, 6, 64), k_cache=k_cache, v_cache=torch.randn_like(k_cache),
        block_tables=torch.zeros(2, 3, dtype=torch.int32), context_lens=torch.ones(2, dtype=torch.int32),
        scale=0.125,
    )


@pytest.mark.parametrize("field,value,msg", [
    ("q", torch.randn(2, 6, 32), "shape"),
    ("q", torch.randn(2, 5, 64), "multiple"),
    ("q", torch.randn(2, 6, 64).bfloat16(), "dtype"),
    ("q", torch.randn(2, 64, 6).transpose(1, 2), "stride"),
    ("block_tables", torch.zeros(2, 3, dtype=torch.int64), "dtype"),
    ("block_tables", torch.zeros(3, 3, dtype=torch.int32), "shape"),
    ("context_lens", torch.ones(2, dtype=torch.int64), "dtype"),
    ("v_cache", torch.randn(4, 16, 2, 32), "shape"),
    ("k_cache", torch.randn(16, 2, 64), "dims"),
])
def test_decode_rejects_bad_arguments(field, value, msg):
    args = _decode_args()
    args[field] = value
    with pytest.raises(KernelInputError, match=msg):
        paged_decode_attention(**args)


def test_decode_rejects_context_past_table():
    args = _decode_args()
    args["context_lens"] = torch.tensor([1, 49], dtype=torch.int32)  # 3 blocks of 16 hold 48
    with pytest.raises(KernelInputError, match="max_blocks"):
        paged_decode_attention(**args)


def test_decode_out_buffer_is_filled():
    args = _decode_args()
    out = torch.full_like(args["q"], float("nan"))
    res = paged_decode_attention(**args, out=out)
    assert res is out and not torch.isnan(out).any()
    with pytest.raises(KernelInputError, match="out"):
        paged_decode_attention(**args, out=torch.empty(2, 6, 64, dtype=torch.float16))


def test_prefill_rejects_bad_lengths():
    args = _decode_args()
    args.pop("context_lens")
    args["q"] = torch.randn(5, 6, 64)
    ctx = torch.tensor([3, 2], dtype=torch.int32)
    with pytest.raises(KernelInputError, match="cu_seqlens_q"):
        paged_prefill_attention(**args, cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32),
                                context_lens=ctx)
    with pytest.raises(KernelInputError, match="end at T"):
        paged_prefill_attention(**args, cu_seqlens_q=torch.tensor([0, 3, 4], dtype=torch.int32),
                                context_lens=ctx)
    with pytest.raises(KernelInputError, match="context_lens"):  # 3 queries but only 2 cached tokens
        paged_prefill_attention(**args, cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32),
                                context_lens=ctx)


def test_store_kv_rejects_bad_arguments():
    k_cache, v_cache = torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8)
    k = v = torch.randn(3, 2, 8)
    with pytest.raises(KernelInputError, match="int64"):
        store_kv(k, v, k_cache, v_cache, torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(KernelInputError, match="shape"):
        store_kv(k, v, k_cache, v_cache, torch.tensor([0, 1]))
    with pytest.raises(KernelInputError, match="dtype"):
        store_kv(k.half(), v.half(), k_cache, v_cache, torch.tensor([0, 1, 2]))
    with pytest.raises(KernelInputError, match="cache size"):
        store_kv(k, v, k_cache, v_cache, torch.tensor([0, 1, 8]))


def test_backend_choice():
    args = _decode_args()
    with pytest.raises(KernelInputError, match="backend"):
        paged_decode_attention(**args, backend="cuda")
    if not torch.cuda.is_available() and not kernels._common._interpreting():
        with pytest.raises(BackendUnavailableError):
            paged_decode_attention(**args, backend="triton")
    auto = paged_decode_attention(**args)
    torch.testing.assert_close(auto, paged_decode_attention(**args, backend="torch"))


def test_the_shared_checks_pass_and_refuse_as_before():
    """``kernels._common``'s checks (one-expression passing paths since session 25): what passes, what is refused."""
    from kernels._common import check_same_device, check_same_dtype, check_shape, check_tensor

    x = torch.zeros(4, 6)
    assert check_tensor("x", x, 2, (torch.float32,)) is x
    assert check_tensor("e", torch.zeros(0, 6).t(), 2, (torch.float32,)) is not None  # empty: any strides
    for bad, msg in [(x.t(), "unit stride"), (x[None], "2 dims"), (x.half(), "dtype"), ([1.0], "torch.Tensor")]:
        with pytest.raises(KernelInputError, match=msg):
            check_tensor("x", bad, 2, (torch.float32,))
    check_shape("x", x, (4, 6))
    check_shape("x", x, [4, 6])
    with pytest.raises(KernelInputError, match=r"shape \(4, 5\)"):
        check_shape("x", x, (4, 5))
    check_same_device(a=x, b=torch.ones(2))
    with pytest.raises(KernelInputError, match="one device"):
        check_same_device(a=x, b=torch.empty(2, device="meta"))
    check_same_dtype(a=x, b=torch.ones(2))
    with pytest.raises(KernelInputError, match="one dtype"):
        check_same_dtype(a=x, b=x.double())
