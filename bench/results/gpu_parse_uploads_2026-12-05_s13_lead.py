"""Where a step's upload parse goes on this host: one by one, at once (threads), variants."""
import statistics, time, os
from concurrent.futures import ThreadPoolExecutor
import numpy as np, torch, zstandard
from fhe.mlp import MLP_PARAMS
from fhe.backends.seal.keys import CKKSClient
from fhe.backends.seal import wire
from fhe.backends.gpu import GpuEvaluator, sealio
c = CKKSClient(MLP_PARAMS, (1,))
ev = GpuEvaluator(MLP_PARAMS)
rng = np.random.default_rng(0)
pays = [wire.ciphertext_payload(wire.encrypt_to_wire(c, rng.normal(size=4096), seeded=False), c.params, c.fingerprint)
        for _ in range(36)]
sync = torch.cuda.synchronize
def t(name, fn, reps=9):
    fn(); sync(); xs = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); sync(); xs.append(time.perf_counter() - t0)
    print(f"{name:50s} {statistics.median(xs) / 36 * 1e3:.3f} ms/ct")
def zs(p): return zstandard.ZstdDecompressor().decompress(p[16:], max_output_size=1 << 20)
print("cpus", os.cpu_count(), "affinity", len(os.sched_getaffinity(0)), "torch threads", torch.get_num_threads())
t("one by one (deserialize_fresh)", lambda: [ev.deserialize_fresh(p) for p in pays])
t("at once (deserialize_fresh_many)", lambda: ev.deserialize_fresh_many(pays))
t("residues one by one, no device", lambda: [ev._fresh_residues(p) for p in pays])
for n in (1, 2, 4, 8, 16):
    pool = ThreadPoolExecutor(n)
    t(f"residues on {n} threads, no device", lambda: list(pool.map(ev._fresh_residues, pays)))
    t(f"zstd only on {n} threads", lambda: list(pool.map(zs, pays)))
res = [ev._fresh_residues(p) for p in pays]
t("np.stack + H2D (pageable)", lambda: torch.from_numpy(np.stack([r[0] for r in res])).to("cuda"))
pin = torch.empty((36, 2, ev.top, 8192), dtype=torch.int64, pin_memory=True)
def pinned():
    a = pin.numpy()
    for j, r in enumerate(res):
        a[j] = r[0]
    return pin.to("cuda", non_blocking=True)
t("copy into pinned + H2D", pinned)
t("36 small H2D (pageable)", lambda: [torch.from_numpy(r[0]).to("cuda") for r in res])
