"""The encrypted attention block of SmolLM2-135M (one layer, default plan): time per decode token at
several context lengths, a prefill, bytes up/down per token, public-key sizes.

    flock /tmp/cipherlm-bench.lock python bench/fhe_attention.py --out /tmp/fhe_attention.md

Decode at context c: the session cache is filled with c-1 tokens' worth of encrypted K/V blocks
(random values, encrypted under the session key and brought to the cache's levels: a decode step's
cost does not depend on the values), then one real token goes through the block. The prefill runs
real tokens end to end. Writes a markdown snippet for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import time

import numpy as np
import torch

from engine.default_model import default_model_dir
from engine.loader import load_model
from fhe import wire
from fhe.attention import BlockClient, EncryptedAttentionLayer, required_rotation_steps
from fhe.ckks import CKKSClient
from fhe.params import ckks_params_for
from fhe.plan import load_default_plan

#: Concrete ML's published encrypted GPT-2 attention block (their LLM use-case page).
CONCRETE_GPT2 = "encrypted GPT-2 attention block, 863 s for 8 tokens on a 196-core machine"


def fill_cache(layer: EncryptedAttentionLayer, client: CKKSClient, cache, tokens: int) -> None:
    """Put ``tokens`` tokens' worth of encrypted random K/V blocks into ``cache``."""
    geo, lay, rng = layer.geo, layer.geo.layout, np.random.default_rng(0)
    full, rest = divmod(tokens, lay.block_tokens)
    for rows in [lay.block_tokens] * full + ([rest] if rest else []):
        k = client.kit.drop_to(client.encrypt(lay.valid(rows) * rng.standard_normal(lay.slots) * 0.1),
                               geo.level_qk)
        v = client.kit.drop_to(client.encrypt(lay.valid(rows) * rng.standard_normal(lay.slots)), geo.level_p)
        k.scale = v.scale = client.kit.scale
        cache.k_blocks.append(k)
        cache.v_blocks.append(v)
    cache.length = tokens


@torch.inference_mode()
def fidelity(model, plan, positions: int, prompt_index: int = 0) -> dict:
    """Next-token top-1 agreement and KL(plain || encrypted) over the first ``positions`` tokens of a
    held-out evaluation prompt, every plan layer's attention run under CKKS (teacher forcing).

    Also reports the same against the plaintext simulator, to separate approximation error from
    CKKS noise.
    """
    from engine.model import DenseKVCache
    from engine.tokenizer import Tokenizer
    from fhe.calibrate import load_prompts
    from fhe.simulator import SimulatedBackend, simulated_model

    tok = Tokenizer.from_folder(default_model_dir())
    text = load_prompts("evaluation")[prompt_index]
    ids = torch.tensor(tok.apply_chat_template([{"role": "user", "content": text}])[:positions])
    cfg, n = model.config, len(ids)
    lp0 = plan.layers[0].approx
    params = ckks_params_for(lp0.kind, lp0.squarings)
    client = CKKSClient(params, required_rotation_steps(cfg, params, lp0.kind, lp0.squarings))
    keys = client.server_keys()
    sim_model = simulated_model(model, plan)
    blocks = {i: EncryptedAttentionLayer.from_plan(sim_model, plan, i, params, max_tokens=max(64, n))
              for i in plan.layer_indices}
    caches = {i: b.new_cache() for i, b in blocks.items()}
    bc = BlockClient.for_model(client, cfg, lp0.kind, lp0.squarings)
    plain_cache, enc_cache = DenseKVCache(cfg, n), DenseKVCache(cfg, n)
    sim_backend = SimulatedBackend(sim_model, plan, n)
    agree = agree_sim = 0
    kls, kls_sim = [], []
    for t in range(n):
        pos = torch.tensor([t])
        ref = model.logits(model(ids[t:t + 1], pos, plain_cache)).log_softmax(-1)
        plain_cache.advance()
        sim = sim_model.logits(sim_model(ids[t:t + 1], pos, sim_backend)).log_softmax(-1)
        sim_backend.advance()
        h = sim_model.embed(ids[t:t + 1])
        for i, layer in enumerate(sim_model.layers):
            if i in blocks:
                x = layer.input_layernorm.normalize(h)
                out = blocks[i].forward(caches[i], bc.encrypt_input(x)[0], t, keys)
                y, z = bc.decrypt_output([out])
                h = layer.mlp_block(h + BlockClient.finish(y, z).to(h.dtype))
            else:
                h = layer(h, pos, sim_model.rotary, enc_cache)
        enc_cache.advance()
        enc = sim_model.logits(h).log_softmax(-1)
        agree += int(enc.argmax() == ref.argmax())
        agree_sim += int(enc.argmax() == sim.argmax())
        kls.append(float((ref.exp() * (ref - enc)).sum()))
        kls_sim.append(float((sim.exp() * (sim - enc)).sum()))
    return {"positions": n, "layers": plan.layer_indices, "top1_vs_plain": agree / n,
            "mean_kl_vs_plain": float(np.mean(kls)), "top1_vs_simulator": agree_sim / n,
            "mean_kl_vs_simulator": float(np.mean(kls_sim))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layer", type=int, default=3)
    ap.add_argument("--contexts", default="16,128,512")
    ap.add_argument("--prefill", type=int, default=32)
    ap.add_argument("--out", default=None)
    ap.add_argument("--fidelity", type=int, default=0, help="run N positions through the encrypted plan")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, plan = load_model(default_model_dir()), load_default_plan()
    if args.fidelity:
        t = time.perf_counter()
        res = fidelity(model, plan, args.fidelity)
        print(res, f"{time.perf_counter() - t:.0f} s")
        if args.out:
            with open(args.out, "a") as f:
                f.write(f"Encrypted-path fidelity (default plan, first {res['positions']} positions of "
                        f"evaluation prompt 0, layers {res['layers']} under CKKS): top-1 agreement vs "
                        f"plaintext {res['top1_vs_plain']:.3f}, mean KL {res['mean_kl_vs_plain']:.2e}; "
                        f"vs the simulator: top-1 {res['top1_vs_simulator']:.3f}, "
                        f"mean KL {res['mean_kl_vs_simulator']:.2e}.\n")
        return
    lp = plan.layer(args.layer)
    params = ckks_params_for(lp.approx.kind, lp.approx.squarings)
    cfg = model.config
    t = time.perf_counter()
    client = CKKSClient(params, required_rotation_steps(cfg, params, lp.approx.kind, lp.approx.squarings))
    keygen = time.perf_counter() - t
    upload = wire.dump_public_keys(client)
    keys = wire.load_server_keys(upload, params, client.rotation_steps)
    t = time.perf_counter()
    layer = EncryptedAttentionLayer.from_plan(model, plan, args.layer, params, max_tokens=1024)
    setup = time.perf_counter() - t
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
