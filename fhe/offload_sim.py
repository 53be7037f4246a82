"""Plaintext simulator of a whole offload plan, for fidelity.

It runs the model as the offload protocol computes it, in the clear: the client's layers exactly; each
server attention block with its plan's treatment of the softmax (the attention plan's calibrated score map
with exact normalization, or exact when client-aided: attention as linear steps, q·k, softmax and p·v on
the client); each server MLP with the exact SiLU (client-aided) or the plan's polynomial. RMSNorms, the
residual stream, the final norm and the head are the client's and exact. ``noise`` adds Gaussian noise of
that standard deviation to every value the server returns (the attention output; for attention as linear
steps also q, k and v, which the client decrypts before its softmax; the gate/up pre-activations, the down
projection): a stand-in for CKKS error at a measured magnitude, so the simulator can also show how much
noise the plan tolerates.

:func:`collect_gates` records each layer's gate pre-activations on calibration text (to fit
:func:`fhe.silu.fit_silu`); :func:`fidelity` compares teacher-forced logits against the plaintext model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model import DenseKVCache, LlamaForCausalLM
from fhe.offload import SERVER, OffloadPlan
from fhe.plan import Plan
from fhe.silu import SiluPoly, fit_silu
from fhe.simulator import SimulatedBackend, simulated_model


@dataclass
class _Noise:
    std: float
    gen: torch.Generator | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.std:
            return x
        return x + torch.randn(x.shape, generator=self.gen, dtype=x.dtype) * self.std


def _attention_plan_for(offload: OffloadPlan, attention: Plan | None) -> Plan:
    """The attention plan restricted to the layers whose softmax the offload plan approximates."""
    offload.check_attention_plan(attention)
    keep = set(offload.approx_layers)
    if attention is None:
        return Plan("", "", ())
    return Plan(attention.model_id, attention.weights_sha256,
                tuple(lp for lp in attention.layers if lp.index in keep), attention.ckks)


class OffloadSimulator:
    """Teacher-forced logits of one sequence under an offload plan.

    Args:
        model: the plaintext model.
        offload: the placement plan.
        attention: the attention plan it names (None if no layer approximates its softmax).
        noise: std of the Gaussian noise on every server output (0: none).
        seed: seed of that noise.
    """

    def __init__(self, model: LlamaForCausalLM, offload: OffloadPlan, attention: Plan | None = None,
                 noise: float = 0.0, seed: int = 0) -> None:
        if offload.model_config.to_hf_dict() != model.config.to_hf_dict():
            raise ValueError("the offload plan was made for another model shape")
        self.plan = offload
        self.attention = _attention_plan_for(offload, attention)
        self.model = simulated_model(model, self.attention)
        self.noise = _Noise(noise, torch.Generator().manual_seed(seed) if noise else None)

    def _mlp(self, i: int, layer, x: torch.Tensor) -> torch.Tensor:
        mlp, place = layer.mlp, self.plan.layers[i]
        g, u = mlp.gate_proj(x), mlp.up_proj(x)
        if place.mlp != SERVER:
            return mlp.down_proj(F.silu(g) * u)
        g, u = self.noise(g), self.noise(u)
        act = self.plan.silu[i](g) if place.silu == "poly" else F.silu(g)
        return self.noise(mlp.down_proj(act * u))

    def _qkv_noise(self) -> list:
        """Forward hooks adding the server's noise to q, k, v of every layer whose attention runs as linear
        steps (the ``attn_qkv`` answer); removed after each pass (the model may be the caller's)."""
        if not self.noise.std:
            return []
        linear = [p.index for p in self.plan.layers if p.attention == SERVER and p.softmax == "client"]
        return [getattr(self.model.layers[i].self_attn, name).register_forward_hook(
                    lambda _m, _inp, y: self.noise(y))
                for i in linear for name in ("q_proj", "k_proj", "v_proj")]

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """ids -> logits [T, vocab] (fp32)."""
        hooks = self._qkv_noise()
        try:
            return self._logits(ids)
        finally:
            for hk in hooks:
                hk.remove()

    def _logits(self, ids: list[int]) -> torch.Tensor:
        m, n = self.model, len(ids)
        pos = torch.arange(n)
        backend = SimulatedBackend(m, self.attention, n) if self.attention.layers else DenseKVCache(m.config, n)
        h = m.embed(torch.tensor(ids))
        with m.rotary.shared_tables(pos):
            for i, layer in enumerate(m.layers):
                a = layer.self_attn(layer.input_layernorm(h), pos, m.rotary, backend)
                h = h + (self.noise(a) if self.plan.layers[i].attention == SERVER else a)
                h = h + self._mlp(i, layer, layer.post_attention_layernorm(h))
        return m.logits(h)


@torch.inference_mode()
def collect_gates(model: LlamaForCausalLM, seqs: list[list[int]], layers: tuple[int, ...],
                  max_per_layer: int = 200_000) -> dict[int, torch.Tensor]:
    """Exact passes; per listed layer, a sample of its gate pre-activations ``W_gate x`` (flat)."""
    out: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    hooks = [model.layers[i].mlp.gate_proj.register_forward_hook(
        lambda _m, _inp, y, i=i: out[i].append(y.detach().flatten().float())) for i in layers]
    try:
        for ids in seqs:
            model(torch.tensor(ids), torch.arange(len(ids)), DenseKVCache(model.config, len(ids)))
    finally:
        for hk in hooks:
            hk.remove()
    gen = torch.Generator().manual_seed(0)
    res = {}
    for i, parts in out.items():
        x = torch.cat(parts)
        # keep the extremes (they set the range) and a random sample of the rest
        idx = torch.randperm(x.numel(), generator=gen)[:max_per_layer]
        res[i] = torch.cat([x[idx], x.min()[None], x.max()[None]])
    return res


def fit_silu_polys(model: LlamaForCausalLM, seqs: list[list[int]], layers: tuple[int, ...], degree: int = 15,
                   margin: float = 1.1) -> tuple[dict[int, SiluPoly], dict[int, float]]:
    """One calibrated SiLU polynomial per layer, fitted on its gate pre-activations over ``seqs``, and its
    max |p(g) - silu(g)| on those samples (a layer with rare large gates fits badly: keep it client-aided)."""
    gates = collect_gates(model, seqs, layers)
    polys = {i: fit_silu(gates[i], degree, margin) for i in layers}
    errors = {i: float((p(gates[i]) - F.silu(gates[i])).abs().max()) for i, p in polys.items()}
    return polys, errors


def kl_rows(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """KL(ref || got) per row of logits [T, vocab]."""
    lp_ref, lp_got = ref.double().log_softmax(-1), got.double().log_softmax(-1)
    return (lp_ref.exp() * (lp_ref - lp_got)).sum(-1)


def fidelity(sim: OffloadSimulator, seqs: list[list[int]], prompt_lens: list[int],
             reference: list[torch.Tensor]) -> dict:
    """Top-1 agreement and KL vs ``reference`` logits over every answer position (teacher-forced)."""
    agree = total = 0
    kls = []
    for ids, plen, ref in zip(seqs, prompt_lens, reference, strict=True):
        rows = slice(plen - 1, len(ids) - 1)
        got = sim.logits(ids)[rows]
        agree += int((got.argmax(-1) == ref[rows].argmax(-1)).sum())
        total += got.shape[0]
        kls.append(kl_rows(ref[rows], got))
    kl = torch.cat(kls)
    return {"positions": total, "top1": agree / total, "kl": float(kl.mean()), "kl_max": float(kl.max())}


__all__ = ["OffloadSimulator", "collect_gates", "fidelity", "fit_silu_polys", "kl_rows"]
