"""``cipherlm fhe calibrate`` (fit an FHE plan to a checkpoint), ``cipherlm fhe offload-plan`` (place every
layer part, fit the polynomial SiLU) and ``cipherlm fhe plan-info PLAN``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fhe.offload import OffloadPlan
    from fhe.plan import Plan


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
    cal.add_argument("--fold-v", action="store_true",
                     help="polyexp: record the CKKS parameters of the block with p*V folded into P (one level "
                          "less: R = 5 at depth 9, N = 16384; docs/fhe.md §3)")
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
    off = fsub.add_parser("offload-plan", help="write an offload plan: layers [0, k) on the client, the rest "
                                               "(attention and MLP) on the server")
    off.add_argument("--model", default="default", help="'default', a model folder or a .gguf file")
    off.add_argument("--client-layers", type=int, default=2, help="k: layers the client runs in the clear")
    off.add_argument("--softmax", choices=("approx", "client"), default="approx",
                     help="server attention: the attention plan's calibrated map, or client-aided: linear "
                          "steps (q/k/v and output projections) on the server, RoPE and the exact softmax on "
                          "the client")
    off.add_argument("--attention-plan", default=None,
                     help="plan (from 'fhe calibrate') with a score map for every server layer (softmax approx)")
    off.add_argument("--silu", choices=("client", "poly"), default="client",
                     help="server MLP: client-aided exact SiLU, or a polynomial fitted here on calibration text "
                          "(per layer: where it fits within --silu-max-error)")
    off.add_argument("--silu-degree", type=int, default=15)
    off.add_argument("--silu-margin", type=float, default=1.1, help="bound = margin * observed max |gate|")
    off.add_argument("--silu-max-error", type=float, default=0.05,
                     help="poly: a layer whose fit errs by more (max over calibration gates) stays client-aided")
    off.add_argument("--fused", action=argparse.BooleanOptionalAction, default=False,
                     help="fused linear steps (two round trips per server layer instead of four; docs/fhe.md "
                          "§10; needs softmax and SiLU client-aided, no q/k/v biases); off by default for now")
    off.add_argument("--prompts", type=int, default=32, help="calibration prompts (poly SiLU fit)")
    off.add_argument("--max-new-tokens", type=int, default=24)
    off.add_argument("--model-id", default=None)
    off.add_argument("--out", required=True, help="offload plan .json file")
    off.set_defaults(func=_offload_plan)
    info = fsub.add_parser("plan-info", help="verify a plan (hash, version) and summarize it")
    info.add_argument("plan", help="plan folder or .json file, or a shipped plan by name: 'default' (the SmolLM2 "
                                   "sqexp plan), 'polyexp' (its polyexp option), 'n16384' (that fit at depth 9, "
                                   "N = 16384) or 'offload' (the SmolLM2 offload plan); offload plans are recognized")
    info.add_argument("--json", action="store_true", help="print the full metadata as JSON")
    info.add_argument("--context", type=int, default=64, help="keys per decoded token, for the work split")
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
    from fhe.params import ckks_params_for
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
        return _error(exc)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.fold_v and args.approx != "polyexp":
        return _error("--fold-v needs --approx polyexp")
    ckks = ckks_params_for(args.approx, squarings, fold_v=True).to_dict() if args.fold_v else None
    path, model, tok = _load_model_and_tokenizer(args.model)
    start = time.perf_counter()
    try:
        plan = calibrate(model, tok, cfg, args.model_id or path.stem, ckks=ckks,
                         log=lambda m: print(m, flush=True))
        out = plan.save(args.out)
    except PlanError as exc:
        return _error(exc)
    print(f"wrote {out} (content hash {plan.content_hash}) in {time.perf_counter() - start:.1f} s")
    return 0


def _offload_plan(args: argparse.Namespace) -> int:
    from fhe.calibrate import chat_corpus, load_prompts
    from fhe.offload import OffloadPlanError, offload_plan, with_fused, with_poly_silu
    from fhe.offload_sim import fit_silu_polys
    from fhe.plan import Plan, PlanError

    path, model, tok = _load_model_and_tokenizer(args.model)
    try:
        attn = Plan.load(args.attention_plan) if args.attention_plan else None
        plan = offload_plan(model.config, args.model_id or path.stem, args.client_layers, softmax=args.softmax,
                            attention_plan_hash=None if attn is None else attn.content_hash)
        if args.silu == "poly":
            seqs = chat_corpus(model, tok, load_prompts("calibration")[:args.prompts], args.max_new_tokens)
            polys, errors = fit_silu_polys(model, seqs, plan.server_mlp, args.silu_degree, args.silu_margin)
            keep = {i: p for i, p in polys.items() if errors[i] <= args.silu_max_error}
            print(f"poly SiLU on {len(keep)} layers; client-aided where the fit errs by more than "
                  f"{args.silu_max_error}: {sorted(set(polys) - set(keep))}")
            plan = with_poly_silu(plan, keep)
        if args.fused:   # opt-in until a GPU A/B shows the gain end to end (docs/fhe.md §10)
            plan = with_fused(plan)
        plan.check_attention_plan(attn)
        if attn is not None:
            attn.check_model(model)
    except (OffloadPlanError, PlanError, ValueError) as exc:
        return _error(exc)
    out = plan.save(args.out)
    print(f"wrote {out} (content hash {plan.content_hash})")
    return 0


def _is_offload_plan(spec: str) -> bool:
    from fhe.offload import FORMAT

    if spec == "offload":
        return True
    path = Path(spec)
    if spec == "default" or path.suffix != ".json" or not path.is_file():
        return False
    try:
        return json.loads(path.read_bytes()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False  # Plan.load reports what is wrong with it


def _placement_runs(plan) -> list[tuple[int, int, str]]:
    """Consecutive layers with the same placement, as (first, last, description)."""
    def desc(p) -> str:
        if p.attention == p.mlp == "client":
            return "client (clear)"
        att = "client" if p.attention == "client" else f"server (softmax: {p.softmax})"
        if p.softmax == "client":   # what "client-aided" means for attention: say it where it is printed
            att = "server linear steps (softmax: client)"
        mlp = "client" if p.mlp == "client" else f"server (silu: {p.silu})"
        return f"attention {att}, mlp {mlp}"

    runs: list[tuple[int, int, str]] = []
    for p in plan.layers:
        d = desc(p)
        if runs and runs[-1][2] == d:
            runs[-1] = (runs[-1][0], p.index, d)
        else:
            runs.append((p.index, p.index, d))
    return runs


def _print_costs(plan, context: int) -> None:
    from fhe.offload import cost_report

    r = cost_report(plan, context)
    total_macs, total_params = r.server_macs + r.client_macs, r.server_params + r.client_params
    print(f"per token at context {context}: server runs {100 * r.server_mac_share:.1f} % of "
          f"{total_macs / 1e6:.1f} M multiply-adds ({r.round_trips} round trips)")
    if any(p.softmax == "client" for p in plan.layers):
        print("  (q.k and p.v of softmax = client layers run on the client, over its clear K/V cache: the "
              "server's share falls as the context grows)")
    print(f"parameters: client {100 * r.client_param_share:.1f} % of {total_params / 1e6:.1f} M "
          f"({r.client_params / 1e6:.1f} M), server {r.server_params / 1e6:.1f} M")
    print(f"client bundle: {r.bundle_tensor_bytes() / 1e6:.1f} MB of fp32 tensors (+ tokenizer files)")


def _error(exc: Exception | str) -> int:
    print(f"cipherlm: error: {exc}", file=sys.stderr)
    return 2


def _print_metadata(plan: Plan | OffloadPlan) -> int:
    """``plan-info --json``: a plan's (or an offload plan's) metadata with its content hash."""
    print(json.dumps({**plan.metadata(), "content_hash": plan.content_hash}, indent=2))
    return 0


def _offload_info(args: argparse.Namespace) -> int:
    from fhe.offload import OffloadPlan, OffloadPlanError, default_offload_path

    try:
        plan = OffloadPlan.load(default_offload_path() if args.plan == "offload" else Path(args.plan))
    except OffloadPlanError as exc:
        return _error(exc)
    if args.json:
        return _print_metadata(plan)
    print(f"offload plan {plan.content_hash}  ({plan.created_by})")
    print(f"model {plan.model_id}  attention plan {plan.attention_plan_hash or '(none)'}")
    for first, last, d in _placement_runs(plan):
        print(f"  layer{'s' if last > first else ''} {first}{f'-{last}' if last > first else ''}: {d}")
    print("client always: embedding, every RMSNorm (it holds the residual stream), final norm, head, sampling")
    if plan.fused:
        print("fused linear steps: attn_o+mlp_up (o_up) and mlp_down+next attn_qkv (down_qkv) as one step each")
    for i, poly in sorted(plan.silu.items()):
        print(f"  layer {i} silu: degree {poly.degree} on [-{poly.bound:.2f}, {poly.bound:.2f}]")
    _print_costs(plan, args.context)
    return 0


def _plan_info(args: argparse.Namespace) -> int:
    from fhe.approx import POLY_HI
    from fhe.plan import SHIPPED_PLANS, Plan, PlanError, shipped_plan_path

    if args.context < 1:
        return _error("--context must be >= 1")
    if _is_offload_plan(args.plan):
        return _offload_info(args)
    try:
        plan = Plan.load(shipped_plan_path(args.plan) if args.plan in SHIPPED_PLANS else Path(args.plan))
    except PlanError as exc:
        return _error(exc)
    if args.json:
        return _print_metadata(plan)
    print(f"plan {plan.content_hash}  (format v{plan.format_version}, {plan.created_by})")
    print(f"model {plan.model_id}  weights sha256 {plan.weights_sha256}")
    for lp in plan.layers:
        a = lp.approx
        rng = "" if lp.observed_range is None else "  range [{:.2f}, {:.2f}]".format(*lp.observed_range)
        extra = f"  adjusted: {', '.join(sorted(lp.weights))}" if lp.weights else ""
        window = f" window [-{a.window:g}, {POLY_HI:g}]" if a.kind == "polyexp" else ""
        print(f"  layer {lp.index}: {a.kind} R={a.squarings}{window} bound {a.bound:.2f}{rng}{extra}")
    print(f"ckks: {json.dumps(dict(plan.ckks)) if plan.ckks else '(none recorded)'}")
    _partial_costs(plan, args.context)
    return 0


def _partial_costs(plan, context: int) -> None:
    """Used on its own (attention blocks only), the plan's work split, when the model's shape is known:
    the shipped offload plan records the default model's config."""
    from fhe.offload import OffloadPlan, OffloadPlanError, default_offload_path, partial_plan

    try:
        cfg = OffloadPlan.load(default_offload_path()).model_config
    except OffloadPlanError:
        return
    if plan.model_id != "SmolLM2-135M-Instruct" or max(plan.layer_indices, default=0) >= cfg.num_hidden_layers:
        return
    print("as a partial plan (only these attention blocks on the server):")
    _print_costs(partial_plan(cfg, plan), context)
