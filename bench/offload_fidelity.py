"""Fidelity of whole offload plans vs the plaintext model (plaintext simulation, :mod:`fhe.offload_sim`).

Teacher-forced on the plaintext model's greedy answers to held-out prompts (disjoint from the calibration
prompts): top-1 agreement and mean KL(plain || plan) over every answer position, for the client-aided
and the approximated variants side by side, with and without Gaussian noise standing in for CKKS error on
every server output. The SiLU polynomials are fitted here on the calibration prompts.

    flock /tmp/cipherlm-bench.lock python bench/offload_fidelity.py \
        --attention-plan fhe/data/smollm2-135m-instruct.offload-attention.plan.json
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fhe.calibrate import chat_corpus, load_prompts
from fhe.offload import LayerPlacement, OffloadPlan, offload_plan, partial_plan, with_poly_silu
from fhe.offload_sim import OffloadSimulator, collect_gates, fidelity
from fhe.plan import Plan, load_default_plan
from fhe.silu import fit_silu
from fhe.simulator import sequence_logits


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attention-plan", default=None,
                    help="sqexp plan with every server layer (2-29); without it only client-aided softmax runs")
    ap.add_argument("--cache", default=None, help="file keeping the evaluation corpus and the gate samples")
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--eval-new-tokens", type=int, default=24)
    ap.add_argument("--cal-prompts", type=int, default=32)
    ap.add_argument("--cal-new-tokens", type=int, default=24)
    ap.add_argument("--degrees", default="15,31", help="SiLU polynomial degrees to try")
    ap.add_argument("--hybrid-tol", type=float, default=0.05,
                    help="hybrid: poly SiLU on layers whose calibration max error is below this, else client")
    ap.add_argument("--noise", type=float, default=1e-4, help="std of the CKKS-error stand-in")
    ap.add_argument("--only-approx", action="store_true",
                    help="run only the variants with the approximated (sqexp) attention")
    ap.add_argument("--where-calibrated", action="store_true",
                    help="sqexp only on the layers the attention plan covers, client-aided softmax elsewhere")
    ap.add_argument("--quick", action="store_true", help="only the default plan, with and without noise")
    ap.add_argument("--threads", type=int, default=1)
    return ap.parse_args()


def _corpora(model, tok, args, layers):
    """(evaluation sequences, their prompt lengths, gate samples per layer), from ``--cache`` if there."""
    if args.cache and Path(args.cache).exists():
        c = torch.load(args.cache)
        return c["seqs"], c["plens"], c["gates"]
    prompts = load_prompts("evaluation")[:args.eval_prompts]
    seqs = chat_corpus(model, tok, prompts, args.eval_new_tokens)
    plens = [len(tok.apply_chat_template([{"role": "user", "content": p}])) for p in prompts]
    cal = chat_corpus(model, tok, load_prompts("calibration")[:args.cal_prompts], args.cal_new_tokens)
    gates = collect_gates(model, cal, layers)
    if args.cache:
        torch.save({"seqs": seqs, "plens": plens, "gates": gates}, args.cache)
    return seqs, plens, gates


def _silu_fits(gates, args, layers):
    fits = {}
    for d in (int(v) for v in args.degrees.split(",")):
        polys = {i: fit_silu(gates[i], d) for i in layers}
        errs = {i: float((p(gates[i]) - F.silu(gates[i])).abs().max()) for i, p in polys.items()}
        fits[d] = (polys, errs)
        print(f"  SiLU degree {d}: max error per layer " +
              " ".join(f"{i}:{e:.3f}" for i, e in errs.items()), flush=True)
    return fits


def _approx_plan(cfg, name: str, attn: Plan, where_calibrated: bool):
    """Layers 2-29 on the server with the attention plan's sqexp map (only where it has one, if asked)."""
    plan = offload_plan(cfg, name, attention_plan_hash=attn.content_hash)
    if not where_calibrated:
        return plan
    keep = set(attn.layer_indices)
    layers = tuple(p if p.index in keep or p.attention != "server" else
                   LayerPlacement(p.index, p.attention, p.mlp, "client", p.silu) for p in plan.layers)
    return OffloadPlan(name, plan.config, layers, attn.content_hash)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from server.cli_fhe import _load_model_and_tokenizer

    _, model, tok = _load_model_and_tokenizer("default")
    attn = Plan.load(args.attention_plan) if args.attention_plan else None
    old = load_default_plan()
    cfg, name = model.config, "SmolLM2-135M-Instruct"
    layers = tuple(range(2, cfg.num_hidden_layers))
    t0 = time.perf_counter()
    seqs, plens, gates = _corpora(model, tok, args, layers)
    plain = [sequence_logits(model, ids, None) for ids in seqs]
    print(f"evaluation: {len(seqs)} held-out prompts ({time.perf_counter() - t0:.0f} s)", flush=True)
    fits = _silu_fits(gates, args, layers)

    client_aided = offload_plan(cfg, name, softmax="client")
    variants = [("all client-aided (exact softmax + SiLU on the client)", client_aided, 0.0),
                ("  same, + CKKS-error stand-in", client_aided, args.noise)]
    if attn is not None:
        default = _approx_plan(cfg, name, attn, args.where_calibrated)
        what = ("sqexp attention on the attention plan's layers, client-aided softmax elsewhere"
                if args.where_calibrated else "sqexp attention on all 28")
        variants += [(f"**client-aided MLP + {what}**", default, 0.0),
                     ("  same, + CKKS-error stand-in", default, args.noise)]
    else:
        default = client_aided
    for d, (polys, errs) in fits.items():
        good = {i: p for i, p in polys.items() if errs[i] <= args.hybrid_tol}
        hybrid = (f"hybrid: poly SiLU d={d} on {len(good)} layers (max err <= {args.hybrid_tol}), "
                  f"client-aided on {len(layers) - len(good)}")
        variants.append((f"poly SiLU d={d} on all 28, softmax client-aided", with_poly_silu(client_aided, polys), 0.0))
        variants.append((f"{hybrid}, softmax client-aided", with_poly_silu(client_aided, good), 0.0))
        if attn is not None:
            approx = with_poly_silu(default, polys)
            variants.append((f"approximated: sqexp attention + poly SiLU d={d} on all 28", approx, 0.0))
            variants.append(("  same, + CKKS-error stand-in", approx, args.noise))
            variants.append((f"{hybrid}, sqexp attention", with_poly_silu(default, good), 0.0))
    variants.append(("old partial plan (attention 2-5 on the server, sqexp)", partial_plan(cfg, old), 0.0))

    if args.quick:
        variants = variants[2:4] if attn is not None else variants[:2]
    if args.only_approx:
        variants = [v for v in variants if v[1].approx_layers and v[1].attention_plan_hash != old.content_hash]
    by_hash = {p.content_hash: p for p in (old, attn) if p is not None}
    rows = []
    for label, plan, noise in variants:
        t = time.perf_counter()
        a = by_hash.get(plan.attention_plan_hash)
        r = fidelity(OffloadSimulator(model, plan, a, noise), seqs, plens, plain)
        rows.append((label, plan, noise, r))
        print(f"  {label}: top-1 {100 * r['top1']:.2f}%, KL {r['kl']:.3g} ({time.perf_counter() - t:.0f} s)",
              flush=True)

    print(f"\n{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; {rows[0][3]['positions']} answer "
          f"positions of {len(seqs)} held-out prompts; attention plan "
          f"{attn.content_hash[:12] if attn else '(none)'}; noise std {args.noise}")
    print("| variant | round trips/token | top-1 vs plaintext | mean KL | max KL |")
    print("|---|---|---|---|---|")
    for label, plan, _noise, r in rows:
        print(f"| {label} | {plan.round_trips} | {100 * r['top1']:.2f}% | {r['kl']:.2e} | {r['kl_max']:.2e} |")


if __name__ == "__main__":
    main()
