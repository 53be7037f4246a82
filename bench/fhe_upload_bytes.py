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
    for kind, r in (("sqexp", 6), ("polyexp", 5), ("polyexp", 4)):
        params = ckks_params_for(kind, r)
        client = CKKSClient(params, [])
        bc = BlockClient.for_model(client, cfg, kind, r)
        print(json.dumps({"kind": kind, "R": r, "N": params.poly_modulus_degree,
                          "primes": len(params.coeff_mod_bit_sizes),
                          "upload_bytes": len(wire.encrypt_to_wire(client, bc.layout_input(x)))}))


if __name__ == "__main__":
    main()
