"""Our launchers' own Python per call (checks, planning, small allocations), Triton launches stubbed, CPU."""
import timeit, torch
import kernels
import importlib
rsk, pd, pp, rn, sm, _pdl = (importlib.import_module(f'kernels.{m}') for m in ('rope_store_kv', 'paged_decode', 'paged_prefill', 'rms_norm', 'silu_mul', '_pdl'))
class Stub:
    def __getitem__(self, grid): return lambda *a, **k: None
for mod, names in ((rsk, ["_rope_store_kv_kernel"]), (pd, ["_decode_partition_kernel", "_decode_reduce_kernel"]),
                   (pp, ["_prefill_kernel"]), (rn, ["_rms_norm_kernel"]), (sm, ["_silu_mul_kernel"])):
    for n in names:
        setattr(mod, n, Stub())
    mod.use_triton = lambda *a, **k: True
_pdl.pdl_launch = lambda *a, **k: False
T = 8; B = 8; hq, hkv, d = 9, 3, 64; bf = torch.bfloat16   # small T: CPU allocations stay off mmap
kc = torch.zeros(2000, 16, hkv, d, dtype=bf); vc = torch.zeros_like(kc)
qkv = torch.zeros(T, (hq + 2*hkv)*d, dtype=bf); cos = torch.zeros(T, d); sin = torch.zeros(T, d)
slots = torch.zeros(T, dtype=torch.int64)
q = torch.zeros(B, hq, d, dtype=bf); bt = torch.zeros(B, 24, dtype=torch.int32); cl = torch.full((B,), 300, dtype=torch.int32)
qp = torch.zeros(T, hq, d, dtype=bf); btp = torch.zeros(1, 24, dtype=torch.int32); cu = torch.tensor([0, T], dtype=torch.int32); clp = torch.tensor([T], dtype=torch.int32)
x = torch.zeros(T, 576, dtype=bf); w = torch.ones(576, dtype=bf); gu = torch.zeros(T, 2*1536, dtype=bf)
cases = {
 "rope_store_kv": lambda: kernels.rope_store_kv(qkv, hq, hkv, cos, sin, kc, vc, slots),
 "paged_decode_attention (partition + merge)": lambda: kernels.paged_decode_attention(q, kc, vc, bt, cl, 0.125),
 "paged_prefill_attention": lambda: kernels.paged_prefill_attention(qp, kc, vc, btp, cu, clp, 0.125, max_seqlen_q=T),
 "add_rms_norm": lambda: kernels.add_rms_norm(x, x, w, 1e-5),
 "silu_mul": lambda: kernels.silu_mul(gu),
 "torch.empty_like (for scale)": lambda: torch.empty_like(x),
}
for n, f in cases.items():
    f()
    print(f"| {n} | {min(timeit.repeat(f, number=3000, repeat=5)) / 3000 * 1e6:.1f} |")
