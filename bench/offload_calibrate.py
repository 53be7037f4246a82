"""Fit the sqexp score maps of every server layer of the offload plan (layers 2-29 of SmolLM2).

``cipherlm fhe calibrate`` uses one margin for all layers and stops if any layer's range does not fit; over
28 layers a few (7, 18, 23) sit at the edge of R = 6's limit, so this fits each layer at ``--margin`` and
retries a layer that does not fit at the smaller ``--fallback-margins`` (recorded per layer in the plan's
calibration metadata). One calibration corpus and one collection pass for all layers (fhe.calibrate).

    flock /tmp/cipherlm-heavy.lock python bench/offload_calibrate.py \
        --out fhe/data/smollm2-135m-instruct.offload-attention.plan.json
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from fhe.calibrate import (
    CalibrationConfig,
    _created_by,
    _describe,
    calibration_corpus,
    ckks_params_dict,
    collect,
    fit_layer,
)
from fhe.plan import Plan, model_fingerprint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default=",".join(map(str, range(2, 30))))
    ap.add_argument("--margin", type=float, default=1.15)
    ap.add_argument("--fallback-margins", default="1.1,1.05")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from server.cli_fhe import _load_model_and_tokenizer

    _, model, tok = _load_model_and_tokenizer("default")
    layers = tuple(int(v) for v in args.layers.split(","))
    cfg = CalibrationConfig(layers=layers, kind="sqexp", squarings=6, margin=args.margin)
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    seqs = calibration_corpus(model, tok, cfg)
    data = collect(model, seqs, layers)
    print(f"calibration text: {len(seqs)} sequences ({time.perf_counter() - t0:.0f} s)", flush=True)
    plans, infos = [], []
    for i in layers:
        for margin in (args.margin, *(float(m) for m in args.fallback_margins.split(","))):
            lp, info = fit_layer(model, i, data[i], dataclasses.replace(cfg, margin=margin))
            info["margin"] = margin
            print(_describe(info), f"margin {margin}", flush=True)
            if lp is not None:
                break
        if lp is None:
            raise SystemExit(f"layer {i} does not fit at any margin")
        plans.append(lp)
        infos.append({k: v for k, v in info.items() if k != "seconds"})
    meta = {"kind": "sqexp", "fit": True, "steps": cfg.steps, "seed": cfg.seed, "margin": args.margin,
            "fallback_margins": args.fallback_margins, "num_sequences": len(seqs),
            "num_positions": sum(map(len, seqs)), "max_new_tokens": cfg.max_new_tokens,
            "prompts": "fhe/data/calibration_prompts.txt", "tool": "bench/offload_calibrate.py", "layers": infos}
    plan = Plan("SmolLM2-135M-Instruct", model_fingerprint(model), tuple(plans),
                ckks_params_dict("sqexp", 6), _created_by(), meta)
    print(f"wrote {plan.save(args.out)} (content hash {plan.content_hash})")


if __name__ == "__main__":
    main()
