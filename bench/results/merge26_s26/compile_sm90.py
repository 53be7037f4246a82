"""Compile the decode attention's partition kernel (merge in a second launch vs in the partition kernel, the latter
with and without DecodeTuning.merge_max_registers) and the reduce kernel to sm_90 without a GPU, and print each one's
registers and spills (Qwen2.5-0.5B / Llama-3.2-1B heads, bf16, D = 64, BS = 16, the default tuning: 4 warps, block_n
128).

    python bench/results/merge26_s26/compile_sm90.py
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels._common import next_pow2
from kernels.paged_decode import (
    MERGE_TILE,
    REDUCE_BLOCK_S,
    DecodeTuning,
    _decode_partition_kernel,
    _decode_reduce_kernel,
)

PART_PTRS = ["q_ptr", "kc_ptr", "vc_ptr", "bt_ptr", "ctx_ptr", "out_ptr", "part_out_ptr", "part_lse_ptr", "ks_ptr",
             "vs_ptr", "cnt_ptr"]
PART_INTS = ["s_qb", "s_qh", "s_kcb", "s_kcs", "s_kch", "s_vcb", "s_vcs", "s_vch", "s_btb", "s_ob", "s_oh",
             "max_blocks", "G", "D", "HQ", "NUM_SPLITS", "PARTITION"]


def partition(g: int, merge: bool, maxnreg: int = 0):
    sig = {p: "*bf16" for p in PART_PTRS}
    sig.update(bt_ptr="*i32", ctx_ptr="*i32", part_out_ptr="*fp32", part_lse_ptr="*fp32", ks_ptr="*fp32",
               vs_ptr="*fp32", cnt_ptr="*i32", sm_scale_log2="fp32")
    sig.update({i: "i32" for i in PART_INTS})
    block_d, merge_g = 64, next_pow2(g)
    consts = dict(BS=16, BLOCK_G=max(16, merge_g), BLOCK_D=block_d, BLOCK_N=128, SPLIT=True, DOT_PREC="tf32",
                  QUANT=False, PDL=True, MERGE=merge, MERGE_G=merge_g,
                  MERGE_S=max(1, min(REDUCE_BLOCK_S, MERGE_TILE // (merge_g * block_d))))
    sig.update({k: "constexpr" for k in consts})
    div = PART_PTRS + ["s_qb", "s_qh", "s_kcb", "s_kcs", "s_kch", "s_vcb", "s_vcs", "s_vch", "s_ob", "s_oh"]
    return _compile(_decode_partition_kernel, sig, consts, div, maxnreg=maxnreg)


def reduce():
    ptrs = ["part_out_ptr", "part_lse_ptr", "ctx_ptr", "out_ptr"]
    sig = dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", ctx_ptr="*i32", out_ptr="*bf16")
    sig.update({i: "i32" for i in ["s_ob", "s_oh", "max_blocks", "D", "HQ", "NUM_SPLITS", "PARTITION"]})
    consts = dict(BS=16, BLOCK_S=REDUCE_BLOCK_S, BLOCK_D=64, PDL=True)
    sig.update({k: "constexpr" for k in consts})
    return _compile(_decode_reduce_kernel, sig, consts, ptrs + ["s_ob", "s_oh"], num_warps=2)


def _compile(fn, sig, consts, div, num_warps=4, maxnreg=0):
    src = ASTSource(fn, sig, constexprs={(list(sig).index(k),): v for k, v in consts.items()},
                    attrs={(list(sig).index(a),): [["tt.divisibility", 16]] for a in div})
    options = {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


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


def main() -> None:
    for g in (7, 4):  # Qwen2.5-0.5B (14 / 2), Llama-3.2-1B (32 / 8)
        for merge, cap in ((False, 0), (True, 0), (True, DecodeTuning().merge_max_registers)):
            k = partition(g, merge, cap)
            ptx = k.asm["ptx"]
            atoms = re.findall(r"atom\.[\w.]+", ptx)
            print(f"partition G={g} merge={merge} maxnreg={cap or '-'}: {cubin_usage(k.asm['cubin'])} "
                  f"shared {k.metadata.shared} "
                  f"atomics {sorted(set(atoms))} ld.global.cg {len(re.findall(r'ld.global.cg', ptx))}", flush=True)
    k = reduce()
    print(f"reduce: {cubin_usage(k.asm['cubin'])} shared {k.metadata.shared}", flush=True)


if __name__ == "__main__":
    main()
