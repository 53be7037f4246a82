"""Where an encrypted prompt's time goes: every CKKS operation of one layer, counted by stage and level.

Runs SmolLM2 layer 3 of the shipped plan on the symbolic evaluator (exact values, SEAL's levels and
scales, no encryption: seconds, not minutes) the way the SDK sends a ``--prompt`` -token prompt: packed
chunks of B tokens, the tail token by token, then ``--decode-context`` decode step(s). Each operation is
tallied by (stage, op, level) and priced with a per-level cost model fitted to ``bench/fhe_ops.py``'s
measured SEAL costs (N = 32768, 2 cores, load ~1.5, 2026-12-02), so the printout says which stage and
which operation a prompt's time is in, and what an improvement to one of them can give::

    python -m bench.fhe_cost_model --prompt 32 --decode-context 128
    python -m bench.fhe_cost_model --plan polyexp --params 16384:54,36,36,36,36,36,36,36,36,36,60:36

At N = 16384 every price is halved (SEAL's operations are linear in N at a given number of primes;
measured rotate at the top level: 56 ms at N = 16384 / 10 primes vs 136-162 ms at 32768 / 12 primes).

The model is an estimate (key switches ~ L(L+1), the rest ~ L at level L); measured wall times are in
docs/benchmarks.md beside it.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from contextlib import contextmanager

# ms per operation at level L, fitted to bench/fhe_ops.py (12 / 11 / 4 primes; key switches ~ L(L+1))
COST_MS = {
    "rotate": lambda lv: 0.85 * lv * (lv + 1),
    "relinearize": lambda lv: 0.85 * lv * (lv + 1),
    "encode": lambda lv: 0.8 * lv,
    "mul_plain": lambda lv: 0.27 * lv,
    "mul": lambda lv: 1.1 * lv,
    "rescale": lambda lv: 1.05 * lv,
}

_N_FACTOR = 1.0     # prices scale with N (set from the parameters in main)

STAGES = {   # method -> stage name (packed chunk and decode step)
    ("fhe.packed", "PackedPrefill", "_project_q"): "packed: q map",
    ("fhe.packed", "PackedPrefill", "_project_kv"): "packed: k, v maps",
    ("fhe.packed", "PackedPrefill", "_down"): "packed: scores (row shifts)",
    ("fhe.packed", "PackedPrefill", "_below"): "packed: scores (earlier blocks)",
    ("fhe.packed", "PackedPrefill", "_outputs"): "packed: output maps",
    ("fhe.packed", "PackedPrefill", "_horner"): "packed: Horner sum over row shifts",
    ("fhe.attention", "EncryptedAttentionLayer", "_insert"): "token: cache insert",
    ("fhe.attention", "EncryptedAttentionLayer", "_project_qk"): "token: q/k projection, RoPE, q copy",
    ("fhe.attention", "EncryptedAttentionLayer", "_project_v"): "token: V path",
    ("fhe.attention", "EncryptedAttentionLayer", "_blocks_p"): "token: scores per cache block",
    ("fhe.attention", "EncryptedAttentionLayer", "_finish"): "token: row sums, output maps",
    ("fhe.attention", "EncryptedAttentionLayer", "_attend"): "token: Σ p·V relinearization",
    ("fhe.attention", "EncryptedAttentionLayer", "_attend_single"): "token: first position",
}


def _tally_evaluator(params):
    from fhe.backends.symbolic import SymbolicEvaluator

    class Tally(SymbolicEvaluator):
        """The symbolic evaluator, counting each priced operation by (stage, op, level)."""

        stage = "other"

        def _t(self, op: str, level: int) -> None:
            self.tally[(self.stage, op, level)] += 1

        def encode(self, values, level, scale):
            self._t("encode", level)
            return super().encode(values, level, scale)

        def mul_plain(self, ct, pt):
            self._t("mul_plain", ct.level)
            return super().mul_plain(ct, pt)

        def mul(self, a, b):
            self._t("mul", a.level)
            return super().mul(a, b)

        def relinearize(self, ct, keys):
            self._t("relinearize", ct.level)
            return super().relinearize(ct, keys)

        def rescale(self, ct):
            self._t("rescale", ct.level)
            return super().rescale(ct)

        def rotate(self, ct, step, keys):
            if step % self.slots:
                self._t("rotate", ct.level)
            return super().rotate(ct, step, keys)

    ev = Tally(params)
    ev.tally = Counter()
    return ev


def _staged(ev):
    """Wrap the stage methods so that the evaluator knows which stage it is in (the innermost one)."""
    import importlib

    for (mod, cls, name), stage in STAGES.items():
        klass = getattr(importlib.import_module(mod), cls)
        f = getattr(klass, name)

        def run(*a, _f=f, _stage=stage, **k):
            outer = ev.stage
            ev.stage = _stage
            try:
                return _f(*a, **k)
            finally:
                ev.stage = outer
        setattr(klass, name, run)


@contextmanager
def _section(ev, totals: dict, name: str):
    before = Counter(ev.tally)
    yield
    totals[name] = Counter(ev.tally) - before


def _print(title: str, tally: Counter) -> float:
    by_stage: dict[str, Counter] = {}
    for (stage, op, lv), n in tally.items():
        by_stage.setdefault(stage, Counter())[op] += n
        by_stage[stage]["ms"] += n * COST_MS[op](lv) * _N_FACTOR
    total = sum(c["ms"] for c in by_stage.values()) / 1e3
    print(f"\n{title}: {total:.1f} s estimated")
    print("| stage | key switches | encodes | plaintext products | est. s | share |")
    print("|---|---:|---:|---:|---:|---:|")
    for stage, c in sorted(by_stage.items(), key=lambda kv: -kv[1]["ms"]):
        print(f"| {stage} | {c['rotate'] + c['relinearize']} | {c['encode']} | {c['mul_plain']} | "
              f"{c['ms'] / 1e3:.1f} | {c['ms'] / 1e3 / total:.0%} |")
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--layer", type=int, default=3)
    p.add_argument("--decode-context", type=int, default=128)
    p.add_argument("--plan", default="default", help="a shipped plan's name or a plan file")
    p.add_argument("--params", default=None, metavar="N:BITS:SCALE",
                   help="override the plan's CKKS parameters, e.g. 16384:54,36,...,60:36")
    args = p.parse_args(argv)

    import torch

    from engine.default_model import default_model_dir
    from engine.loader import load_model
    from engine.model import DenseKVCache
    from engine.tokenizer import Tokenizer
    from fhe.attention import BlockClient, EncryptedAttentionLayer
    from fhe.backends.symbolic import SymbolicClient
    from fhe.calibrate import load_prompts
    from fhe.params import CKKSParams
    from fhe.plan import SHIPPED_PLANS, Plan, shipped_plan_path

    mdir = default_model_dir()
    model = load_model(mdir)
    plan = Plan.load(shipped_plan_path(args.plan) if args.plan in SHIPPED_PLANS else args.plan)
    need = max(args.prompt, args.decode_context)
    text = " ".join(load_prompts("evaluation"))
    ids = torch.tensor(Tokenizer.from_folder(mdir).apply_chat_template([{"role": "user", "content": text}]))
    ids = ids.repeat(-(-need // len(ids)))[:need]
    with torch.no_grad():
        h = model.run_layers(model.embed(ids), torch.arange(len(ids)), DenseKVCache(model.config, len(ids)),
                             0, args.layer)
        x = model.layers[args.layer].input_layernorm.normalize(h)
    lp, params = plan.layer(args.layer), CKKSParams.from_dict(plan.ckks)
    if args.params:
        n, bits, scale = args.params.split(":")
        params = CKKSParams(int(n), tuple(int(b) for b in bits.split(",")), int(scale))
    global _N_FACTOR
    _N_FACTOR = params.poly_modulus_degree / 32768
    ev = _tally_evaluator(params)
    block = EncryptedAttentionLayer(model.layers[args.layer], model.rotary, lp, model.config, params,
                                    max_tokens=max(args.prompt, args.decode_context) + 8, evaluator=ev)
    client = SymbolicClient(params, sorted(block.rotation_steps))
    keys, bc = client.server_keys(), BlockClient.for_model(client, model.config, lp.approx.kind, lp.approx.squarings)
    _staged(ev)
    b, totals = block.packed_chunk, {}
    packed = (args.prompt // b) * b if args.prompt - (args.prompt // b) * b < b // 2 else -(-args.prompt // b) * b
    packed = min(packed, args.prompt)
    cache = block.new_cache()
    with _section(ev, totals, "prefill"):
        if packed:
            block.prefill_packed(cache, bc.encrypt_packed(x[:packed]), 0, packed, keys)
        block.prefill(cache, bc.encrypt_input(x[packed:args.prompt]), packed, keys)
    if args.decode_context > args.prompt:
        with _section(ev, {}, "fill"):   # not priced: brings the cache to the decode context
            block.prefill(cache, bc.encrypt_input(x[args.prompt:args.decode_context - 1]), args.prompt, keys)
        with _section(ev, totals, "decode"):
            block.forward(cache, bc.encrypt_input(x[args.decode_context - 1:args.decode_context])[0],
                          args.decode_context - 1, keys)
    print(f"plan {plan.content_hash[:12]} ({lp.approx.kind} R = {lp.approx.squarings}), depth {params.depth}, "
          f"fold_v {block.geo.fold_v}")
    print(f"layer {args.layer}, N = {params.poly_modulus_degree}, chunk {b}: prompt {args.prompt} = "
          f"{packed} packed + {args.prompt - packed} token by token")
    t = _print(f"prefill of {args.prompt} tokens, one layer", totals["prefill"])
    print(f"\n4-layer TTFT estimate (server steps only, one process): {4 * t:.0f} s")
    if "decode" in totals:
        _print(f"decode step at context {args.decode_context}, one layer", totals["decode"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
