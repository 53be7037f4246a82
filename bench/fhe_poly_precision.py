"""Precision of the encrypted block with polyexp at a given ring and prime chain, on real SmolLM2 tokens.

    nice python -m bench.fhe_poly_precision --squarings 4 --primes 54,36,36,36,36,36,36,36,36,36,60

Max |error| of the decrypted ``sum_h y_h / z_h`` vs the plaintext simulator of the same block
(``bench.fhe_attention.precision``) over the first ``--tokens`` tokens of held-out evaluation prompt 1.
The layer's map is shaped on those tokens (shift = -max score per head, scale so that the range fills 80%
of the window): this measures CKKS precision only, never fidelity (``bench/fhe_fidelity.py`` does that,
with maps fitted on calibration text).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.fhe_attention import precision
from engine.default_model import default_model_dir
from engine.loader import load_model
from engine.model import DenseKVCache
from engine.tokenizer import Tokenizer
from fhe.approx import ScoreApprox
from fhe.calibrate import load_prompts
from fhe.params import CKKSParams
from fhe.plan import LayerPlan, Plan, model_fingerprint
from fhe.simulator import block_weights, causal_mask, gqa_scores, project_qkv


def shaped_plan(model, layer: int, ids: torch.Tensor, squarings: int, window: float) -> Plan:
    """A one-layer polyexp plan whose range sits inside the window on these tokens."""
    h = model.run_layers(model.embed(ids), torch.arange(len(ids)), DenseKVCache(model.config, len(ids)), 0, layer)
    x = model.layers[layer].input_layernorm.normalize(h)
    pos = torch.arange(len(ids))
    q, k, _ = project_qkv(block_weights(model.layers[layer], None), x.double(), pos, model.rotary)
    s = gqa_scores(q, k).masked_fill(causal_mask(pos, len(pos)), float("-inf"))
    hi, lo = s.amax(dim=(1, 2)), s.masked_fill(torch.isinf(s), 1e9).amin(dim=(1, 2))
    a = (0.8 * window / (hi - lo)).clamp(max=1.0)
    xs = a[:, None, None] * s - (a * hi)[:, None, None]
    x_lo = xs[torch.isfinite(xs)].min().item()
    approx = ScoreApprox("polyexp", tuple(a.tolist()), tuple((-a * hi).tolist()), squarings,
                         min(window, 1.25 * abs(x_lo)), window)
    return Plan("SmolLM2", model_fingerprint(model), (LayerPlan(layer, approx, (x_lo, 0.0), {}, (2.0, 8.0)),))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--squarings", type=int, default=4, help="R: degree 2^R - 1 at depth R")
    ap.add_argument("--primes", required=True, help="prime bits, first (last level) to special")
    ap.add_argument("--ring", type=int, default=16384)
    ap.add_argument("--scale", type=int, default=36)
    ap.add_argument("--window", type=float, default=32.0)
    ap.add_argument("--layer", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = load_model(default_model_dir())
    tok = Tokenizer.from_folder(default_model_dir())
    ids = torch.tensor(tok.apply_chat_template(
        [{"role": "user", "content": load_prompts("evaluation")[1]}])[:args.tokens])
    plan = shaped_plan(model, args.layer, ids, args.squarings, args.window)
    params = CKKSParams(args.ring, tuple(int(b) for b in args.primes.split(",")), args.scale)
    t = time.perf_counter()
    res = precision(model, plan, args.layer, args.tokens, params)
    print(json.dumps(res | {"squarings": args.squarings, "wall_s": time.perf_counter() - t}))


if __name__ == "__main__":
    main()
