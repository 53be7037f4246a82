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

With ``--fused`` (fuse17) the encrypted layers run the fused plan's steps instead
(:mod:`fhe.offload_fused`): ``attn_qkv`` of the first, ``o_up`` of each (attn_o + mlp_up on ``[u; x]``, the
unnormalized residual), ``down_qkv`` between two (mlp_down + the next layer's attn_qkv on ``[a; x']``) and
``mlp_down`` of the last, the client scaling each kept half by ``rsqrt(mean(x²) + eps)`` of the residual it
holds, as the SDK does. ``--chunked`` runs every step in the chunk layout of a prefill step (8 positions per
chunk, :mod:`fhe.interleaved`; ~2.5x cheaper per position than one ciphertext per position).

The corpus is ``bench/offload_fidelity.py``'s cache (held-out prompts with the plaintext model's greedy
answers; made here, without its gate samples, where the file is absent)::

    flock /tmp/cipherlm-heavy.lock python bench/offload_attention_fidelity.py --cache /tmp/offload/fid_cache.pt
    flock /tmp/cipherlm-heavy.lock python bench/offload_attention_fidelity.py --cache /tmp/offload/fid_cache.pt \
        --layers 2,3 --fused --chunked
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


class FusedLayersSimulator(OffloadSimulator):
    """The simulator with consecutive server layers through the fused steps on ciphertexts (the SDK's order:
    ``attn_qkv``, then per layer ``o_up`` and ``down_qkv`` / ``mlp_down``). ``chunked``: every step in the
    chunk layout (8 positions per chunk), else one ciphertext per position."""

    def __init__(self, model, offload, att_blocks, mlp_blocks, fused_blocks, ckks, keys, chunked: bool) -> None:
        super().__init__(model, offload)
        self.att_blocks, self.mlp_blocks, self.fused_blocks = att_blocks, mlp_blocks, fused_blocks
        self.ckks, self.keys, self.chunked = ckks, keys, chunked
        self.eps = model.config.rms_norm_eps
        self.four: set[int] = set()   # layers run as the four steps (chunk layout) instead

    def _step(self, block, part: str, xs: torch.Tensor, one) -> torch.Tensor:
        """xs [T, n_in] through ``part`` of ``block`` -> y [T, n_out] (float64); ``one``: the one-position
        (pack, run, unpack) of the part."""
        import numpy as np

        xs = xs.double().numpy()
        if self.chunked:
            sh, out = block.chunks.shapes[part], []
            for c in range(0, xs.shape[0], sh.positions):
                cts = [self.ckks.encrypt(v) for v in sh.pack(xs[c:c + sh.positions])]
                res = block.chunk(part, cts, self.keys)
                out.append(sh.unpack([self.ckks.decrypt(r) for r in res], min(sh.positions, xs.shape[0] - c)))
            return torch.from_numpy(np.concatenate(out))
        pack, run, unpack = one
        return torch.from_numpy(np.stack([unpack([self.ckks.decrypt(r) for r in run(self.ckks.encrypt(pack(x)),
                                                                                         self.keys)]) for x in xs]))

    def _rms(self, h: torch.Tensor) -> torch.Tensor:
        x = h.double()
        return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def _layer(self, i: int, h: torch.Tensor, pos, kv, pending):
        """One fused server layer: h [T, hidden] -> (h after it, the next layer's unnormalized [q; k; v] or None)."""
        import torch.nn.functional as F

        from fhe.linalg import replicate_input

        m, hidden = self.model, h.shape[-1]
        if pending is None:
            blk = self.att_blocks[i]
            lay = blk.layout
            qkv = self._step(blk, "attn_qkv", h.double() * self._rms(h),
                             (lambda x: replicate_input(x, lay.slots, lay.qkv_period), lambda c, k: [blk.qkv(c, k)],
                              lambda v: v[0][lay.qkv_slots]))
        else:
            qkv = pending * self._rms(h)
        from fhe.offload_attention import AttentionLinearClient

        q, k, v = AttentionLinearClient(None, self.att_layout, self.eps).split_rows(qkv)
        u = kv.attend(m.rotary(q, pos), m.rotary(k, pos), v).reshape(h.shape[0], -1)
        if i not in self.fused_blocks:   # the four steps (in the chunk layout): attn_o, mlp_up, mlp_down
            h = h + self._step(self.att_blocks[i], "attn_o", u, None).to(h.dtype)
            gu = self._step(self.mlp_blocks[i], "mlp_up", h.double() * self._rms(h), None)
            inter = gu.shape[-1] // 2
            a = F.silu(gu[:, :inter]) * gu[:, inter:]
            return h + self._step(self.mlp_blocks[i], "mlp_down", a, None).to(h.dtype), None
        fb = self.fused_blocks[i]

        def one(part):
            lay = fb.layouts[part]
            return lay.pack, (lambda c, k: fb.step(part, c, k)), lay.unpack

        y = self._step(fb, "o_up", torch.cat([u.double(), h.double()], -1), one("o_up"))
        h = h + y[:, :hidden].to(h.dtype)
        gu = y[:, hidden:] * self._rms(h)
        inter = gu.shape[-1] // 2
        a = F.silu(gu[:, :inter]) * gu[:, inter:]
        if "down_qkv" in fb.layouts:
            y = self._step(fb, "down_qkv", torch.cat([a, h.double()], -1), one("down_qkv"))
            return h + y[:, :hidden].to(h.dtype), y[:, hidden:]
        blk = self.mlp_blocks[i]
        lay = blk.layout
        d = self._step(blk, "mlp_down", a, (lambda x: replicate_input(x, lay.slots, lay.down_period),
                                            lambda c, k: [blk.down(c, k)], lambda v: v[0][lay.down_slots]))
        return h + d.to(h.dtype), None

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        from engine.model import DenseKVCache
        from fhe.offload_attention import ClientKV

        m, n = self.model, len(ids)
        pos, cache = torch.arange(n), DenseKVCache(m.config, n)
        h, pending = m.embed(torch.tensor(ids)), None
        with m.rotary.shared_tables(pos):
            for i, layer in enumerate(m.layers):
                if i in self.fused_blocks or i in self.four:
                    h, pending = self._layer(i, h, pos, ClientKV(), pending)
                    continue
                h = h + layer.self_attn(layer.input_layernorm(h), pos, m.rotary, cache)
                h = h + self._mlp(i, layer, layer.post_attention_layernorm(h))
        return m.logits(h)


def _corpus(path: str, prompts: int):
    """(sequences, prompt lengths): ``bench/offload_fidelity.py``'s cache, or made here (and kept) where absent."""
    from pathlib import Path

    if Path(path).exists():
        c = torch.load(path)
        return c["seqs"][:prompts], c["plens"][:prompts]
    from fhe.calibrate import chat_corpus, load_prompts
    from server.cli_fhe import _load_model_and_tokenizer

    _, model, tok = _load_model_and_tokenizer("default")
    texts = load_prompts("evaluation")[:prompts]
    seqs = chat_corpus(model, tok, texts, 24)
    plens = [len(tok.apply_chat_template([{"role": "user", "content": p}])) for p in texts]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"seqs": seqs, "plens": plens}, path)
    return seqs, plens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", required=True, help="bench/offload_fidelity.py's corpus cache")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--layers", default="2", help="server layers run wholly on ciphertexts")
    ap.add_argument("--fused", action="store_true", help="the fused plan's steps (consecutive --layers)")
    ap.add_argument("--chunked", action="store_true", help="every step in the chunk layout (8 positions a chunk)")
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
    seqs, plens = _corpus(args.cache, args.prompts)
    ref = [OffloadSimulator(model, plain).logits(s) for s in seqs]
    t0 = time.perf_counter()
    ckks = CKKSClient(MLP_PARAMS, offload_rotation_steps(cfg, MLP_PARAMS, fused=args.fused))   # one key set
    if args.fused:
        enc_sim = _fused_sim(model, off, enc_layers, ckks, args.chunked)
    else:
        att = {i: EncryptedAttentionLinear(model.model.layers[i], cfg, MLP_PARAMS) for i in enc_layers}
        mlp = {i: EncryptedMLP(model.model.layers[i], MLP_PARAMS) for i in enc_layers}
        att_half = AttentionLinearClient(ckks, att[enc_layers[0]].layout, cfg.rms_norm_eps)
        mlp_half = MLPClient(ckks, mlp[enc_layers[0]].layout, cfg.rms_norm_eps)
        enc_sim = (_chunked_sim(model, off, att, mlp, ckks) if args.chunked else
                   EncryptedLayersSimulator(model, off, att, mlp, att_half, mlp_half, ckks.server_keys()))
    setup = time.perf_counter() - t0
    sim = fidelity(OffloadSimulator(model, off), seqs, plens, ref)
    t1 = time.perf_counter()
    enc = fidelity(enc_sim, seqs, plens, ref)
    took = time.perf_counter() - t1
    rows = sum(len(s) for s in seqs) * len(enc_layers)
    print(f"offload plan {off.content_hash[:12]} (server layers {off.server_attention[0]}-{off.server_attention[-1]}), "
          f"layers {enc_layers} on ciphertexts, the other server layers simulated; {args.prompts} prompts, "
          f"{sim['positions']} answer positions ({sum(len(s) for s in seqs)} positions through each encrypted "
          f"layer); setup {setup:.1f} s; encrypted run {took:.1f} s ({took / rows:.2f} s per position per layer)")
    how = ("fused steps" if args.fused else "four steps") + (", chunk layout" if args.chunked else ", one position")
    print("| variant | positions | top-1 vs plaintext | mean KL | max KL |\n|---|---:|---:|---:|---:|")
    for name, f in (("simulator (client-aided: exact)", sim), (f"layers {enc_layers} on ciphertexts ({how})", enc)):
        print(f"| {name} | {f['positions']} | {f['top1']:.2%} | {f['kl']:.3g} | {f['kl_max']:.3g} |")


def _fused_sim(model, off, layers, ckks, chunked: bool) -> FusedLayersSimulator:
    """The fused steps' server blocks of consecutive ``layers`` (as the worker builds them) in a simulator."""
    from fhe.mlp import MLP_PARAMS, EncryptedMLP
    from fhe.offload_attention import EncryptedAttentionLinear, attention_geometry
    from fhe.offload_fused import EncryptedFused, fused_step_order, fused_weights

    ls, order = model.model.layers, fused_step_order(layers)
    att = {i: EncryptedAttentionLinear(ls[i], model.config, MLP_PARAMS, chunks=chunked)
           for i, p in order if p == "attn_qkv"}
    mlp = {i: EncryptedMLP(ls[i], MLP_PARAMS, chunks=chunked) for i, p in order if p == "mlp_down"}
    parts: dict[int, list[str]] = {}
    for i, p in order:
        if p in ("o_up", "down_qkv"):
            parts.setdefault(i, []).append(p)
    fused = {i: EncryptedFused({p: fused_weights(ls[i], p, ls[i + 1] if p == "down_qkv" else None) for p in ps},
                               MLP_PARAMS, chunks=chunked) for i, ps in parts.items()}
    sim = FusedLayersSimulator(model, off, att, mlp, fused, ckks, ckks.server_keys(), chunked)
    sim.att_layout = attention_geometry(model.config, MLP_PARAMS)[0]
    return sim


def _chunked_sim(model, off, att, mlp, ckks) -> FusedLayersSimulator:
    from fhe.mlp import MLP_PARAMS

    """The four-step protocol with every step in the chunk layout, through :class:`FusedLayersSimulator`'s loop."""
    from fhe.offload_attention import attention_geometry

    sim = FusedLayersSimulator(model, off, att, mlp, {}, ckks, ckks.server_keys(), True)
    sim.four, sim.att_layout = set(att), attention_geometry(model.config, MLP_PARAMS)[0]
    return sim


if __name__ == "__main__":
    main()
