"""Upload bytes of one token's input ciphertext per layer, for each shipped approximation's parameters.

    python -m bench.fhe_upload_bytes

``wire.encrypt_to_wire`` of a normalized random input in the block's input layout (seeded symmetric
encryption, as the SDK sends it); only the ring and the prime count matter, not the values.
"""

from __future__ import annotations

import json

import torch

from engine.default_model import default_model_dir
from engine.loader import load_model
from fhe.attention import BlockClient
from fhe.backends.seal import wire
from fhe.backends.seal.keys import CKKSClient
from fhe.params import ckks_params_for


def main() -> None:
    cfg = load_model(default_model_dir()).config
    x = torch.randn(cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    x = x / x.pow(2).mean().sqrt()
    for kind, r, fold in (("sqexp", 6, False), ("polyexp", 5, False), ("polyexp", 5, True)):
        params = ckks_params_for(kind, r, fold_v=fold)   # fold: plan n16384 (depth 9, p * V inside P)
        client = CKKSClient(params, [])
        bc = BlockClient.for_model(client, cfg, kind, r)
        print(json.dumps({"kind": kind, "R": r, "fold_v": fold, "N": params.poly_modulus_degree,
                          "primes": len(params.coeff_mod_bit_sizes),
                          "upload_bytes": len(wire.encrypt_to_wire(client, bc.layout_input(x)))}))


if __name__ == "__main__":
    main()
