import sys, time, torch
torch.set_num_threads(1)
from engine.default_model import default_model_dir
from engine.loader import load_model
from fhe.mlp import MLP_PARAMS, EncryptedMLP
from fhe.offload_attention import EncryptedAttentionLinear
from fhe.backends.gpu import GpuEvaluator
import fhe; print(fhe.__file__)
model = load_model(default_model_dir())
enc = sys.argv[1]
ev = GpuEvaluator(MLP_PARAMS, "cpu", encoder=enc)
n = [0]
orig = ev.encode
def cnt(*a, **k):
    n[0] += 1; return orig(*a, **k)
ev.encode = cnt
t0 = time.perf_counter()
a = EncryptedAttentionLinear(model.model.layers[2], model.config, MLP_PARAMS, evaluator=ev, chunks=True)
t1 = time.perf_counter()
m = EncryptedMLP(model.model.layers[2], MLP_PARAMS, evaluator=ev, chunks=True)
t2 = time.perf_counter()
print(enc, "attn", round(t1-t0,2), "mlp", round(t2-t1,2), "encode calls", n[0])
