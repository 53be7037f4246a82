"""``cipherlm fhe calibrate`` (fit an FHE plan to a checkpoint) and ``cipherlm fhe plan-info PLAN``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``fhe`` command group."""
    fhe = sub.add_parser("fhe", help="FHE plans: calibrate approximations, inspect plans")
    fsub = fhe.add_subparsers(dest="fhe_command", required=True)
    cal = fsub.add_parser("calibrate", help="fit an FHE-friendly softmax replacement and write a plan")
    cal.add_argument("--model", default="default", help="'default', a model folder or a .gguf file")
    cal.add_argument("--layers", default="2,3,4,5", help="encrypted layers, comma-separated")
    cal.add_argument("--approx", choices=("sqexp", "polyexp", "2quad"), default="sqexp")
    cal.add_argument("--squarings", type=int, default=None,
                     help="R: sqexp (1 + x/2^R)^(2^R) (default 6); polyexp degree 2^R - 1 at depth R (default 5)")
    cal.add_argument("--window", type=float, default=None,
                     help="polyexp: P approximates exp on [-window, 0.5] (default 40)")
    cal.add_argument("--no-fit", action="store_true", help="uncalibrated: measure the range only")
    cal.add_argument("--distill-weights", action="store_true", help="2quad: also distill Wq/Wk/Wv/Wo")
    cal.add_argument("--steps", type=int, default=150, help="Adam steps per layer")
    cal.add_argument("--prompts", type=int, default=32, help="calibration prompts to use")
    cal.add_argument("--max-new-tokens", type=int, default=24, help="tokens generated per prompt")
    cal.add_argument("--margin", type=float, default=1.25, help="bound = margin * observed max |a s + b|")
    cal.add_argument("--min-denominator", type=float, default=0.0,
                     help="sqexp: push each row's z = sum_j p above this (CKKS noise in the division)")
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--threads", type=int, default=1,
                     help="torch intra-op threads (0 = torch's default; 1 avoids spin-waits on a busy box)")
    cal.add_argument("--model-id", default=None, help="name recorded in the plan (default: folder name)")
    cal.add_argument("--out", required=True, help="plan folder, or a .json file when no weights are adjusted")
    cal.set_defaults(func=_calibrate)
    info = fsub.add_parser("plan-info", help="verify a plan (hash, version) and summarize it")
    info.add_argument("plan", help="plan folder or .json file, or a shipped plan by name: 'default' "
                                   "(SmolLM2, N = 16384) or 'n32768' (the former default)")
    info.add_argument("--json", action="store_true", help="print the full metadata as JSON")
    info.set_defaults(func=_plan_info)


def _load_model_and_tokenizer(spec: str):
    from engine.loader import load_model
    from engine.tokenizer import Tokenizer
    from server.cli_model import resolve_model

    path = resolve_model(spec)
    tok = Tokenizer.from_folder(path) if path.is_dir() else Tokenizer.from_gguf(path)
    return path, load_model(path).eval(), tok


def _calibrate(args: argparse.Namespace) -> int:
    from fhe.approx import POLY_WINDOW
    from fhe.calibrate import CalibrationConfig, calibrate
    from fhe.plan import PlanError

    squarings = args.squarings if args.squarings is not None else 5 if args.approx == "polyexp" else 6
    try:
        cfg = CalibrationConfig(layers=tuple(int(v) for v in args.layers.split(",")), kind=args.approx,
                                squarings=squarings, fit=not args.no_fit,
                                window=POLY_WINDOW if args.window is None else args.window,
                                distill_weights=args.distill_weights, steps=args.steps, margin=args.margin,
                                num_prompts=args.prompts, max_new_tokens=args.max_new_tokens, seed=args.seed,
                                min_denominator=args.min_denominator)
    except ValueError as exc:
        print(f"cipherlm: error: {exc}", file=sys.stderr)
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    path, model, tok = _load_model_and_tokenizer(args.model)
    start = time.perf_counter()
    try:
        plan = calibrate(model, tok, cfg, args.model_id or path.stem, log=lambda m: print(m, flush=True))
        out = plan.save(args.out)
    except PlanError as exc:
        print(f"cipherlm: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} (content hash {plan.content_hash}) in {time.perf_counter() - start:.1f} s")
    return 0


def _plan_info(args: argparse.Namespace) -> int:
    from fhe.approx import POLY_HI
    from fhe.plan import SHIPPED_PLANS, Plan, PlanError, shipped_plan_path

    try:
        plan = Plan.load(shipped_plan_path(args.plan) if args.plan in SHIPPED_PLANS else Path(args.plan))
    except PlanError as exc:
        print(f"cipherlm: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**plan.metadata(), "content_hash": plan.content_hash}, indent=2))
        return 0
    print(f"plan {plan.content_hash}  (format v{plan.format_version}, {plan.created_by})")
    print(f"model {plan.model_id}  weights sha256 {plan.weights_sha256}")
    for lp in plan.layers:
        a = lp.approx
        rng = "" if lp.observed_range is None else "  range [{:.2f}, {:.2f}]".format(*lp.observed_range)
        extra = f"  adjusted: {', '.join(sorted(lp.weights))}" if lp.weights else ""
        window = f" window [-{a.window:g}, {POLY_HI:g}]" if a.kind == "polyexp" else ""
        print(f"  layer {lp.index}: {a.kind} R={a.squarings}{window} bound {a.bound:.2f}{rng}{extra}")
    print(f"ckks: {json.dumps(dict(plan.ckks)) if plan.ckks else '(none recorded)'}")
    return 0
