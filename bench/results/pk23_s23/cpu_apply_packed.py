"""pk23, session 23: the q map of a 2-token packed chunk (tiny GQA model, 2Quad, N = 16384) through apply_packed on the
gpu backend's torch-CPU reference, main / STACK_BABIES (a no-op off CUDA) / kept diagonals, in turn, 3 rounds, outputs
equal. A sanity check that the kept path does less work, not a GPU figure. Run:
    PYTHONPATH=$PWD flock /tmp/cipherlm-bench.lock nice -n 5 python bench/results/pk23_s23/cpu_apply_packed.py
"""

import time

import numpy as np

from fhe import packed
from fhe.attention import EncryptedAttentionLayer
from fhe.backends.gpu import GpuEvaluator
from fhe.backends.seal import hazmat as seal
from tests.fhe.test_gpu_backend_packed import packed_case

model, plan, params, x, client, bc, chunks, want = packed_case((3, 14))
ev = GpuEvaluator(params, device="cpu", encoder="fft")
gpu = EncryptedAttentionLayer(model.layers[1], model.rotary, plan, model.config, params, max_tokens=64, evaluator=ev)
keys = ev.keys_from_server(client.server_keys())
ct = ev.deserialize(seal.to_bytes(chunks[0]))
run = packed.PackedPrefill(gpu)
babies = run._babies(ct, keys)
lay = gpu.geo.layout
wq = gpu.packed_weights[0]
cos, sin = run._rope(0, 2)
gain = np.array([gpu._step_gain(int(t) + 1) for t in run._rows(0, 2)])
m = run._rope_map(wq.reshape(lay.num_heads, lay.head_dim, -1), cos, sin, gain, key=("q", 0))
store = packed.PlainCache()
packed.PLAIN_CACHE_BYTES = 1 << 40
out_fill = packed.apply_packed(ev, babies, [m], 2, keys, store)
print("babies", len(babies), "entries", len(store), "bytes", store.nbytes, flush=True)
for r in range(3):
    for name, st, stack in (("main", None, False), ("stack", None, True), ("kept", store, True)):
        packed.STACK_BABIES = stack
        t = time.perf_counter()
        out = packed.apply_packed(ev, babies, [m], 2, keys, st)
        dt = time.perf_counter() - t
        assert (out[0].data == out_fill[0].data).all()
        print(r, name, round(dt, 2), flush=True)
