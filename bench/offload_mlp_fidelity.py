"""Fidelity of an offload plan with its server MLPs computed on real ciphertexts (teacher-forced).

The plan: layers ``--layers`` (default 2,3) on the server, attention by the shipped sqexp score maps,
MLP client-aided. Two runs over the same teacher-forced positions, each against the plaintext model:

* the plan's simulator (:class:`fhe.offload_sim.OffloadSimulator`, exact SiLU, no CKKS error);
* the same with every server MLP through the encrypted block (:class:`fhe.mlp.EncryptedMLP` on SEAL at
  N = 8192 and :class:`fhe.mlp.MLPClient`: encrypt x̂, gate|up, decrypt, silu·up, encrypt, down, decrypt),
  one position at a time, exactly what the protocol's ``mlp_up`` / ``mlp_down`` steps compute.

The attention stays simulated (its encrypted-path fidelity is measured in docs/benchmarks.md, "Encrypted-path
fidelity of the default plan"). The corpus is ``bench/offload_fidelity.py``'s cache (held-out prompts with the
plaintext model's greedy answers)::

    flock /tmp/cipherlm-bench.lock python bench/offload_mlp_fidelity.py --cache /tmp/offload/fid_cache.pt --prompts 4
"""

from __future__ import annotations

import argparse
import time

import torch

from fhe.offload_sim import OffloadSimulator, fidelity


class EncryptedMLPSimulator(OffloadSimulator):
    """The simulator with the server MLPs on ciphertexts (one position per encryption, as on the wire)."""

    def __init__(self, model, offload, attention, blocks, half) -> None:
        super().__init__(model, offload, attention)
        self.blocks, self.half, self.keys = blocks, half, half.client.server_keys()

    def _mlp(self, i: int, layer, x: torch.Tensor) -> torch.Tensor:
        if i not in self.blocks:
            return super()._mlp(i, layer, x)
        gain = layer.post_attention_layernorm.weight.double()
        rows = []
        for xr in x.double():
            xhat = xr / gain          # the block folds the gain into its weights: it takes x̂ = h / rms(h)
            ct = self.half.client.encrypt(_replicated(xhat, self.half.layout, "up"))
            act = self.half.activation(self.blocks[i].gate_up(ct, self.keys))
            rows.append(self.half.output(self.blocks[i].down(self.half.encrypt_activation(act), self.keys)))
        return torch.stack(rows).to(x.dtype)


def _replicated(v: torch.Tensor, layout, which: str):
    from fhe.linalg import replicate_input

    return replicate_input(v.numpy(), layout.slots, layout.up_periods[0] if which == "up" else layout.down_period)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", required=True, help="bench/offload_fidelity.py's corpus cache")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--layers", default="2,3")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from engine.default_model import default_model_dir
    from engine.loader import load_model
    from fhe.backends.seal.keys import CKKSClient
    from fhe.mlp import MLP_PARAMS, EncryptedMLP, MLPClient
    from fhe.offload import SERVER, LayerPlacement, OffloadPlan
    from fhe.plan import Plan
    from server.private.feature import default_plan_path

    model = load_model(default_model_dir()).eval()
    cfg, server = model.config, {int(x) for x in args.layers.split(",")}
    full = Plan.load(default_plan_path())
    att = Plan(full.model_id, full.weights_sha256, tuple(lp for lp in full.layers if lp.index in server), full.ckks,
               "bench", full.calibration)
    off = OffloadPlan(full.model_id, cfg.to_hf_dict(),
                      tuple(LayerPlacement(i, SERVER, SERVER, "approx", "client") if i in server else LayerPlacement(i)
                            for i in range(cfg.num_hidden_layers)), att.content_hash)
    plain = OffloadPlan(full.model_id, cfg.to_hf_dict(), tuple(LayerPlacement(i) for i in range(cfg.num_hidden_layers)))
    c = torch.load(args.cache)
    seqs, plens = c["seqs"][:args.prompts], c["plens"][:args.prompts]
    ref = [OffloadSimulator(model, plain).logits(s) for s in seqs]
    t0 = time.perf_counter()
    blocks = {i: EncryptedMLP(model.model.layers[i], MLP_PARAMS) for i in sorted(server)}
    steps = set().union(*(b.rotation_steps for b in blocks.values()))
    half = MLPClient(CKKSClient(MLP_PARAMS, tuple(sorted(steps))), next(iter(blocks.values())).layout, cfg.rms_norm_eps)
    setup = time.perf_counter() - t0
    sim = fidelity(OffloadSimulator(model, off, att), seqs, plens, ref)
    t1 = time.perf_counter()
    enc = fidelity(EncryptedMLPSimulator(model, off, att, blocks, half), seqs, plens, ref)
    took = time.perf_counter() - t1
    rows = sum(len(s) for s in seqs) * len(server)
    print(f"server layers {sorted(server)}, {args.prompts} prompts, {sim['positions']} answer positions; "
          f"setup {setup:.1f} s; encrypted run {took:.1f} s ({took / rows:.2f} s per position per layer)")
    print("| variant | positions | top-1 vs plaintext | mean KL | max KL |\n|---|---:|---:|---:|---:|")
    for name, f in (("simulator (exact SiLU, no CKKS)", sim), ("server MLPs on ciphertexts", enc)):
        print(f"| {name} | {f['positions']} | {f['top1']:.2%} | {f['kl']:.3g} | {f['kl_max']:.3g} |")


if __name__ == "__main__":
    main()
