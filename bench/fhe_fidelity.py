"""Fidelity of the FHE-friendly softmax replacements vs the plaintext model (plaintext simulation).

For each variant (exact softmax through the y/z split, sqexp uncalibrated, sqexp calibrated or the
shipped default plan, any saved plan given with ``--extra-plan`` (e.g. polyexp), 2Quad uncalibrated,
2Quad distilled) on the same encrypted layers: next-token top-1 agreement and mean
KL(plain || approx) over every answer position of the held-out evaluation prompts (teacher-forced on the
plaintext model's greedy answer), and how many greedy continuations stay identical. A greedy continuation
is identical iff the approximated model's argmax agrees at every one of those positions (same inputs by
induction); ``--verify-greedy N`` also decodes N prompts for real and checks that equivalence.

Usage::

    flock /tmp/cipherlm-bench.lock python bench/fhe_fidelity.py --layers 2,3,4,5
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time

import torch

from engine.model import LlamaForCausalLM
from fhe.approx import ScoreApprox
from fhe.calibrate import CalibrationConfig, chat_corpus, collect, fit_layer, load_prompts
from fhe.plan import LayerPlan, Plan, load_default_plan, model_fingerprint
from fhe.simulator import sequence_logits, simulated_greedy, simulated_model


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--layers", default="2,3,4,5")
    ap.add_argument("--eval-prompts", type=int, default=44)
    ap.add_argument("--eval-new-tokens", type=int, default=24)
    ap.add_argument("--cal-prompts", type=int, default=32)
    ap.add_argument("--cal-new-tokens", type=int, default=24)
    ap.add_argument("--steps", type=int, default=150, help="Adam steps per layer (sqexp)")
    ap.add_argument("--quad-steps", type=int, default=100, help="Adam steps per layer (2quad distillation)")
    ap.add_argument("--default-plan", action="store_true",
                    help="use the shipped default plan instead of fitting sqexp R=6 here")
    ap.add_argument("--extra-plan", action="append", default=[], metavar="NAME=PATH",
                    help="also evaluate a saved plan (repeatable)")
    ap.add_argument("--skip-2quad", action="store_true", help="leave out the 2quad variants")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1 avoids spin-wait stalls on a shared, loaded machine)")
    ap.add_argument("--verify-greedy", type=int, default=3, help="prompts decoded for real per variant check")
    return ap.parse_args()


def fit_plan(model, data, layers, cfg: CalibrationConfig, name: str) -> tuple[Plan, float]:
    """Fit (or measure) every layer with ``cfg``; returns the plan and the seconds spent."""
    start, lps = time.perf_counter(), []
    for i in layers:
        lp, info = fit_layer(model, i, data[i], cfg)
        if lp is None:
            raise SystemExit(f"{name}: layer {i} range does not fit: {info}")
        lps.append(lp)
        print(f"  {name} layer {i}: rel MSE {info['rel_mse_initial']:.4g} -> {info['rel_mse']:.4g}, "
              f"range [{info['observed_range'][0]:.2f}, {info['observed_range'][1]:.2f}], "
              f"min z {info['min_denominator']:.3g}", flush=True)
    return Plan("bench", model_fingerprint(model), tuple(lps)), time.perf_counter() - start


def evaluate(model: LlamaForCausalLM, plan: Plan, seqs, prompt_lens, plain_logits) -> dict:
    """Top-1 agreement, mean KL and identical greedy continuations over the answer positions."""
    sim = simulated_model(model, plan)
    agree = total = 0
    kls, per_seq = [], []
    for ids, plen, ref in zip(seqs, prompt_lens, plain_logits, strict=True):
        rows = slice(plen - 1, len(ids) - 1)
        got = sequence_logits(sim, ids, plan)[rows]
        ok = got.argmax(-1) == ref[rows].argmax(-1)
        lp_ref, lp_got = ref[rows].double().log_softmax(-1), got.double().log_softmax(-1)
        kls.append((lp_ref.exp() * (lp_ref - lp_got)).sum(-1))
        agree, total = agree + int(ok.sum()), total + ok.numel()
        per_seq.append(bool(ok.all()))
    kl = torch.cat(kls)
    return {"top1": agree / total, "kl": float(kl.mean()), "kl_max": float(kl.max()), "positions": total,
            "identical": sum(per_seq), "per_seq": per_seq, "sequences": len(seqs), "sim": sim}


def verify_greedy(sim, plan, seqs, prompt_lens, n: int, per_seq: list[bool], eos: int | None) -> str:
    """Decode n prompts for real; count those where 'identical' matches the teacher-forced criterion."""
    consistent = 0
    for ids, plen, flag in list(zip(seqs, prompt_lens, per_seq, strict=True))[:n]:
        out = simulated_greedy(sim, plan, ids[:plen], len(ids) - plen, None if eos is None else {eos})
        consistent += int((out == ids[plen:]) == flag)
    return f"{consistent}/{n}"


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    from server.cli_fhe import _load_model_and_tokenizer

    _, model, tok = _load_model_and_tokenizer(args.model)
    layers = tuple(int(v) for v in args.layers.split(","))
    t0 = time.perf_counter()
    ev_prompts = load_prompts("evaluation")[:args.eval_prompts]
    seqs = chat_corpus(model, tok, ev_prompts, args.eval_new_tokens)
    plens = [len(tok.apply_chat_template([{"role": "user", "content": p}])) for p in ev_prompts]
    plain = [sequence_logits(model, ids, None) for ids in seqs]
    answer = sum(len(s) - p for s, p in zip(seqs, plens, strict=True))
    print(f"evaluation: {len(seqs)} held-out prompts, {answer} answer positions "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    t0 = time.perf_counter()
    cal = chat_corpus(model, tok, load_prompts("calibration")[:args.cal_prompts], args.cal_new_tokens)
    data = collect(model, cal, layers)
    print(f"calibration: {len(cal)} sequences, {sum(map(len, cal))} positions "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)

    hq = model.config.num_attention_heads
    variants: list[tuple[str, Plan, float]] = [
        ("exact softmax (y/z split)", Plan("bench", "", tuple(LayerPlan(i, ScoreApprox.exact(hq))
                                                              for i in layers)), 0.0)]
    variants.append(("sqexp R=6 uncalibrated", *fit_plan(
        model, data, layers, CalibrationConfig(layers, "sqexp", fit=False), "sqexp-uncal")))
    if args.default_plan:
        plan = load_default_plan()
        plan.check_model(model)
        a = plan.layers[0].approx
        variants.append((f"{a.kind} R={a.squarings} shipped default (plan {plan.content_hash[:12]})", plan, 0.0))
    else:
        variants.append(("sqexp R=6 calibrated (scale+shift)", *fit_plan(
            model, data, layers, CalibrationConfig(layers, "sqexp", steps=args.steps), "sqexp-cal")))
    for spec in args.extra_plan:
        name, _, path = spec.rpartition("=")  # the name may contain "=" (R=6)
        plan = Plan.load(path)
        plan.check_model(model)
        variants.append((f"{name} (plan {plan.content_hash[:12]})", plan, 0.0))
    if not args.skip_2quad:
        variants.append(("2quad uncalibrated (c=5)", *fit_plan(
            model, data, layers, CalibrationConfig(layers, "2quad", fit=False), "2quad-uncal")))
        variants.append(("2quad distilled (a,b,Wq,Wk,Wv,Wo)", *fit_plan(
            model, data, layers, CalibrationConfig(layers, "2quad", distill_weights=True,
                                                   steps=args.quad_steps), "2quad-distilled")))

    rows = []
    for name, plan, secs in variants:
        r = evaluate(model, plan, seqs, plens, plain)
        check = verify_greedy(r["sim"], plan, seqs, plens, args.verify_greedy, r["per_seq"],
                              tok.eos_token_id) if args.verify_greedy else "-"
        rows.append((name, r, secs, check))
        print(f"  {name}: top-1 {100 * r['top1']:.1f}%, KL {r['kl']:.3g}", flush=True)

    print(f"\n{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; layers {list(layers)} of "
          f"{len(model.layers)}; {rows[0][1]['positions']} positions of {rows[0][1]['sequences']} "
          f"held-out prompts\n")
    print("| variant | top-1 agreement | mean KL | max KL | identical greedy continuations "
          "| real-decode check | fit time |")
    print("|---|---|---|---|---|---|---|")
    for name, r, secs, check in rows:
        print(f"| {name} | {100 * r['top1']:.1f}% | {r['kl']:.2e} | {r['kl_max']:.2e} | "
              f"{r['identical']}/{r['sequences']} | {check} | {secs:.0f} s |")


if __name__ == "__main__":
    main()
