import json, torch
from engine.config import ModelConfig
from engine.default_model import default_model_dir
from engine.loader import load_model
from fhe.attention import BlockClient
from fhe.backends.seal import wire
from fhe.backends.seal.keys import CKKSClient
from fhe.params import ckks_params_for
cfg = load_model(default_model_dir()).config
x = torch.randn(cfg.hidden_size, generator=torch.Generator().manual_seed(0)); x = x / x.pow(2).mean().sqrt()
for kind, r in (("sqexp", 6), ("polyexp", 5), ("polyexp", 4)):
    p = ckks_params_for(kind, r)
    c = CKKSClient(p, [])
    bc = BlockClient.for_model(c, cfg, kind, r)
    print(json.dumps({"kind": kind, "R": r, "N": p.poly_modulus_degree, "primes": len(p.coeff_mod_bit_sizes),
                      "upload_bytes": len(wire.encrypt_to_wire(c, bc.layout_input(x)))}))
