"""The encrypted attention block of SmolLM2-135M (one layer, default plan): time per decode token at
several context lengths, a prefill, bytes up/down per token, public-key sizes.

    flock /tmp/cipherlm-heavy.lock nice python bench/fhe_attention.py --out /tmp/fhe_attention.md

Decode at context c: the session cache is filled with c-1 tokens' worth of encrypted K/V blocks
(random values, encrypted under the session key and brought to the cache's levels: a decode step's
cost does not depend on the values), then one real token goes through the block. The prefill runs
real tokens end to end. Writes a markdown snippet for docs/benchmarks.md.

``--maps``: the output stage's rotation schedules against their former ones, in the same run, on the
same ciphertexts (the output map with a middle baby step, 48 rotations, against the plain 71-rotation
BSGS; z's row sum one level lower against at level_p), and the plaintext-product sums of the output
and projection maps accumulated in place (``Kit.dot_plain``) against one new ciphertext per product
summed by ``add_many``; each with the largest output difference.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import numpy as np
import torch

from engine.default_model import default_model_dir
from engine.loader import load_model
from engine.model import DenseKVCache
from fhe.attention import BlockClient, EncryptedAttentionLayer, required_rotation_steps
from fhe.backends.seal import wire
from fhe.backends.seal.keys import CKKSClient
from fhe.params import CKKSParams, ckks_params_for
from fhe.plan import Plan, load_default_plan

#: Concrete ML's published encrypted GPT-2 attention block (their LLM use-case page).
CONCRETE_GPT2 = "encrypted GPT-2 attention block, 863 s for 8 tokens on a 196-core machine"


def fill_cache(layer: EncryptedAttentionLayer, client: CKKSClient, cache, tokens: int) -> None:
    """Put ``tokens`` tokens' worth of encrypted random K/V blocks into ``cache``."""
    geo, lay, ev, rng = layer.geo, layer.geo.layout, layer.ev, np.random.default_rng(0)
    full, rest = divmod(tokens, lay.block_tokens)
    for rows in [lay.block_tokens] * full + ([rest] if rest else []):
        k = ev.mod_switch(client.encrypt(lay.valid(rows) * rng.standard_normal(lay.slots) * 0.1), geo.level_qk)
        v = ev.mod_switch(client.encrypt(lay.valid(rows) * rng.standard_normal(lay.slots)), geo.level_v)
        ev.set_scale(k, ev.scale)
        ev.set_scale(v, ev.scale)
        cache.k_blocks.append(k)
        cache.v_blocks.append(v)
    cache.length = tokens


@torch.inference_mode()
def fidelity(model, plan, prompts: list[int], params=None, answer: int = 16, json_path=None,
             count_prefix: bool = True) -> dict:
    """Next-token top-1 agreement and KL(plain || encrypted), every plan layer's attention under CKKS.

    Sequences: each held-out evaluation prompt in the chat template followed by ``answer`` tokens of the
    plaintext model's greedy answer; every position is teacher-forced. The chat template's system
    prompt is the same for every prompt: it runs through the encrypted path once, its encrypted and
    plaintext caches are kept, and each prompt continues from them (``count_prefix``: count those
    positions, once). Rows are written to ``json_path`` after each prompt.

    Also reports the same against the plaintext simulator, to separate approximation error from
    CKKS noise. ``params`` overrides the plan's CKKS parameters (same plan, other ring or primes).
    """
    from engine.model import greedy_generate
    from engine.tokenizer import Tokenizer
    from fhe.calibrate import load_prompts
    from fhe.simulator import sequence_logits, simulated_model

    tok, texts = Tokenizer.from_folder(default_model_dir()), load_prompts("evaluation")
    seqs = {}
    for index in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": texts[index]}])
        seqs[index] = ids + greedy_generate(model, ids, answer)[:answer]
    prefix = min(next((i for i, (a, b) in enumerate(zip(s0, s1, strict=False)) if a != b), len(s0))
                 for s0 in seqs.values() for s1 in seqs.values() if s0 is not s1) if len(seqs) > 1 else 0
    cfg, lp0 = model.config, plan.layers[0].approx
    params = params or CKKSParams.from_dict(plan.ckks)
    t0 = time.perf_counter()
    client = CKKSClient(params, required_rotation_steps(cfg, params, lp0.kind, lp0.squarings))
    keys, keygen = client.server_keys(), time.perf_counter() - t0
    sim_model = simulated_model(model, plan)
    blocks = {i: EncryptedAttentionLayer.from_plan(sim_model, plan, i, params, max_tokens=128)
              for i in plan.layer_indices}
    runner = _EncryptedRun(sim_model, blocks, BlockClient.for_model(client, cfg, lp0.kind, lp0.squarings), keys,
                           max(map(len, seqs.values())))
    first = next(iter(seqs.values()))
    shared = runner.run(torch.tensor(first[:prefix]), 0)
    snapshot = runner.snapshot()
    rows = []
    for n, (index, ids) in enumerate(seqs.items()):
        ids = torch.tensor(ids)
        runner.restore(snapshot)
        enc = torch.cat([shared, runner.run(ids[prefix:], prefix)])
        ref = sequence_logits(model, ids.tolist(), None).log_softmax(-1)
        sim = sequence_logits(sim_model, ids.tolist(), plan).log_softmax(-1)
        for t in range(0 if n == 0 and count_prefix else prefix, len(ids)):
            rows.append({"prompt": index, "position": t, "agree": int(enc[t].argmax() == ref[t].argmax()),
                         "agree_sim": int(enc[t].argmax() == sim[t].argmax()),
                         "kl": float((ref[t].exp() * (ref[t] - enc[t])).sum()),
                         "kl_sim": float((sim[t].exp() * (sim[t] - enc[t])).sum())})
        print(f"prompt {index}: {len(ids)} tokens, {len(rows)} positions so far, running top-1 "
              f"{np.mean([r['agree'] for r in rows]):.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
        res = {"params": params.to_dict(), "plan": plan.content_hash, "layers": list(plan.layer_indices),
               "answer_tokens": answer, "shared_prefix": prefix, "keygen_s": keygen,
               "seconds": time.perf_counter() - t0, "rows": rows}
        if json_path:
            with open(json_path, "w") as f:
                json.dump(res, f)
    return res


@torch.inference_mode()
def precision(model, plan, layer: int, tokens: int, params=None, prompt: int = 1) -> dict:
    """Max |error| of the decrypted block output (sum_h y_h / z_h) vs the simulator on the first
    ``tokens`` real tokens of a held-out evaluation prompt, through ``prefill``."""
    from engine.tokenizer import Tokenizer
    from fhe.calibrate import load_prompts
    from fhe.simulator import finish, simulate_block

    tok = Tokenizer.from_folder(default_model_dir())
    ids = torch.tensor(tok.apply_chat_template(
        [{"role": "user", "content": load_prompts("evaluation")[prompt]}])[:tokens])
    h = model.run_layers(model.embed(ids), torch.arange(len(ids)), DenseKVCache(model.config, len(ids)), 0, layer)
    x, lp = model.layers[layer].input_layernorm.normalize(h), plan.layer(layer)
    params = params or CKKSParams.from_dict(plan.ckks)
    block = EncryptedAttentionLayer(model.layers[layer], model.rotary, lp, model.config, params, max_tokens=1024)
    client = CKKSClient(params, sorted(block.rotation_steps))
    bc = BlockClient.for_model(client, model.config, lp.approx.kind, lp.approx.squarings)
    t = time.perf_counter()
    outs = block.prefill(block.new_cache(), bc.encrypt_input(x), 0, client.server_keys())
    seconds = (time.perf_counter() - t) / len(ids)
    ys, zs, _ = simulate_block(model.layers[layer], model.rotary, x, torch.arange(len(ids)), None, lp)
    err = (finish(*bc.decrypt_output(outs)) - finish(ys, zs)).abs()
    return {"params": params.to_dict(), "plan": plan.content_hash, "layer": layer, "tokens": len(ids),
            "max_error": err.max().item(), "mean_error": err.mean().item(), "seconds_per_token": seconds,
            "max_error_per_position": [float(f"{e:.3g}") for e in err.amax(dim=-1).tolist()]}


class _EncryptedRun:
    """The model with the plan's attention blocks under CKKS, token by token, with cache snapshots."""

    def __init__(self, sim_model, blocks, bc: BlockClient, keys, max_len: int) -> None:
        self.model, self.blocks, self.bc, self.keys = sim_model, blocks, bc, keys
        self.caches = {i: b.new_cache() for i, b in blocks.items()}
        self.plain = DenseKVCache(sim_model.config, max_len)

    def snapshot(self):
        """Copies of the cache lists (cached ciphertexts are never modified in place) and tensors."""
        enc = {i: (list(c.k_blocks), list(c.v_blocks), c.length) for i, c in self.caches.items()}
        return enc, self.plain.k.clone(), self.plain.v.clone(), self.plain.length

    def restore(self, snap) -> None:
        enc, k, v, length = snap
        for i, (kb, vb, n) in enc.items():
            c = self.caches[i]
            c.k_blocks, c.v_blocks, c.length = list(kb), list(vb), n
        self.plain.k.copy_(k)
        self.plain.v.copy_(v)
        self.plain.length = length

    def run(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Log-probabilities [T, vocab] for positions start.. (the caches must hold start tokens)."""
        out, model, bc = [], self.model, self.bc
        for j in range(len(ids)):
            t, pos = start + j, torch.tensor([start + j])
            h = model.embed(ids[j:j + 1])
            for i, layer in enumerate(model.layers):
                if i in self.blocks:
                    x = layer.input_layernorm.normalize(h)
                    ct = self.blocks[i].forward(self.caches[i], bc.encrypt_input(x)[0], t, self.keys)
                    y, z = bc.decrypt_output([ct])
                    h = layer.mlp_block(h + BlockClient.finish(y, z).to(h.dtype))
                else:
                    h = layer(h, pos, model.rotary, self.plain)
            self.plain.advance()
            out.append(model.logits(h).log_softmax(-1)[0])
        return torch.stack(out) if out else torch.empty(0, model.config.vocab_size)


def summarize(rows: list[dict]) -> dict:
    """Top-1 agreement and mean/max KL over fidelity rows (vs plaintext and vs the simulator)."""
    col = {k: np.array([r[k] for r in rows]) for k in ("agree", "agree_sim", "kl", "kl_sim")}
    return {"positions": len(rows), "top1_vs_plain": float(col["agree"].mean()),
            "mean_kl_vs_plain": float(col["kl"].mean()), "max_kl_vs_plain": float(col["kl"].max()),
            "top1_vs_simulator": float(col["agree_sim"].mean()),
            "mean_kl_vs_simulator": float(col["kl_sim"].mean())}


def compare_maps(layer: EncryptedAttentionLayer, client: CKKSClient, keys, reps: int = 3) -> dict:
    """Seconds per call of the output stage's schedules vs their former ones (same run, same inputs)."""
    from fhe.linalg import SlotMap, Steps, _babies, rotate_sum

    geo, lay, ev, gk = layer.geo, layer.geo.layout, layer.ev, keys
    rng = np.random.default_rng(0)
    wo = layer.maps.out
    former = SlotMap(ev.slots, wo.dst, wo.src, wo.weight,
                     Steps(0, -lay.num_heads, lay.hidden // lay.head_dim, lay.band, lay.head_dim))
    enc_former = former.encode(ev, geo.level_p - 1)
    u = ev.mod_switch(client.encrypt(lay.valid(1) * rng.standard_normal(ev.slots)), geo.level_p - 1)
    p = ev.mod_switch(client.encrypt(lay.valid(lay.block_tokens) * rng.random(ev.slots)), geo.level_p)
    ev.set_scale(u, ev.scale)
    ev.set_scale(p, ev.scale)

    def timed(fn):
        out, best = None, float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            out = fn()
            best = min(best, time.perf_counter() - t)
        return out, best

    y_new, t_new = timed(lambda: layer.enc_out(ev, u, gk))
    y_old, t_old = timed(lambda: enc_former(ev, u, gk))
    row_sum = (lay.num_heads, lay.block_tokens, gk)
    z_low, tz_low = timed(lambda: rotate_sum(ev, ev.mod_switch(p, geo.level_p - 1), *row_sum, horner=True))
    z_high, tz_high = timed(lambda: rotate_sum(ev, p, *row_sum, horner=True))
    dec = client.decrypt
    products = {}
    for name, enc, lvl in [("out", layer.enc_out, geo.level_p - 1), ("qk", layer.enc_qk.encoded, geo.top)]:
        x = ev.mod_switch(client.encrypt(lay.valid(1) * rng.standard_normal(ev.slots)), lvl)
        rot = _babies(ev, x, enc.map.steps, {k for grp in enc.plaintexts.values() for k, _ in grp}, gk)
        groups = [[(rot[k], pt) for k, pt in grp] for grp in enc.plaintexts.values()]
        acc, t_acc = timed(lambda groups=groups: [ev.dot_plain(g) for g in groups])
        lst, t_lst = timed(lambda groups=groups: [ev.add_many([ev.mul_plain(c, p) for c, p in g]) for g in groups])
        products |= {f"{name}_products_s": t_acc, f"{name}_products_former_s": t_lst,
                     f"{name}_products_max_diff": max(float(np.abs(dec(a) - dec(b)).max())
                                                      for a, b in zip(acc, lst, strict=True))}
    return products | {"out_map_s": t_new, "out_map_former_s": t_old,
            "out_map_max_diff": float(np.abs(dec(y_new) - dec(y_old)).max()),
            "z_row_sum_s": tz_low, "z_row_sum_former_s": tz_high,
            "z_row_sum_max_diff": float(np.abs(dec(z_low) - dec(z_high)).max()), "reps": reps}


def _indices(spec: str) -> list[int]:
    """'0-3,7' -> [0, 1, 2, 3, 7]."""
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layer", type=int, default=3)
    ap.add_argument("--contexts", default="16,128,512")
    ap.add_argument("--prefill", type=int, default=32)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plan", default=None, help="plan file (default: the shipped plan)")
    ap.add_argument("--fidelity", default=None, metavar="PROMPTS",
                    help="fidelity through the encrypted path over these evaluation prompts, e.g. 0-3 or 4,5")
    ap.add_argument("--answer", type=int, default=16, help="fidelity: greedy answer tokens after each prompt")
    ap.add_argument("--no-prefix-count", action="store_true", help="fidelity: do not count the shared prefix")
    ap.add_argument("--params", default=None, metavar="N:BITS:SCALE",
                    help="override the plan's CKKS parameters, e.g. 16384:48,30,...,60:30")
    ap.add_argument("--precision", type=int, default=0, metavar="T",
                    help="block error vs the simulator on T real tokens of layer --layer")
    ap.add_argument("--json", default=None, help="fidelity: write rows here")
    ap.add_argument("--merge", nargs="+", default=None, help="summarize fidelity JSON files of several runs")
    ap.add_argument("--maps", action="store_true", help="output-stage schedules vs their former ones")
    args = ap.parse_args()
    if args.merge:
        runs = [json.load(open(path)) for path in args.merge]
        print(json.dumps({"params": runs[0]["params"], "plan": runs[0]["plan"]}
                         | summarize([r for run in runs for r in run["rows"]])))
        return
    torch.set_num_threads(1)
    model = load_model(default_model_dir())
    plan = Plan.load(args.plan) if args.plan else load_default_plan()
    params = None
    if args.params:
        n, bits, scale = args.params.split(":")
        params = CKKSParams(int(n), tuple(int(b) for b in bits.split(",")), int(scale))
    if args.precision:
        print(json.dumps(precision(model, plan, args.layer, args.precision, params)))
        return
    if args.fidelity is not None:
        res = fidelity(model, plan, _indices(args.fidelity), params, args.answer, args.json,
                       not args.no_prefix_count)
        print(json.dumps({k: v for k, v in res.items() if k != "rows"} | summarize(res["rows"])))
        return
    lp = plan.layer(args.layer)
    params = params or ckks_params_for(lp.approx.kind, lp.approx.squarings)
    cfg = model.config
    t = time.perf_counter()
    client = CKKSClient(params, required_rotation_steps(cfg, params, lp.approx.kind, lp.approx.squarings))
    keygen = time.perf_counter() - t
    upload = wire.dump_public_keys(client)
    keys = wire.load_server_keys(upload, params, client.rotation_steps)
    t = time.perf_counter()
    layer = EncryptedAttentionLayer.from_plan(model, plan, args.layer, params, max_tokens=1024)
    setup = time.perf_counter() - t
    if args.maps:
        print(json.dumps(compare_maps(layer, client, keys)))
        return
    bc = BlockClient.for_model(client, cfg, lp.approx.kind, lp.approx.squarings)
    x = torch.randn(1, cfg.hidden_size)
    x = x / x.pow(2).mean().sqrt()
    up = len(wire.encrypt_to_wire(client, bc.layout_input(x[0])))
    rows = []
    for ctx in [int(c) for c in args.contexts.split(",")]:
        cache = layer.new_cache()
        fill_cache(layer, client, cache, ctx - 1)
        ct = bc.encrypt_input(x)[0]
        t = time.perf_counter()
        out = layer.forward(cache, ct, ctx - 1, keys)
        rows.append((f"decode @ context {ctx}", time.perf_counter() - t, 1))
    down = len(wire.dump_ciphertext(out, params, client.fingerprint))
    if args.prefill:
        cache = layer.new_cache()
        xs = torch.randn(args.prefill, cfg.hidden_size)
        cts = bc.encrypt_input(xs / xs.pow(2).mean(-1, keepdim=True).sqrt())
        t = time.perf_counter()
        layer.prefill(cache, cts, 0, keys)
        rows.append((f"prefill {args.prefill} tokens", time.perf_counter() - t, args.prefill))
    sizes = wire.public_key_sizes(upload)
    print(f"params N={params.poly_modulus_degree} {params.coeff_mod_bit_sizes}; Galois keys: "
          f"{len(client.rotation_steps)}; keygen {keygen:.1f} s; layer setup {setup:.1f} s")
    print(f"{'case':>26} {'seconds':>9} {'s/token':>8}")
    for name, sec, n in rows:
        print(f"{name:>26} {sec:9.2f} {sec / n:8.2f}")
    total_mb = sum(sizes.values()) / 1e6
    print(f"bytes up/token/layer {up}, down {down}; public keys {sizes} (total {total_mb:.1f} MB)")
    md = [f"### Encrypted attention block, SmolLM2-135M layer {args.layer} ({datetime.date.today()})", "",
          "Command: `flock /tmp/cipherlm-bench.lock python bench/fhe_attention.py`", "",
          f"CKKS N={params.poly_modulus_degree}, primes {params.coeff_mod_bit_sizes} (128-bit), "
          f"approximation {lp.approx.kind} R={lp.approx.squarings}, plan {plan.content_hash[:12]}", "",
          "| case | seconds | seconds / token |", "|---|---|---|",
          *[f"| {n} | {s:.2f} | {s / k:.2f} |" for n, s, k in rows], "",
          f"Bytes per token per layer: up {up / 1e6:.2f} MB (seeded ciphertext), down {down / 1e6:.2f} MB. "
          f"Public keys: {sum(sizes.values()) / 1e6:.0f} MB ({len(client.rotation_steps)} Galois keys "
          f"{sizes['galois_keys'] / 1e6:.0f} MB, relin {sizes['relin_keys'] / 1e6:.0f} MB, "
          f"public {sizes['public_key'] / 1e6:.1f} MB). "
          f"Key generation {keygen:.0f} s, layer setup {setup:.0f} s.",
          "", f"Peer figure: Concrete ML, {CONCRETE_GPT2}.", ""]
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
