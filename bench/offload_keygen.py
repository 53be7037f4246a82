"""Client-side key generation alone, for an offload plan of linear steps (serving17, docs/benchmarks.md).

The attention key set such a deployment used to need although no layer used it (what
``bench/private_e2e.py --offload-plan`` made: the shipped plan's first layer at N = 16384, level-aware
keys) beside the offload key set the session now runs on alone (N = 8192, SmolLM2's 9 Galois steps):
seconds to generate and serialize, bytes to upload. Run::

    PYTHONPATH=. python bench/offload_keygen.py
"""

from __future__ import annotations

import json
import time


def main() -> None:
    from engine.config import ModelConfig
    from engine.default_model import default_model_dir
    from fhe import wire
    from fhe.attention import required_key_levels
    from fhe.ckks import CKKSClient
    from fhe.envelope import pack_key_upload
    from fhe.mlp import MLP_PARAMS
    from fhe.offload_steps import offload_rotation_steps
    from fhe.params import CKKSParams
    from fhe.plan import Plan
    from server.private.feature import default_plan_path

    cfg = ModelConfig.from_hf_dict(json.loads((default_model_dir() / "config.json").read_text()))
    first = Plan.load(default_plan_path()).layers[0]
    params = CKKSParams(16384, (48,) + (30,) * 11 + (60,), 30)
    levels = required_key_levels(cfg, params, first.approx.kind, first.approx.squarings)
    t0 = time.perf_counter()
    upload = pack_key_upload(wire.dump_public_keys(CKKSClient(params, levels.steps, levels=levels)))
    print(f"attention key set (N=16384): {time.perf_counter() - t0:.1f} s, {len(upload) / 1e6:.2f} MB")
    steps = tuple(offload_rotation_steps(cfg, MLP_PARAMS, attention=True, mlp=True))
    t0 = time.perf_counter()
    upload = pack_key_upload(wire.dump_public_keys(CKKSClient(MLP_PARAMS, steps)))
    print(f"offload key set (N=8192, {len(steps)} steps): {time.perf_counter() - t0:.2f} s, "
          f"{len(upload) / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
