"""Plaintext simulator of the approximated encrypted attention block.

It computes exactly what the encrypted path computes, in the clear:

* server side (:func:`simulate_block`): input the client's RMS-normalized residual ``x̂ [T, hidden]``
  (no gain: the gain is folded into Wq/Wk/Wv), projections, RoPE, GQA scores
  ``s_hij = q_hi . k_hj / sqrt(D)``, unnormalized weights ``p = f_h(s)`` (:mod:`fhe.approx`), and per
  query head the numerator pushed through that head's slice of the output projection
  ``y_h = (sum_j p_hij v_j) Wo_h`` with ``Wo_h = o_proj.weight[:, hD:(h+1)D].T`` and the denominator
  ``z_h = sum_j p_hij``;
* client side (:func:`finish`): ``attn_out = sum_h y_h / z_h``.

The encrypted block is checked against :func:`simulate_block` (max abs error <= 1e-3), and
:class:`SimulatedBackend` runs a whole model with the plan's approximation in its encrypted layers and
exact attention elsewhere, so fidelity is cheap to measure.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

from engine.model import (
    DecoderLayer,
    DenseKVCache,
    LlamaForCausalLM,
    RotaryEmbedding,
    apply_rope,
    causal_attention,
    greedy_generate,
)
from fhe.approx import ScoreApprox, unnormalized_weights
from fhe.plan import LayerPlan, Plan


@dataclass(frozen=True)
class BlockWeights:
    """The server's weights of one attention block, RMSNorm gain folded into Wq/Wk/Wv.

    Shapes: wq [Hq*D, hidden], wk/wv [Hkv*D, hidden], bq [Hq*D] | None, bk/bv [Hkv*D] | None,
    wo [hidden, Hq*D] (o_proj.weight, applied per head as its column slice).
    """

    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    num_heads: int
    num_kv_heads: int
    head_dim: int


def block_weights(layer: DecoderLayer, layer_plan: LayerPlan | None = None,
                  dtype: torch.dtype = torch.float64) -> BlockWeights:
    """Server-side weights of ``layer`` (plan's adjusted weights if any), gain folded in, in ``dtype``."""
    attn = layer.self_attn
    adj = layer_plan.weights if layer_plan is not None else {}
    gain = layer.input_layernorm.weight.detach().to(dtype)

    def w(name: str) -> torch.Tensor:
        t = adj.get(f"{name}.weight", getattr(attn, name).weight)
        return t.detach().to(dtype)

    def b(name: str) -> torch.Tensor | None:
        t = adj.get(f"{name}.bias", getattr(attn, name).bias)
        return None if t is None else t.detach().to(dtype)

    return BlockWeights(w("q_proj") * gain, w("k_proj") * gain, w("v_proj") * gain, w("o_proj"),
                        b("q_proj"), b("k_proj"), b("v_proj"),
                        attn.num_heads, attn.num_kv_heads, attn.head_dim)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return x @ w.T if b is None else x @ w.T + b


def causal_mask(positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[Tq, Tk] bool, True where key j (at position j) lies in the future of the query's position."""
    return torch.arange(num_keys, device=positions.device)[None, :] > positions[:, None]


def project_qkv(bw: BlockWeights, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding):
    """x̂ [T, hidden] -> q [T, Hq, D], k/v [T, Hkv, D] (RoPE on q and k), in x's dtype."""
    t, d = x.shape[0], bw.head_dim
    q = _linear(x, bw.wq, bw.bq).view(t, bw.num_heads, d)
    k = _linear(x, bw.wk, bw.bk).view(t, bw.num_kv_heads, d)
    v = _linear(x, bw.wv, bw.bv).view(t, bw.num_kv_heads, d)
    cos, sin = rope.cos_sin(positions)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def gqa_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [Tq, Hq, D], k [Tk, Hkv, D] -> s [Hq, Tq, Tk] = q.k/sqrt(D), query head h on KV head h//g."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    kh = k.repeat_interleave(hq // hkv, dim=1)                     # [Tk, Hq, D]
    return torch.einsum("qhd,khd->hqk", q, kh) / math.sqrt(d)


def weighted_values(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p [Hq, Tq, Tk], v [Tk, Hkv, D] -> sum_j p_hij v_j as [Tq, Hq, D]."""
    hq, hkv = p.shape[0], v.shape[1]
    vh = v.repeat_interleave(hq // hkv, dim=1)                     # [Tk, Hq, D]
    return torch.einsum("hqk,khd->qhd", p, vh)


def numerator_denominator(p: torch.Tensor, v: torch.Tensor, wo: torch.Tensor):
    """p [Hq, Tq, Tk], v [Tk, Hkv, D], wo [hidden, Hq*D] -> y [Tq, Hq, hidden], z [Tq, Hq]."""
    hq, d = p.shape[0], v.shape[2]
    pv = weighted_values(p, v)                                     # [Tq, Hq, D]
    wo_h = wo.T.reshape(hq, d, wo.shape[0])                        # [Hq, D, hidden] = Wo_h per head
    y = torch.einsum("qhd,hdo->qho", pv, wo_h)
    return y, p.sum(-1).T.contiguous()


def simulate_block(layer: DecoderLayer, rope: RotaryEmbedding, x_normed: torch.Tensor,
                   positions: torch.Tensor, past_kv: tuple[torch.Tensor, torch.Tensor] | None,
                   layer_plan: LayerPlan, dtype: torch.dtype = torch.float64):
    """The server's side of one encrypted attention block, in the clear.

    Args:
        layer: the model's decoder layer (its gain and attention weights; adjusted ones from the plan win).
        rope: the model's rotary embedding.
        x_normed: [T, hidden] the client's RMS-normalized residual (without gain) for this step's tokens.
        positions: [T] their positions; keys 0..Tk-1 are the cached ones followed by these.
        past_kv: (k, v) [Tpast, Hkv, D] from earlier steps (RoPE'd k), or None.
        layer_plan: the layer's approximation (and adjusted weights).
        dtype: computation dtype (fp64 for checking the encrypted block).

    Returns:
        y [T, Hq, hidden], z [T, Hq], new_kv = (k, v) [Tpast+T, Hkv, D].
    """
    bw = block_weights(layer, layer_plan, dtype)
    q, k, v = project_qkv(bw, x_normed.to(dtype), positions, rope)
    if past_kv is not None:
        k, v = torch.cat([past_kv[0].to(dtype), k]), torch.cat([past_kv[1].to(dtype), v])
    p = unnormalized_weights(gqa_scores(q, k), layer_plan.approx, causal_mask(positions, k.shape[0]))
    y, z = numerator_denominator(p, v, bw.wo)
    return y, z, (k, v)


def finish(y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The client's side: y [T, Hq, hidden], z [T, Hq] -> attn_out [T, hidden] = sum_h y_h / z_h."""
    return (y / z[..., None]).sum(1)


def approx_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int,
                     approx: ScoreApprox) -> torch.Tensor:
    """Drop-in for ``causal_attention`` with ``p = f(s)`` and exact normalization: -> [Tq, Hq, D].

    q [Tq, Hq, D] at positions q_start.., k/v [Tk, Hkv, D] at 0..Tk-1. Differentiable (calibration
    uses it). ``o_proj`` of this equals :func:`finish` of :func:`simulate_block`.
    """
    positions = torch.arange(q_start, q_start + q.shape[0], device=q.device)
    qf, kf, vf = q.float(), k.float(), v.float()
    p = unnormalized_weights(gqa_scores(qf, kf), approx, causal_mask(positions, k.shape[0]))
    out = weighted_values(p, vf) / p.sum(-1).T[..., None]
    return out.to(q.dtype)


class SimulatedBackend:
    """A dense-cache AttentionBackend: the plan's approximation in its layers, exact attention elsewhere.

    Use with :func:`simulated_model` (which applies a plan's adjusted weights); call :meth:`advance`
    after each forward pass, like ``DenseKVCache``.
    """

    def __init__(self, model: LlamaForCausalLM, plan: Plan, max_len: int) -> None:
        cfg = model.config
        p = next(model.parameters())
        shape = (cfg.num_hidden_layers, max_len, cfg.num_key_value_heads, cfg.head_dim)
        self.k = torch.empty(shape, dtype=p.dtype, device=p.device)
        self.v = torch.empty(shape, dtype=p.dtype, device=p.device)
        self.approx = {lp.index: lp.approx for lp in plan.layers}
        self.max_len, self.length, self._pending = max_len, 0, 0

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
        t, start = q.shape[0], self.length
        if start + t > self.max_len:
            raise ValueError(f"sequence of {start + t} tokens exceeds the cache ({self.max_len})")
        self.k[layer, start:start + t], self.v[layer, start:start + t] = k, v
        self._pending = t
        kk, vv = self.k[layer, :start + t], self.v[layer, :start + t]
        if layer in self.approx:  # exact too: exp(s - rowmax) with the client-side division
            return approx_attention(q, kk, vv, start, self.approx[layer])
        return causal_attention(q, kk, vv, start)

    def advance(self) -> None:
        """Commit the tokens of the last forward pass."""
        self.length += self._pending
        self._pending = 0


def simulated_model(model: LlamaForCausalLM, plan: Plan) -> LlamaForCausalLM:
    """``model`` itself if the plan adjusts no weights, else a copy with the adjusted weights loaded."""
    if not any(lp.weights for lp in plan.layers):
        return model
    sim = copy.deepcopy(model)
    for lp in plan.layers:
        attn: nn.Module = sim.layers[lp.index].self_attn
        for name, t in lp.weights.items():
            mod_name, pname = name.rsplit(".", 1)
            getattr(getattr(attn, mod_name), pname).data.copy_(t)
    return sim


@torch.inference_mode()
def sequence_logits(model: LlamaForCausalLM, ids: list[int], plan: Plan | None) -> torch.Tensor:
    """Teacher-forced logits [T, vocab] of one sequence, exact (plan None) or simulated.

    With a plan, pass ``simulated_model(model, plan)`` as ``model``.
    """
    n = len(ids)
    backend = DenseKVCache(model.config, n) if plan is None else SimulatedBackend(model, plan, n)
    h = model(torch.tensor(ids), torch.arange(len(ids)), backend)
    return model.logits(h)


def simulated_greedy(model: LlamaForCausalLM, plan: Plan, prompt_ids: list[int], max_new_tokens: int,
                     stop_ids: set[int] | None = None) -> list[int]:
    """Greedy decoding with the plan simulated (pass the result of :func:`simulated_model`)."""
    backend = SimulatedBackend(model, plan, len(prompt_ids) + max_new_tokens)
    return greedy_generate(model, prompt_ids, max_new_tokens, stop_ids, backend=backend)


class BatchedBackend:
    """Several sequences in one flat batch, each with its own dense K/V cache (for batched greedy).

    ``plan`` None = exact attention everywhere; else the plan's maps in its layers, like
    :class:`SimulatedBackend`. Set :attr:`lengths` (new tokens per sequence, in batch order) before a
    forward pass; the caches grow by those tokens.
    """

    def __init__(self, num_seqs: int, plan: Plan | None = None) -> None:
        self.caches: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(num_seqs)]
        self.approx = {} if plan is None else {lp.index: lp.approx for lp in plan.layers}
        self.lengths: list[int] = []

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (sequences concatenated) -> [T, Hq, D]."""
        outs, off = [], 0
        for cache, n in zip(self.caches, self.lengths, strict=True):
            kk, vv = k[off:off + n], v[off:off + n]
            if layer in cache:
                kk, vv = torch.cat([cache[layer][0], kk]), torch.cat([cache[layer][1], vv])
            cache[layer] = (kk, vv)
            start = kk.shape[0] - n
            if layer in self.approx:
                outs.append(approx_attention(q[off:off + n], kk, vv, start, self.approx[layer]))
            else:
                outs.append(causal_attention(q[off:off + n], kk, vv, start))
            off += n
        return torch.cat(outs)


@torch.inference_mode()
def batched_greedy(model: LlamaForCausalLM, prompts: list[list[int]], max_new_tokens: int,
                   stop_ids: set[int] | None = None, plan: Plan | None = None) -> list[list[int]]:
    """Greedy answers to several prompts at once (exact, or with ``plan`` simulated).

    The projections and MLPs run on all sequences' tokens together (one weight pass per step instead of
    one per sequence); attention stays per sequence. Token-for-token the same as
    :func:`engine.model.greedy_generate` up to float rounding of the batched matmuls.
    """
    backend = BatchedBackend(len(prompts), plan)
    outs: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    ids = [list(p) for p in prompts]
    for _ in range(max_new_tokens):
        backend.lengths = [len(ids[i]) for i in live]
        pos = torch.cat([torch.arange(len(prompts[i]) + len(outs[i]) - len(ids[i]),
                                      len(prompts[i]) + len(outs[i])) for i in live])
        h = model(torch.tensor([t for i in live for t in ids[i]]), pos, backend)
        last = torch.tensor(backend.lengths).cumsum(0) - 1
        nxt = model.logits(h[last]).argmax(-1).tolist()
        keep = []
        for j, (i, tok) in enumerate(zip(live, nxt, strict=True)):
            outs[i].append(tok)
            ids[i] = [tok]
            if not (stop_ids and tok in stop_ids):
                keep.append(j)
        backend.caches = [backend.caches[j] for j in keep]
        live = [live[j] for j in keep]
        if not live:
            break
    return outs
