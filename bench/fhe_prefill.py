"""One encrypted layer's prefill on real SmolLM2 activations: packed chunks vs one ciphertext per token.

Builds layer 3 of the shipped plan on SEAL (the plan's CKKS parameters), encrypts the first ``T`` tokens
of held-out evaluation prompt 1, runs ``EncryptedAttentionLayer.prefill_packed`` and (with ``--token``)
``prefill`` on fresh caches in the same process, and prints wall time, the packed path's time split
(projection / scores / outputs) and the max error of ``sum_h y_h / z_h`` vs the plaintext simulator::

    flock /tmp/cipherlm-bench.lock python bench/fhe_prefill.py --tokens 28 --token

``--processes 1,2`` runs the packed prefill once per count on fresh caches (``EncryptedAttentionLayer.processes``:
2 forks a child per step, :mod:`fhe.fork`), then ``--decode-context C`` times one decode step at context C per
count (the cache padded to C - 1 tokens with copies of the prefill's blocks: the time depends on the number of
blocks, not on their values)::

    flock /tmp/cipherlm-bench.lock python bench/fhe_prefill.py --tokens 28 --processes 1,2 --decode-context 128
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=28)
    p.add_argument("--layer", type=int, default=3)
    p.add_argument("--token", action="store_true", help="also time the token-by-token prefill")
    p.add_argument("--processes", default="1", help="comma-separated process counts to time the packed path with")
    p.add_argument("--decode-context", type=int, default=0, help="also time decode steps at this context")
    p.add_argument("--decode-repeats", type=int, default=1, help="decode steps per process count (alternated)")
    p.add_argument("--plan", default="default", help="a shipped plan's name or a plan file")
    args = p.parse_args(argv)

    import os

    import torch

    import fhe.packed as packed
    from engine.default_model import default_model_dir
    from engine.loader import load_model
    from engine.model import DenseKVCache
    from engine.tokenizer import Tokenizer
    from fhe.attention import BlockClient, EncryptedAttentionLayer
    from fhe.backends.seal.keys import CKKSClient
    from fhe.calibrate import load_prompts
    from fhe.params import CKKSParams
    from fhe.plan import SHIPPED_PLANS, Plan, shipped_plan_path
    from fhe.simulator import finish, simulate_block

    split: dict[str, float] = {}

    def timed(name):
        f = getattr(packed.PackedPrefill, name)

        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                split[name] = split.get(name, 0.0) + time.perf_counter() - t0
        setattr(packed.PackedPrefill, name, run)

    for name in ("_project", "_attend", "_outputs"):
        timed(name)
    mdir = default_model_dir()
    model = load_model(mdir)
    plan = Plan.load(shipped_plan_path(args.plan) if args.plan in SHIPPED_PLANS else args.plan)
    ids = torch.tensor(Tokenizer.from_folder(mdir).apply_chat_template(
        [{"role": "user", "content": load_prompts("evaluation")[1]}])[:args.tokens])
    with torch.no_grad():
        h = model.run_layers(model.embed(ids), torch.arange(len(ids)), DenseKVCache(model.config, len(ids)),
                             0, args.layer)
        x = model.layers[args.layer].input_layernorm.normalize(h)
    lp, params = plan.layer(args.layer), CKKSParams.from_dict(plan.ckks)
    block = EncryptedAttentionLayer(model.layers[args.layer], model.rotary, lp, model.config, params,
                                    max_tokens=128)
    client = CKKSClient(params, sorted(block.rotation_steps))
    keys, bc = client.server_keys(), BlockClient.for_model(client, model.config, lp.approx.kind, lp.approx.squarings)
    ys, zs, _ = simulate_block(model.layers[args.layer], model.rotary, x, torch.arange(len(ids)), None, lp)
    ref = finish(ys, zs)
    print(f"layer {args.layer}, {len(ids)} tokens, N = {params.poly_modulus_degree}, chunk {block.packed_chunk}")
    caches = {}
    for procs in (int(c) for c in args.processes.split(",")):
        block.processes = procs
        split.clear()
        cache, cts = block.new_cache(), bc.encrypt_packed(x)
        c0, t0 = os.times(), time.perf_counter()
        out = block.prefill_packed(cache, cts, 0, len(ids), keys)
        took, cpu = time.perf_counter() - t0, sum(os.times()[:4]) - sum(c0[:4])
        err = (finish(*bc.decrypt_output(out)) - ref).abs().max().item()
        parts = ", ".join(f"{k.strip('_')} {v:.1f} s" for k, v in split.items()) if procs == 1 else "forked"
        print(f"packed, {procs} process(es): {took:.1f} s wall, {cpu:.1f} s CPU, load {os.getloadavg()[0]:.1f} "
              f"({took / len(ids):.2f} s/token; {parts}); "
              f"max error vs simulator {err:.2e}", flush=True)
        caches[procs] = cache
    counts = list(caches)
    cache = caches[counts[0]]
    for _ in range(args.decode_repeats if args.decode_context else 0):
        for procs in counts:            # alternated on one cache: the box's load drifts
            _decode_step(block, cache, bc, x, args.decode_context, procs, keys)
    block.processes = 1
    if args.token:
        t0 = time.perf_counter()
        out = block.prefill(block.new_cache(), bc.encrypt_input(x), 0, keys)
        took = time.perf_counter() - t0
        err = (finish(*bc.decrypt_output(out)) - ref).abs().max().item()
        print(f"token by token: {took:.1f} s ({took / len(ids):.2f} s/token); max error vs simulator {err:.2e}")
    return 0


def _decode_step(block, cache, bc, x, context: int, procs: int, keys) -> None:
    """One decode step at ``context`` (cache padded with copies of its blocks), timed with ``procs``."""
    import os
    import time

    b = cache.block_tokens
    n_blocks = -(-(context - 1) // b)
    cache.k_blocks = [cache.k_blocks[i % len(cache.k_blocks)] for i in range(n_blocks)]
    cache.v_blocks = [cache.v_blocks[i % len(cache.v_blocks)] for i in range(n_blocks)]
    cache.length = context - 1
    block.processes = procs
    ct = bc.encrypt_input(x[-1:])[0]
    c0, t0 = os.times(), time.perf_counter()
    block.forward(cache, ct, context - 1, keys)
    c1, wall = os.times(), time.perf_counter() - t0
    cpu = sum(c1[:4]) - sum(c0[:4])     # user + system, this process and its reaped children
    print(f"decode step at context {context}, {procs} process(es): {wall:.2f} s wall, {cpu:.2f} s CPU "
          f"(load {os.getloadavg()[0]:.1f})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
