"""Compile every kernels.decode_layer variant the engine launches to sm_90 (PTX + cubin) without a GPU, and
print each one's registers, spills and whether the PDL wait comes after the first weight loads.

    python bench/results/q23_s23/compile_sm90.py
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.decode_layer import _decode_layer_kernel, _default_tuning

PTRS = ["x_ptr", "g_ptr", "w_ptr", "so_ptr", "b_ptr", "out_ptr", "cos_ptr", "sin_ptr", "kc_ptr", "vc_ptr",
        "slot_ptr"]
INTS = ["N", "K", "s_xm", "s_wn", "s_sn", "s_om", "s_cos", "s_kcb", "s_kcs", "s_kch", "s_vcb", "s_vcs",
        "s_vch"]


def signature(int4: bool) -> dict:
    sig = {p: "*bf16" for p in PTRS}
    sig.update(w_ptr="*i32" if int4 else "*bf16", so_ptr="*fp16" if int4 else "*bf16", cos_ptr="*fp32",
               sin_ptr="*fp32", slot_ptr="*i64")
    sig.update({i: "i32" for i in INTS})
    sig.update(eps="fp32", num_slots="i32", HQ="i32", HKV="i32")
    return sig


def main() -> None:
    target = GPUTarget("cuda", 90, 32)
    old_prologues(target)
    for int4, epi, pf, big in itertools.product((False, True), (0, 1, 2), (True, False), (False, True)):
        tune = _default_tuning(int4, 4864, 32, epi)  # the launch of a K = 4864 (Qwen down) weight
        bn, bk, pdl = tune.block_n, tune.block_k * (2 if big else 1), True
        consts = dict(EPI=epi, NORM=epi != 0, INT4=int4, GROUP=32, HAS_BIAS=epi == 2, BLOCK_N=bn, BLOCK_K=bk,
                      D=64, BS=16, PDL=pdl, PREFETCH=pf)
        sig = signature(int4)
        sig.update({k: "constexpr" for k in consts})
        # the launches' specialization: pointers, K and the strides divisible by 16 (real shapes' are)
        div = PTRS + ["K"] + [i for i in INTS if i.startswith("s_")]
        src = ASTSource(_decode_layer_kernel, sig, constexprs={(list(sig).index(k),): v for k, v in consts.items()},
                        attrs={(list(sig).index(a),): [["tt.divisibility", 16]] for a in div})
        k = triton.compile(src, target=target, options={"num_warps": 4})
        ptx = k.asm["ptx"]
        wait = ptx.find("griddepcontrol.wait")
        first_ld = ptx.find("ld.global")
        vec = len(re.findall(r"ld\.global\.L1::evict_first[^\s]*\.v[24]", ptx))
        print(f"int4={int4} epi={epi} prefetch={pf} block_n={bn} block_k={bk}: {cubin_usage(k.asm['cubin'])} "
              f"shared {k.metadata.shared} vector weight loads {vec} "
              f"wait_after_first_load={pdl and 0 <= first_ld < wait}", flush=True)


def old_prologues(target) -> None:
    """The session-16 GEMV prologues (kernels.gemv at its default 2 rows x 1024 columns; SiLU: 8 rows)."""
    from kernels.gemv import _gemv_kernel

    names = "x_ptr w_ptr b_ptr y_ptr r_ptr g_ptr h_ptr N K s_xm s_wn s_ym s_rm s_hm eps".split()
    for prologue, label in ((0, "plain"), (2, "add+rms_norm"), (3, "silu_mul")):
        sig = {n: ("*bf16" if n.endswith("ptr") else "i32") for n in names}
        sig["eps"] = "fp32"
        consts = dict(HAS_BIAS=False, BLOCK_N=8 if prologue == 3 else 2, BLOCK_K=1024, PROLOGUE=prologue,
                      NORM=prologue == 2, PDL=True)
        sig.update({k: "constexpr" for k in consts})
        div = [n for n in names if n.endswith("ptr") or n.startswith("s_") or n == "K"]
        src = ASTSource(_gemv_kernel, sig, constexprs={(list(sig).index(k),): v for k, v in consts.items()},
                        attrs={(list(sig).index(a),): [["tt.divisibility", 16]] for a in div})
        k = triton.compile(src, target=target, options={"num_warps": 4, "num_stages": 3})
        print(f"kernels.gemv {label} (session 16): {cubin_usage(k.asm['cubin'])}", flush=True)


def cubin_usage(cubin: bytes) -> str:
    """Registers and local (spill) bytes of a cubin, from Triton's bundled cuobjdump."""
    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([exe, "--dump-resource-usage", path], capture_output=True, text=True,
                             check=True).stdout
    regs = re.search(r"REG:(\d+)", out)
    local = re.search(r"LOCAL:(\d+)", out)
    return f"regs {regs.group(1) if regs else '?'} local {local.group(1) if local else '?'}B"

if __name__ == "__main__":
    main()
