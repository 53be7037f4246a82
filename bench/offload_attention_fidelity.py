"""Fidelity of the shipped 28-layer offload plan with some server layers wholly on real ciphertexts.

The plan: ``fhe/data/smollm2-135m-instruct.offload.json`` (layers 2-29 on the server, attention as linear
steps — ``softmax = client`` — and client-aided SiLU). Two runs over the same teacher-forced positions, each
against the plaintext model:

* the plan's simulator (:class:`fhe.offload_sim.OffloadSimulator`: client-aided parts are exact);
* the same with layers ``--layers`` (default 2) wholly through the encrypted steps, one position per
  ciphertext as on the wire: attention by :class:`fhe.offload_attention.EncryptedAttentionLinear` (attn_qkv,
  then RoPE, the client's clear K/V cache and the exact softmax, then attn_o) and the MLP by
  :class:`fhe.mlp.EncryptedMLP` (mlp_up, silu·up, mlp_down), all on SEAL at N = 8192 under one key set.
  The other server layers run as the simulator computes them (their client-aided parts are exact; only
  CKKS error would differ, and it is what the encrypted layers measure).

The corpus is ``bench/offload_fidelity.py``'s cache (held-out prompts with the plaintext model's greedy
answers)::

    flock /tmp/cipherlm-heavy.lock python bench/offload_attention_fidelity.py --cache /tmp/offload/fid_cache.pt
"""

from __future__ import annotations

import argparse
import time

import torch

from fhe.offload_sim import OffloadSimulator, fidelity


class EncryptedLayersSimulator(OffloadSimulator):
    """The simulator with some server layers' attention and MLP through the encrypted linear steps."""

    def __init__(self, model, offload, attention_blocks, mlp_blocks, att_half, mlp_half, keys) -> None:
        super().__init__(model, offload)
        self.att_blocks, self.mlp_blocks = attention_blocks, mlp_blocks
        self.att_half, self.mlp_half, self.keys = att_half, mlp_half, keys

    def _mlp(self, i: int, layer, x: torch.Tensor) -> torch.Tensor:
        if i not in self.mlp_blocks:
            return super()._mlp(i, layer, x)
        from fhe.linalg import replicate_input

        lay, gain, rows = self.mlp_half.layout, layer.post_attention_layernorm.weight.double(), []
        for xr in x.double():   # the block folds the gain into its weights: it takes x̂ = h / rms(h)
            ct = self.mlp_half.client.encrypt(replicate_input((xr / gain).numpy(), lay.slots, lay.up_periods[0]))
            act = self.mlp_half.activation(self.mlp_blocks[i].gate_up(ct, self.keys))
            rows.append(self.mlp_half.output(self.mlp_blocks[i].down(self.mlp_half.encrypt_activation(act),
                                                                      self.keys)))
        return torch.stack(rows).to(x.dtype)

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        from engine.model import DenseKVCache
        from fhe.offload_attention import ClientKV, run_client_aided

        m, n = self.model, len(ids)
        pos, cache = torch.arange(n), DenseKVCache(m.config, n)
        h = m.embed(torch.tensor(ids))
        with m.rotary.shared_tables(pos):
            for i, layer in enumerate(m.layers):
                if i in self.att_blocks:
                    a = run_client_aided(self.att_blocks[i], self.att_half, layer, m.rotary, h, pos, ClientKV(),
                                         self.keys).to(h.dtype)
                else:
                    a = layer.self_attn(layer.input_layernorm(h), pos, m.rotary, cache)
                h = h + a
                h = h + self._mlp(i, layer, layer.post_attention_layernorm(h))
        return m.logits(h)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", required=True, help="bench/offload_fidelity.py's corpus cache")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--layers", default="2", help="server layers run wholly on ciphertexts")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from engine.default_model import default_model_dir
    from engine.loader import load_model
    from fhe.backends.seal.keys import CKKSClient
    from fhe.mlp import MLP_PARAMS, EncryptedMLP, MLPClient
    from fhe.offload import LayerPlacement, OffloadPlan, default_offload_path
    from fhe.offload_attention import AttentionLinearClient, EncryptedAttentionLinear
    from fhe.offload_steps import offload_rotation_steps

    model = load_model(default_model_dir()).eval()
    cfg, enc_layers = model.config, sorted(int(x) for x in args.layers.split(","))
    off = OffloadPlan.load(default_offload_path())
    assert not off.approx_layers and set(enc_layers) <= set(off.server_attention) & set(off.server_mlp)
    plain = OffloadPlan(off.model_id, cfg.to_hf_dict(), tuple(LayerPlacement(i) for i in range(cfg.num_hidden_layers)))
    c = torch.load(args.cache)
    seqs, plens = c["seqs"][:args.prompts], c["plens"][:args.prompts]
    ref = [OffloadSimulator(model, plain).logits(s) for s in seqs]
    t0 = time.perf_counter()
    att = {i: EncryptedAttentionLinear(model.model.layers[i], cfg, MLP_PARAMS) for i in enc_layers}
    mlp = {i: EncryptedMLP(model.model.layers[i], MLP_PARAMS) for i in enc_layers}
    ckks = CKKSClient(MLP_PARAMS, offload_rotation_steps(cfg, MLP_PARAMS))   # one key set for both parts
    att_half = AttentionLinearClient(ckks, att[enc_layers[0]].layout, cfg.rms_norm_eps)
    mlp_half = MLPClient(ckks, mlp[enc_layers[0]].layout, cfg.rms_norm_eps)
    setup = time.perf_counter() - t0
    sim = fidelity(OffloadSimulator(model, off), seqs, plens, ref)
    t1 = time.perf_counter()
    enc = fidelity(EncryptedLayersSimulator(model, off, att, mlp, att_half, mlp_half, ckks.server_keys()),
                   seqs, plens, ref)
    took = time.perf_counter() - t1
    rows = sum(len(s) for s in seqs) * len(enc_layers)
    print(f"offload plan {off.content_hash[:12]} (server layers {off.server_attention[0]}-{off.server_attention[-1]}), "
          f"layers {enc_layers} on ciphertexts, the other server layers simulated; {args.prompts} prompts, "
          f"{sim['positions']} answer positions ({sum(len(s) for s in seqs)} positions through each encrypted "
          f"layer); setup {setup:.1f} s; encrypted run {took:.1f} s ({took / rows:.2f} s per position per layer)")
    print("| variant | positions | top-1 vs plaintext | mean KL | max KL |\n|---|---:|---:|---:|---:|")
    for name, f in (("simulator (client-aided: exact)", sim), (f"layers {enc_layers} on ciphertexts", enc)):
        print(f"| {name} | {f['positions']} | {f['top1']:.2%} | {f['kl']:.3g} | {f['kl_max']:.3g} |")


if __name__ == "__main__":
    main()
