"""The persistent decode kernel (kernels.decode_persistent) against its layer-by-layer torch reference.

* Triton's CPU interpreter (``TRITON_INTERPRET=1``) runs the kernel with ONE program: the interpreter runs a
  grid's programs one after another, so with P > 1 the first program would poll its first barrier until it gave
  up (bounded, error flag) while the others had not started. :func:`test_interpreter_in_a_subprocess` runs the
  P = 1 fp32 cases with the register prefetch in a child interpreter process on every CPU run of the suite
  (~10 s); under ``TRITON_INTERPRET=1`` all of them (fp32 and fp16, prefetch on and off) run in-process.
* CUDA (marked gpu): P = the SM count on a Qwen-like shape (bf16, 4 layers), a CUDA graph of the launch replayed
  twice (the counters reset by the kernel itself) and the P sweep the bench uses.

Every case: random weights, a small GQA model with and without qkv bias, a context spanning several blocks
(shuffled) and several partitions, the new token's k/v checked in its slot and h after all layers.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernels import (
    DecodeLayerWeights,
    KernelInputError,
    PersistentDecodeLayers,
    PersistentDecodeTuning,
    decode_persistent,
    decode_persistent_reference,
)
from kernels._common import HAS_TRITON, _interpreting

INTERPRET = HAS_TRITON and _interpreting()
ON_CUDA = torch.cuda.is_available()


def make_model(layers: int, hidden: int, hq: int, hkv: int, d: int, inter: int, bias: bool, dtype, device,
               ctx: int, bs: int, seed: int = 0):
    """(layers' weights, k pools, v pools, block table [1, W], context [1], slot [1], cos, sin, h [1, H]).

    The pools are zero except the context's first ctx - 1 tokens (the new token's slot is the kernel's to
    write); the table hands the blocks out shuffled and has one spare column."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    n_qkv = (hq + 2 * hkv) * d
    ws = [DecodeLayerWeights(1.0 + rnd(hidden, scale=0.1), rnd(n_qkv, hidden, scale=hidden ** -0.5),
                             rnd(n_qkv, scale=0.1) if bias else None, rnd(hidden, hq * d, scale=(hq * d) ** -0.5),
                             1.0 + rnd(hidden, scale=0.1), rnd(2 * inter, hidden, scale=hidden ** -0.5),
                             rnd(hidden, inter, scale=inter ** -0.5)) for _ in range(layers)]
    nblk = -(-ctx // bs)
    nb = nblk + 3
    perm = torch.randperm(nb, generator=gen)[:nblk]
    table = torch.cat([perm, torch.tensor([-1])]).to(torch.int32)[None].to(device)
    kcs, vcs = [], []
    for _ in range(layers):
        kc = torch.zeros(nb, bs, hkv, d, dtype=dtype, device=device)
        vc = torch.zeros_like(kc)
        for t in range(ctx - 1):
            kc[perm[t // bs], t % bs] = rnd(hkv, d)
            vc[perm[t // bs], t % bs] = rnd(hkv, d)
        kcs.append(kc)
        vcs.append(vc)
    pos = ctx - 1
    slot = torch.tensor([int(perm[pos // bs]) * bs + pos % bs], dtype=torch.int64, device=device)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    ang = pos * inv
    cos = torch.cat([ang.cos(), ang.cos()])[None].to(device)
    sin = torch.cat([ang.sin(), ang.sin()])[None].to(device)
    h = rnd(1, hidden)
    lens = torch.tensor([ctx], dtype=torch.int32, device=device)
    return ws, kcs, vcs, table, lens, slot, cos, sin, h


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def run_case(dtype, device, bias: bool, tuning: PersistentDecodeTuning, layers=3, hidden=64, hq=4, hkv=2, d=16,
             inter=96, ctx=40, bs=8, tol=None) -> None:
    """The kernel and the reference on copies of one model: h and the new token's k/v agree."""
    ws, kcs, vcs, table, lens, slot, cos, sin, h = make_model(layers, hidden, hq, hkv, d, inter, bias, dtype,
                                                              device, ctx, bs)
    ref_k, ref_v = [k.clone() for k in kcs], [v.clone() for v in vcs]
    ref_layers = PersistentDecodeLayers.build(ws, ref_k, ref_v, hq, hkv, 1e-6)
    want = decode_persistent_reference(h.clone(), cos, sin, slot, table, lens, ref_layers)
    plan = PersistentDecodeLayers.build(ws, kcs, vcs, hq, hkv, 1e-6)
    got = decode_persistent(h.clone(), cos, sin, slot, table, lens, plan, tuning=tuning, backend="triton")
    assert not plan.failed()
    assert int(plan.sync[:-1].abs().sum()) == 0          # the last program zeroed every counter
    tol = tol or {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]
    assert _rel(got, want) < tol, _rel(got, want)
    b, o = divmod(int(slot), bs)
    for i in range(layers):  # the new token's k/v in its slot, the rest of the pools untouched
        assert _rel(kcs[i][b, o], ref_k[i][b, o]) < tol and _rel(vcs[i][b, o], ref_v[i][b, o]) < tol
        mask = torch.ones(kcs[i].shape[:2], dtype=torch.bool, device=device)
        mask[b, o] = False
        assert torch.equal(kcs[i][mask], ref_k[i][mask]) and torch.equal(vcs[i][mask], ref_v[i][mask])


# ---- interpreter (P = 1) ------------------------------------------------------------------------------------

ONE = dict(programs=1, splits=3, block_k=32, max_units=8, block_t=16, num_warps=4)


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernel on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("prefetch", [True, False], ids=["pf", "nopf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_one_program_under_the_interpreter(bias, prefetch, dtype):
    """P = 1, a context of 40 tokens in 5 shuffled blocks of 8 and 3 partitions, chunks of 8 row pairs and
    K steps of 32 columns (every stage walks several chunks and steps, tails masked)."""
    run_case(dtype, "cpu", bias, PersistentDecodeTuning(prefetch=prefetch, **ONE))


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernel on CPU needs TRITON_INTERPRET=1")
def test_one_program_per_stage_k_steps():
    """The default K steps (``tile_elems / BU`` columns, per stage): here 4 row pairs a chunk, 64 columns a step,
    so the down GEMV (K = 96) takes a masked second step."""
    tune = PersistentDecodeTuning(programs=1, splits=2, tile_elems=256, max_units=4, num_warps=4)
    run_case(torch.float32, "cpu", True, tune)


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernel on CPU needs TRITON_INTERPRET=1")
def test_one_program_single_partition_and_padding_slot():
    """A context inside one partition (5 tokens) and GQA of 4 query heads a KV head."""
    run_case(torch.float32, "cpu", True, PersistentDecodeTuning(**ONE), layers=2, hq=8, hkv=2, ctx=5, bs=4)


@pytest.mark.skipif(INTERPRET or not HAS_TRITON, reason="runs the interpreter in a child process")
def test_interpreter_in_a_subprocess():
    """The interpreter's fp32 cases with the register prefetch (4), in a child process with TRITON_INTERPRET=1
    (read when the kernels are defined), so that every CPU run of the suite runs the kernel itself."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", "-x",
           "-k", "one_program and not fp16 and not nopf", __file__]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0 and "4 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]


# ---- argument checks (everywhere) ---------------------------------------------------------------------------

def test_reference_path_and_checks():
    """backend='torch' is the reference; bad layers, tables and inputs raise KernelInputError."""
    ws, kcs, vcs, table, lens, slot, cos, sin, h = make_model(2, 64, 4, 2, 16, 96, True, torch.float32, "cpu",
                                                              20, 8)
    plan = PersistentDecodeLayers.build(ws, kcs, vcs, 4, 2, 1e-6)
    out = decode_persistent(h.clone(), cos, sin, slot, table, lens, plan, backend="torch")
    assert out.shape == (1, 64) and torch.isfinite(out).all()
    with pytest.raises(KernelInputError, match="Hkv"):
        PersistentDecodeLayers.build(ws, kcs, vcs, 4, 1, 1e-6)
    with pytest.raises(KernelInputError, match="one k and one v pool"):
        PersistentDecodeLayers.build(ws, kcs[:1], vcs, 4, 2, 1e-6)
    bad = [ws[0], ws[1]._replace(qkv_bias=None)]
    with pytest.raises(KernelInputError, match="qkv bias"):
        PersistentDecodeLayers.build(bad, kcs, vcs, 4, 2, 1e-6)
    bad = [ws[0], ws[1]._replace(down=ws[1].down.t())]
    with pytest.raises(KernelInputError, match="down"):
        PersistentDecodeLayers.build(bad, kcs, vcs, 4, 2, 1e-6)
    with pytest.raises(KernelInputError, match="h"):
        decode_persistent(torch.zeros(2, 64), cos, sin, slot, table, lens, plan)
    with pytest.raises(KernelInputError, match="slot_mapping"):
        decode_persistent(h, cos, sin, slot.int(), table, lens, plan)
    with pytest.raises(KernelInputError, match="cos"):
        decode_persistent(h, cos[:, :8], sin, slot, table, lens, plan)
    with pytest.raises(KernelInputError, match="block_t"):
        plan2 = PersistentDecodeLayers.build(ws, kcs, vcs, 4, 2, 1e-6)
        from kernels.decode_persistent import _plan
        _plan(plan2, torch.device("cpu"), PersistentDecodeTuning(block_t=8))


# ---- CUDA ---------------------------------------------------------------------------------------------------

QWEN = dict(hidden=896, hq=14, hkv=2, d=64, inter=4864)


@pytest.mark.gpu
@pytest.mark.skipif(not (ON_CUDA and HAS_TRITON), reason="needs CUDA")
@pytest.mark.parametrize("bias", [True, False])
def test_cuda_qwen_shape_all_sms(bias):
    """P = the SM count, bf16, Qwen2.5-0.5B's layer shape, 4 layers, context 256 over blocks of 16."""
    run_case(torch.bfloat16, "cuda", bias, PersistentDecodeTuning(), layers=4, ctx=256, bs=16, **QWEN)


@pytest.mark.gpu
@pytest.mark.skipif(not (ON_CUDA and HAS_TRITON), reason="needs CUDA")
@pytest.mark.parametrize("tuning", [PersistentDecodeTuning(prefetch=False, l2_prefetch_kb=0),
                                    PersistentDecodeTuning(programs=64, tile_elems=8192),
                                    PersistentDecodeTuning(splits=4, block_k=1024, max_units=4, num_warps=4)],
                         ids=["no-prefetch", "p64", "small"])
def test_cuda_variants(tuning):
    """The bench's other launches (prefetch off, fewer programs, other tiles) on Llama-3.2-1B's head layout."""
    run_case(torch.bfloat16, "cuda", False, tuning, layers=2, ctx=300, bs=16, hidden=2048, hq=32, hkv=8, d=64,
             inter=8192)


@pytest.mark.gpu
@pytest.mark.skipif(not (ON_CUDA and HAS_TRITON), reason="needs CUDA")
def test_cuda_graph_replays_reset_the_counters():
    """The launch captured in a CUDA graph and replayed twice on the same inputs gives the eager result each
    time (a replay starting from counters the last one left would pass barriers early or wait forever)."""
    ws, kcs, vcs, table, lens, slot, cos, sin, h0 = make_model(4, QWEN["hidden"], QWEN["hq"], QWEN["hkv"], QWEN["d"],
                                                               QWEN["inter"], True, torch.bfloat16, "cuda", 256, 16)
    plan = PersistentDecodeLayers.build(ws, kcs, vcs, QWEN["hq"], QWEN["hkv"], 1e-6)
    h = h0.clone()
    decode_persistent(h, cos, sin, slot, table, lens, plan)          # eager: compiles, allocates the workspace
    eager = h.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_persistent(h, cos, sin, slot, table, lens, plan)
    for _ in range(2):
        h.copy_(h0)
        graph.replay()
        torch.cuda.synchronize()
        assert not plan.failed()
        assert int(plan.sync[:-1].abs().sum()) == 0
        assert torch.equal(h, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not (ON_CUDA and HAS_TRITON), reason="needs CUDA")
def test_cuda_trace_stamps_every_event_in_order():
    """``trace=``: 11 %clock64 stamps a layer a program, non-decreasing within a program, and h as untraced."""
    ws, kcs, vcs, table, lens, slot, cos, sin, h0 = make_model(2, QWEN["hidden"], QWEN["hq"], QWEN["hkv"], QWEN["d"],
                                                               QWEN["inter"], True, torch.bfloat16, "cuda", 64, 16)
    plan = PersistentDecodeLayers.build(ws, kcs, vcs, QWEN["hq"], QWEN["hkv"], 1e-6)
    p = torch.cuda.get_device_properties(0).multi_processor_count
    tr = torch.zeros(2 * 11 * p, dtype=torch.int64, device="cuda")
    plain = decode_persistent(h0.clone(), cos, sin, slot, table, lens, plan)
    traced = decode_persistent(h0.clone(), cos, sin, slot, table, lens, plan, trace=tr)
    torch.cuda.synchronize()
    assert torch.equal(plain, traced) and not plan.failed()
    t = tr.view(2, 11, p)
    assert bool((t > 0).all()) and bool((t.flatten(0, 1).diff(dim=0) >= 0).all())
