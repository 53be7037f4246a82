"""Compile the int4 w32 GEMV launches of bench.gemv_int4_gpu's split sweep to sm_90 (PTX + cubin) without a GPU
and print each one's registers, spills, and the split-K fix-up's atomics and barrier in the PTX.

    python bench/results/int4s23_s23/compile_sm90.py
"""

from __future__ import annotations

import importlib.util
import os

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bench.gemv_int4_gpu import SPLIT_TUNINGS
from kernels.gemv_int4_w32 import _gemv_int4_w32_kernel, split_k_plan, tuning_int4_w32

_here = os.path.join(os.path.dirname(__file__), "..", "q23_s23", "compile_sm90.py")
_spec = importlib.util.spec_from_file_location("q23_compile", _here)
_q23 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_q23)

PTRS = ["x_ptr", "q_ptr", "so_ptr", "b_ptr", "y_ptr", "r_ptr", "g_ptr", "h_ptr", "ws_ptr", "cnt_ptr"]
INTS = ["N", "K", "s_xm", "s_qn", "s_sn", "s_ym", "s_rm", "s_hm", "per"]


def compile_one(tune, n: int, k: int) -> str:
    split, _ = split_k_plan(k // 32, tune)
    sig = {p: "*bf16" for p in PTRS}
    sig.update(q_ptr="*i32", so_ptr="*fp16", ws_ptr="*fp32", cnt_ptr="*i32")
    sig.update({i: "i32" for i in INTS})
    sig.update(eps="fp32", ss_scale="fp32")
    consts = dict(GROUP=32, HAS_BIAS=False, BLOCK_N=tune.block_n, GROUPS=tune.groups,
                  EVEN=n % tune.block_n == 0 and (k // 32) % tune.groups == 0, X_PER_ROW=tune.x_per_row,
                  PROLOGUE=0, NORM=False, PDL=True, PREFETCH=tune.prefetch, SPLIT=split, MANT=tune.mantissa_unpack)
    names = list(_gemv_int4_w32_kernel.arg_names)
    sig = {a: ("constexpr" if a in consts else sig[a]) for a in names}
    div = PTRS + ["K"] + [i for i in INTS if i.startswith("s_")]
    src = ASTSource(_gemv_int4_w32_kernel, sig, constexprs={(names.index(c),): v for c, v in consts.items()},
                    attrs={(names.index(a),): [["tt.divisibility", 16]] for a in div})
    kern = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": tune.num_warps, "num_stages": tune.num_stages})
    ptx = kern.asm["ptx"]
    return (f"{_q23.cubin_usage(kern.asm['cubin'])} split {split} atom.acq_rel {ptx.count('atom.') > 0 and 'acq_rel' in ptx}"
            f" bar.sync {ptx.count('bar.sync')}")


def main() -> None:
    n, k = 16384, 2048  # Llama-1B gate_up
    print(f"default {tuning_int4_w32(n, k, 32)}: {compile_one(tuning_int4_w32(n, k, 32), n, k)}", flush=True)
    for t in SPLIT_TUNINGS:
        print(f"{t}: {compile_one(t, n, k)}", flush=True)


if __name__ == "__main__":
    main()
