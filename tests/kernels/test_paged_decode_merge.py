"""Decode attention with the split-K merge in the partition kernel (``DecodeTuning.merge_in_partition``): one launch,
the last program of each (sequence, KV head) to finish merges its partitions and resets its ticket counter.

* CPU: the switch (:func:`kernels.set_tuning_decode`) and its default (off).
* Triton's interpreter (``TRITON_INTERPRET=1``; in a child process on a plain CPU run): the one launch equals the
  two-launch path bit for bit and the torch reference to the dtype's tolerance, on batches mixing split contexts
  (2-5 partitions), one-partition ones and a 0-token padding row, fp32 / fp16 / fp8 pools, G = 7, 4 and 1 query
  heads a KV head; launches follow each other on the same counters, which are back at zero after each (a wrong
  ticket count leaves a row unmerged, NaN here; a missing reset breaks the next launch).
* CUDA (marked gpu): the same, and a CUDA graph of the one launch replayed on new contexts.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kernels
from kernels import DecodeTuning, paged_decode_attention, paged_decode_attention_reference, quantize_kv
from kernels import paged_decode as pd
from kernels._common import _TICKET_COUNTERS, HAS_TRITON, _interpreting
from tests.kernels.paged_case import make_paged_case, rel_err

INTERPRET = HAS_TRITON and _interpreting()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOW = torch.float16 if INTERPRET else torch.bfloat16  # numpy has no bf16: fp16 stands in for it
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}
SAME = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}  # CUDA: one launch vs two, a rounding apart
MODELS = {"qwen2.5-0.5b": (14, 2, 64), "d128": (8, 2, 128), "mha": (2, 2, 64)}  # (Hq, Hkv, D): G = 7, 4, 1
MERGE = DecodeTuning(merge_in_partition=True)
TWO = DecodeTuning(merge_in_partition=False)
PARTITION = 64
LENS = [129, 1, 0, 260, 64, 200]  # partitions of 64: 3, 1, none (a padding row), 5, 1, 4
LATER = [65, 0, 0, 250, 1, 190]  # then shorter ones on the same pool and counters: 2, -, -, 4, 1, 3


def kernel_test(fn):
    """A Triton test: on CUDA (marked gpu) or under the interpreter."""
    fn = pytest.mark.skipif(not (HAS_TRITON and (torch.cuda.is_available() or INTERPRET)),
                            reason="needs triton and CUDA (or TRITON_INTERPRET=1)")(fn)
    return fn if INTERPRET else pytest.mark.gpu(fn)


@pytest.fixture(autouse=True)
def _default_tuning_after():
    yield
    kernels.set_tuning_decode(None)


def test_switch_defaults_off_and_round_trips():
    assert not kernels.tuning_decode().merge_in_partition and not DecodeTuning().merge_in_partition
    kernels.set_tuning_decode(MERGE)
    assert kernels.tuning_decode() is MERGE
    kernels.set_tuning_decode(None)
    assert kernels.tuning_decode() == DecodeTuning()


def _counters_zero() -> bool:
    return all(int(c.abs().sum()) == 0 for c in _TICKET_COUNTERS.values())


def _launch(q, case, tuning, scales: dict) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))  # an unwritten row stays NaN
    paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, q.shape[-1] ** -0.5,
                           partition_size=PARTITION, out=out, tuning=tuning, backend="triton", **scales)
    return out


def _check_launches(case, ref_pools, hq: int, dtype: torch.dtype, gen, scales: dict) -> None:
    """Two launches in a row (LENS, then LATER on the same pool): one launch == two launches, ~ the reference."""
    for lens in (LENS, LATER):
        case.context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        q = torch.randn(len(lens), hq, ref_pools[0].shape[-1], generator=gen).to(DEVICE, dtype)
        one, two = _launch(q, case, MERGE, scales), _launch(q, case, TWO, scales)
        assert _counters_zero()
        ref = paged_decode_attention_reference(q.float(), *ref_pools, case.block_tables, case.context_lens,
                                               q.shape[-1] ** -0.5, scales.get("k_scale"), scales.get("v_scale"))
        assert not torch.isnan(one).any()
        if INTERPRET:  # the same merge code on the same values: the same bits
            assert torch.equal(one, two)
        else:  # another tile shape may sum in another order
            torch.testing.assert_close(one.float(), two.float(), rtol=SAME[dtype], atol=SAME[dtype])
        assert rel_err(one, ref) < TOL[dtype]


@pytest.mark.parametrize("model,dtype", [("qwen2.5-0.5b", torch.float32), ("qwen2.5-0.5b", LOW),
                                         ("d128", LOW), ("mha", torch.float32)])
@kernel_test
def test_one_launch_equals_two_launches_and_the_reference(model, dtype):
    hq, hkv, d = MODELS[model]
    gen = torch.Generator().manual_seed(7)
    case = make_paged_case(LENS, hkv, d, 16, dtype, DEVICE, gen, extra_table_cols=2)
    pools = (case.k_cache.float().nan_to_num(0.0), case.v_cache.float().nan_to_num(0.0))
    _check_launches(case, pools, hq, dtype, gen, {})


@kernel_test
def test_one_launch_on_fp8_pools():
    hq, hkv, d = MODELS["qwen2.5-0.5b"]
    gen = torch.Generator().manual_seed(8)
    case = make_paged_case(LENS, hkv, d, 16, torch.float32, "cpu", gen, extra_table_cols=2)
    ks, vs = torch.tensor([0.02, 0.04]), torch.tensor([0.01, 0.03])
    case.k_cache = quantize_kv(case.k_cache, ks).to(DEVICE)
    case.v_cache = quantize_kv(case.v_cache, vs).to(DEVICE)
    case.block_tables = case.block_tables.to(DEVICE)
    unpoison = [torch.where((p.view(torch.uint8) & 0x7F) == 0x7F, 0, p.view(torch.uint8)).view(p.dtype)
                for p in (case.k_cache, case.v_cache)]  # the NaN poison zeroed, for the reference
    _check_launches(case, unpoison, hq, LOW, gen, dict(k_scale=ks.to(DEVICE), v_scale=vs.to(DEVICE)))


@kernel_test
def test_the_process_wide_tuning_takes_one_launch(monkeypatch):
    """set_tuning_decode(merge on): a launch without a tuning of its own never launches the reduce kernel."""
    hq, hkv, d = MODELS["qwen2.5-0.5b"]
    gen = torch.Generator().manual_seed(9)
    case = make_paged_case(LENS[:4], hkv, d, 16, torch.float32, DEVICE, gen, extra_table_cols=2)
    q = torch.randn(4, hq, d, generator=gen).to(DEVICE)
    two = _launch(q, case, None, {})
    kernels.set_tuning_decode(MERGE)
    monkeypatch.setattr(pd, "_decode_reduce_kernel", None)  # a launch of it would raise TypeError
    torch.testing.assert_close(_launch(q, case, None, {}), two, rtol=1e-5, atol=1e-5)
    assert _counters_zero()


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and CUDA")
def test_cuda_graph_replays_the_one_launch():
    """Captured once, replayed on new contexts and queries: each replay equals the two-launch path."""
    hq, hkv, d = MODELS["qwen2.5-0.5b"]
    gen = torch.Generator().manual_seed(10)
    lens = [4000, 129, 0, 1, 700, 2049, 64, 3000]
    case = make_paged_case(lens, hkv, d, 16, torch.bfloat16, "cpu", gen, extra_table_cols=2)
    for name in ("k_cache", "v_cache", "block_tables", "context_lens"):
        setattr(case, name, getattr(case, name).to(DEVICE))
    q = torch.randn(len(lens), hq, d, generator=gen).to(DEVICE, torch.bfloat16)
    out = torch.empty_like(q)

    def step():
        paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, d**-0.5,
                               out=out, tuning=MERGE)
    step()  # compile and allocate the counters before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for later in (lens, [3999, 1, 0, 0, 130, 2048, 65, 2500], [1000] * len(lens)):
        case.context_lens.copy_(torch.tensor(later, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=gen).to(q))
        graph.replay()
        torch.cuda.synchronize()
        two = paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, d**-0.5,
                                     tuning=TWO)
        torch.testing.assert_close(out.float(), two.float(), rtol=1e-2, atol=1e-3)
        assert _counters_zero()


@pytest.mark.skipif(INTERPRET or not HAS_TRITON, reason="runs the interpreter in a child process")
def test_interpreter_in_a_subprocess():
    """The interpreter's cases in a child process with TRITON_INTERPRET=1 (read when the kernels are defined), so
    that every CPU run of the suite runs the one-launch merge itself."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", "-x", "-k", "one_launch",
           __file__]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert out.returncode == 0 and "6 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]
