"""The L2 prefetch (kernels.l2_prefetch): which bytes it asks for, that it compiles to Hopper's bulk prefetch,
and that it runs on the card without touching anything.

* CPU: :func:`kernels.l2_ranges` (chunks in order, inside each tensor's bytes, 16-byte aligned, the budget) and
  the launcher doing nothing where the prefetch cannot run (CPU tensors, Triton's interpreter).
* Compiled for sm_90 without a GPU (Triton's CUDA backend and its ptxas): one ``cp.async.bulk.prefetch.L2``
  per lane (bulk mode), one ``prefetch.global.L2::evict_last`` per line (lines mode), accepted by ptxas.
* CUDA (marked gpu): the launch over layer-shaped weights completes, alone and captured in a CUDA graph on a
  side stream, and the tensors keep their values.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels._common import HAS_TRITON, _interpreting, triton
from kernels.errors import KernelInputError
from kernels.l2_prefetch import BLOCK, CHUNK_BYTES

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def _covered(r: kernels.L2Ranges) -> list[tuple[int, int]]:
    return list(zip(r.addr.tolist(), (r.addr + r.size).tolist(), strict=True))


def test_ranges_cover_each_tensor_in_order_within_its_bytes():
    a = torch.empty(70_000, dtype=torch.bfloat16)   # 140,000 B: four 32-KB chunks and a 8,928-B tail
    b = torch.empty(100, 3, dtype=torch.float16)     # 600 B
    r = kernels.l2_ranges([a, b], budget=1 << 30)
    spans = _covered(r)
    assert all(lo % 16 == 0 and (hi - lo) % 16 == 0 and 0 < hi - lo <= CHUNK_BYTES for lo, hi in spans)
    a0, a1 = a.data_ptr(), a.data_ptr() + a.numel() * 2
    b0, b1 = b.data_ptr(), b.data_ptr() + b.numel() * 2
    in_a = [s for s in spans if a0 <= s[0] < a1]
    in_b = [s for s in spans if b0 <= s[0] < b1]
    assert spans == in_a + in_b  # a's chunks first, then b's: the order the step reads them
    for (_, hi), (lo2, _) in zip(in_a, in_a[1:], strict=False):
        assert hi == lo2  # contiguous
    assert in_a[0][0] == -(-a0 // 16) * 16 and in_a[-1][1] == a1 // 16 * 16 and in_a[-1][1] <= a1
    assert in_b[0][0] >= b0 and in_b[-1][1] <= b1 and in_b[-1][1] > b1 - 16
    assert r.nbytes == sum(hi - lo for lo, hi in spans)
    assert r.addr.dtype == torch.int64 and r.size.dtype == torch.int32


def test_ranges_stop_at_the_budget():
    a, b = torch.empty(50_000, dtype=torch.float32), torch.empty(50_000, dtype=torch.float32)
    r = kernels.l2_ranges([a, b], budget=250_000)     # a (200,000 B) whole, then b's first ~50,000 B
    spans = _covered(r)
    assert a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0  # torch's CPU allocations: 64-byte aligned
    assert r.nbytes == 250_000 and spans[-1][1] == b.data_ptr() + 50_000
    assert kernels.l2_ranges([a], budget=0).nbytes == 0 and len(kernels.l2_ranges([a], budget=0)) == 0


def test_ranges_refuse_what_is_not_one_range():
    with pytest.raises(KernelInputError, match="contiguous"):
        kernels.l2_ranges([torch.empty(8, 8).t()], budget=1 << 20)
    with pytest.raises(KernelInputError, match="multiple of 16"):
        kernels.l2_ranges([torch.empty(8)], budget=1 << 20, chunk=100)


def test_prefetch_does_nothing_where_it_cannot_run():
    r = kernels.l2_ranges([torch.empty(4096)], budget=1 << 20)
    assert len(r) == 1 and not kernels.l2_prefetch_supported(torch.device("cpu"))
    assert kernels.l2_prefetch(r) is False and kernels.l2_prefetch(r, mode="lines") is False
    with pytest.raises(KernelInputError, match="mode"):
        kernels.l2_prefetch(r, mode="loads")


def test_prefetch_compiles_to_the_bulk_l2_prefetch_for_sm90():
    if not HAS_TRITON or _interpreting():
        pytest.skip("needs triton's compiler (not its interpreter)")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from kernels.l2_prefetch import _l2_prefetch_kernel, _l2_prefetch_lines_kernel
        target, opts = GPUTarget("cuda", 90, 32), {"enable_fp_fusion": True}
        sig = {"addr_ptr": "*i64", "size_ptr": "*i32", "C": "i32", "BLOCK": "constexpr"}
        bulk = triton.compile(ASTSource(_l2_prefetch_kernel, sig, constexprs={(3,): BLOCK}), target=target,
                              options={"num_warps": 1, **opts})
        sig = {"addr_ptr": "*i64", "size_ptr": "*i32", "LINES": "constexpr"}
        lines = triton.compile(ASTSource(_l2_prefetch_lines_kernel, sig, constexprs={(2,): CHUNK_BYTES // 128}),
                               target=target, options={"num_warps": 4, **opts})
    except (ImportError, RuntimeError) as exc:  # no CUDA backend / ptxas in this Triton install
        pytest.skip(f"cannot compile for sm_90 here: {exc}")
    assert bulk.asm["ptx"].count("cp.async.bulk.prefetch.L2.global") == 1  # one asm a lane: 32 lanes, one warp
    assert lines.asm["ptx"].count("prefetch.global.L2::evict_last") == 2  # 256 lines over 128 lanes
    assert bulk.asm["cubin"] and lines.asm["cubin"]  # ptxas took both


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs a CUDA device of compute capability 9.0+")
def test_prefetch_runs_on_the_card_alone_and_in_a_graph():
    torch.manual_seed(0)
    ws = [torch.randn(n, 896, device="cuda", dtype=torch.bfloat16) for n in (896, 9728, 1153)]
    want = [w.clone() for w in ws]
    r = kernels.l2_ranges(ws, budget=24 << 20)
    assert r.nbytes == sum(w.numel() * 2 // 16 * 16 for w in ws)
    assert kernels.l2_prefetch(r) is True and kernels.l2_prefetch(r, mode="lines") is True
    torch.cuda.synchronize()  # a fault (a bad address) surfaces here
    side, main = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.randn(1, 896, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=main):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            kernels.l2_prefetch(r)
        y = x @ ws[1].t()
        torch.cuda.current_stream().wait_stream(side)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x @ ws[1].t(), rtol=0, atol=0)
    assert all(torch.equal(w, v) for w, v in zip(ws, want, strict=True))
