"""Compile kernels.decode_persistent's kernel to sm_90 (PTX + cubin) without a GPU and print each launch's
registers, spills, shared memory and the resident programs an SM can hold (regs and warps), for the Qwen2.5-0.5B
and Llama-3.2-1B shapes at the launcher's default plan (P = 132) and the variants the bench runs.

    python bench/results/mk24_s24/compile_sm90.py
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import subprocess
import sys
import tempfile

from types import SimpleNamespace

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.decode_persistent import PersistentDecodeTuning, _decode_persistent_kernel, _plan

TRACE = False
SHAPES = {"qwen2.5-0.5b": (896, 14, 2, 64, 4864), "llama3.2-1b": (2048, 32, 8, 64, 8192)}
PTRS = {"h_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_ptr": "*i64", "bt_ptr": "*i32",
        "ctx_ptr": "*i32", "table_ptr": "*i64", "norms_ptr": "*bf16", "bias_ptr": "*bf16", "sync_ptr": "*i32",
        "q_ws": "*bf16", "act_ws": "*bf16", "po_ptr": "*fp32", "pl_ptr": "*fp32", "trace_ptr": "*i64"}


def plan(shape, tune: PersistentDecodeTuning, p: int) -> dict:
    """The launcher's constexprs (kernels.decode_persistent._plan) for a shape, from meta tensors."""
    h, hq, hkv, d, inter = shape
    meta = torch.device("meta")
    w = SimpleNamespace(qkv=torch.empty((hq + 2 * hkv) * d, h, device=meta),
                        gate_up=torch.empty(2 * inter, h, device=meta))
    layers = SimpleNamespace(layers=[w], num_heads=hq, num_kv_heads=hkv,
                             k_caches=[torch.empty(1, 16, hkv, d, device=meta)], sync=torch.empty(121))
    pl = _plan(layers, meta, dataclasses.replace(tune, programs=p))
    consts = {k: v for k, v in pl.items() if k not in ("programs", "splits")}
    return dict(BS=16, **consts, HAS_BIAS=True, PREFETCH=tune.prefetch, DOT_PREC="tf32", MAX=1 << 20,
                L2PF=tune.l2_prefetch_kb > 0, TRACE=TRACE)


def compile_one(shape, tune: PersistentDecodeTuning, p: int):
    names = list(inspect.signature(_decode_persistent_kernel.fn).parameters)
    consts = plan(shape, tune, p)
    sig = {}
    for n in names:
        if n in PTRS:
            sig[n] = PTRS[n]
        elif n in consts:
            sig[n] = "constexpr"
        elif n in ("eps", "sm_scale_log2"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    div = [n for n in names if n in PTRS]
    src = ASTSource(_decode_persistent_kernel, sig,
                    constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(a),): [["tt.divisibility", 16]] for a in div})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": tune.num_warps})


def usage(cubin: bytes) -> tuple[int, int]:
    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([exe, "--dump-resource-usage", path], capture_output=True, text=True, check=True).stdout
    regs, local = re.search(r"REG:(\d+)", out), re.search(r"LOCAL:(\d+)", out)
    return int(regs.group(1)) if regs else -1, int(local.group(1)) if local else -1


def main() -> None:
    global TRACE
    variants = [("default", PersistentDecodeTuning(), 132), ("no-prefetch", PersistentDecodeTuning(prefetch=False), 132),
                ("no-l2", PersistentDecodeTuning(l2_prefetch_kb=0), 132),
                ("tile8192", PersistentDecodeTuning(tile_elems=8192), 132),
                ("p264", PersistentDecodeTuning(num_warps=4), 264),
                ("bk1024-u4", PersistentDecodeTuning(block_k=1024, max_units=4), 132)]
    for name, shape in SHAPES.items():
        for label, tune, p in variants:
            k = compile_one(shape, tune, p)
            regs, local = usage(k.asm["cubin"])
            threads = 32 * tune.num_warps
            per_sm = min(65536 // max(1, regs * threads), 2048 // threads)
            ptx = k.asm["ptx"]
            acq = len(re.findall(r"atom[^;]*acquire", ptx))
            cg = len(re.findall(r"ld\.global\.cg", ptx))
            tiles = {k: v for k, v in plan(shape, tune, p).items() if k[:2] in ("BU", "BK")}
            print(f"{name} {label} P={p} {tiles}: regs {regs} local {local}B shared {k.metadata.shared} "
                  f"resident/SM {per_sm} atom.acquire {acq} ld.cg {cg}", flush=True)
    TRACE = True  # the bench's traced launch (%clock64 stamps)
    k = compile_one(SHAPES["qwen2.5-0.5b"], PersistentDecodeTuning(), 132)
    regs, local = usage(k.asm["cubin"])
    print(f"qwen2.5-0.5b default traced: regs {regs} local {local}B clock64 {k.asm['ptx'].count('%clock64')}")
    sys.exit(0)


if __name__ == "__main__":
    main()
