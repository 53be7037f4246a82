"""Client-aided attention as linear steps: the server runs the projections, the client the softmax.

The hybrid design of Concrete ML applied to a Llama-family attention block: every linear layer on the
server (on ciphertexts, with the weights it never ships), every non-linearity on the client (which holds
the residual stream and, here, this layer's K/V cache in the clear: it is the client's own data).

1. client: ``x̂ = h / rms(h)`` (no gain), replicated with period ``P1`` over all slots, encrypted;
2. server (:meth:`EncryptedAttentionLinear.qkv`, part ``attn_qkv``): ``[Wq; Wk; Wv] diag(g) x̂`` (+ the
   biases of models that have them) by one hybrid BSGS product (:mod:`fhe.linalg`, one level): for
   SmolLM2 960 outputs of 576 inputs, in one ciphertext at ``hybrid_slots(S, P1, c, 960)`` (q, then k,
   then v, each head's D values contiguous);
3. client: decrypts, applies RoPE to q and k, appends k, v to its cache, computes the exact causal GQA
   softmax attention, encrypts the per-head mixture ``u`` [Hq * D] replicated with period ``P2``;
4. server (:meth:`EncryptedAttentionLinear.o`, part ``attn_o``): ``Wo u`` (one level); the client
   decrypts and adds it to ``h``.

Each half has depth 1, so it runs at the MLP's parameters (:data:`fhe.mlp.MLP_PARAMS`, N = 8192) under
the same small key set: a server layer is four stateless linear steps (``attn_qkv``, ``attn_o``,
``mlp_up``, ``mlp_down``), with no encrypted KV cache and no score map. The price is what the client
sees: q, k, v of every position of every server layer (docs/threat-model.md). Everything goes through
:class:`fhe.evaluator.Evaluator`; nothing here names a CKKS library.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from engine.config import ModelConfig
from engine.model import DecoderLayer, causal_attention
from fhe.errors import ShapeError
from fhe.evaluator import Ciphertext, EvalKeys, Evaluator, KeyHolder, check_fresh
from fhe.interleaved import ChunkProducts, chunk_rotation_steps, require_chunks
from fhe.linalg import EncodedMatvec, HybridMatvec, replicate_input
from fhe.mlp import MLP_PARAMS, _matvec, linear_step_evaluator
from fhe.params import CKKSParams

ATTENTION_PARTS = ("attn_qkv", "attn_o")
@dataclass(frozen=True)
class AttentionLinearWeights:
    """The server's weights of one attention block, float64; the input RMSNorm gain folded into the
    q/k/v rows. Shapes: qkv [(Hq + 2 Hkv) D, hidden], bias [(Hq + 2 Hkv) D] or None, o [hidden, Hq D]."""

    qkv: np.ndarray
    bias: np.ndarray | None
    o: np.ndarray

    @classmethod
    def of(cls, layer: DecoderLayer) -> AttentionLinearWeights:
        gain = layer.input_layernorm.weight.detach().double().numpy()
        att = layer.self_attn
        projs = (att.q_proj, att.k_proj, att.v_proj)
        qkv = np.concatenate([p.weight.detach().double().numpy() for p in projs]) * gain
        bias = (np.concatenate([p.bias.detach().double().numpy() for p in projs])
                if att.q_proj.bias is not None else None)
        return cls(qkv, bias, att.o_proj.weight.detach().double().numpy())


@dataclass(frozen=True)
class AttentionLinearLayout:
    """Where each value of the two steps sits (shared by client and server; built from shapes only)."""

    slots: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_period: int
    qkv_slots: np.ndarray        # [(Hq + 2 Hkv) D]: q, k, v outputs, in that order
    o_period: int
    o_slots: np.ndarray          # [hidden]

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


def _heads(cfg: ModelConfig) -> tuple[int, int, int, int]:
    return cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim


def _layout(slots: int, heads: tuple[int, int, int, int], qkv: HybridMatvec, o: HybridMatvec
            ) -> AttentionLinearLayout:
    return AttentionLinearLayout(slots, *heads, qkv.period, qkv.out_slots, o.period, o.out_slots)


def _steps(slots: int, *mvs: HybridMatvec) -> set[int]:
    steps: set[int] = set()
    for m in mvs:
        steps |= m.rotation_steps
    return {s % slots for s in steps} - {0}


class EncryptedAttentionLinear:
    """Server side of one attention block as two linear steps (plaintext weights, public keys only).

    Args:
        layer: the model's decoder layer (its q/k/v/o projections and input norm gain).
        cfg: the model's config (head counts).
        params: CKKS parameters (default :data:`fhe.mlp.MLP_PARAMS`); need depth >= 1.
        evaluator: the backend that evaluates (default: the default backend for ``params``).
    """

    def __init__(self, layer: DecoderLayer, cfg: ModelConfig, params: CKKSParams = MLP_PARAMS, *,
                 evaluator: Evaluator | None = None, chunks: bool = True) -> None:
        self.ev = linear_step_evaluator(params, evaluator, "an attention linear step")
        w = AttentionLinearWeights.of(layer)
        slots = self.ev.slots
        self.matvec_qkv, self.matvec_o = _matvec(slots, w.qkv), _matvec(slots, w.o)
        self.layout = _layout(slots, _heads(cfg), self.matvec_qkv, self.matvec_o)
        top = self.ev.top
        self._enc_qkv: EncodedMatvec = self.matvec_qkv.encode(self.ev, top)
        self._enc_o: EncodedMatvec = self.matvec_o.encode(self.ev, top)
        self._bias = w.bias
        self._bias_pt = None   # encoded on first use, at the product's output level and scale
        # a step of several positions (prefill chunk, verify step): the position-interleaved chunk layout
        self.chunks = (ChunkProducts(self.ev, {"attn_qkv": w.qkv, "attn_o": w.o},
                                     {"attn_qkv": w.bias} if w.bias is not None else None) if chunks else None)

    @property
    def rotation_steps(self) -> set[int]:
        """Galois keys both steps need, one position or a chunk (the client generates exactly these)."""
        return _steps(self.ev.slots, self.matvec_qkv, self.matvec_o) | chunk_rotation_steps(self.chunks)

    def chunk(self, part: str, cts: list[Ciphertext], keys: EvalKeys) -> list[Ciphertext]:
        """A multi-position ``attn_qkv`` (+ bias) or ``attn_o`` step in the chunk layout
        (:mod:`fhe.interleaved`): T fresh ciphertexts per chunk in, G per chunk out, at level 1."""
        return require_chunks(self.chunks)(part, cts, keys)

    def qkv(self, ct: Ciphertext, keys: EvalKeys) -> Ciphertext:
        """Fresh replicated x̂ -> ``[q; k; v]`` (+ bias) at level 1 (the smallest download)."""
        check_fresh(self.ev, keys, ct)
        out = self._enc_qkv(self.ev, ct, keys)
        if self._bias is not None:
            if self._bias_pt is None:
                vals = np.zeros(self.ev.slots)
                vals[self.layout.qkv_slots] = self._bias
                self._bias_pt = self.ev.encode(vals, self.ev.level(out), self.ev.scale_of(out))
            out = self.ev.add_plain(out, self._bias_pt)
        return self.ev.mod_switch(out, 1)

    def o(self, ct: Ciphertext, keys: EvalKeys) -> Ciphertext:
        """Fresh replicated mixture u [Hq D] -> ``Wo u`` at level 1."""
        check_fresh(self.ev, keys, ct)
        return self.ev.mod_switch(self._enc_o(self.ev, ct, keys), 1)


@functools.lru_cache(maxsize=8)
def _geometry(slots: int, heads: tuple[int, int, int, int]) -> tuple[AttentionLinearLayout, tuple[int, ...]]:
    hidden, hq, hkv, d = heads
    wq, wo = np.zeros(((hq + 2 * hkv) * d, hidden)), np.zeros((hidden, hq * d))
    mvs = (_matvec(slots, wq), _matvec(slots, wo))
    return _layout(slots, heads, *mvs), tuple(sorted(_steps(slots, *mvs)))


def attention_geometry(cfg: ModelConfig, params: CKKSParams = MLP_PARAMS
                       ) -> tuple[AttentionLinearLayout, tuple[int, ...]]:
    """(layout, Galois steps) of the attention linear steps of a model of shape ``cfg``, from shapes only:
    equal to :class:`EncryptedAttentionLinear`'s for any weights of that shape."""
    return _geometry(params.poly_modulus_degree // 2, _heads(cfg))


@dataclass
class AttentionLinearClient:
    """Client side of the attention linear steps: normalization, layouts, decryption.

    RoPE and the softmax attention itself run on the client's own cache (the SDK's dense K/V cache, or
    :func:`run_client_aided` in process); this class only moves values in and out of ciphertexts.
    """

    client: KeyHolder
    layout: AttentionLinearLayout
    eps: float

    def input_rows(self, h: torch.Tensor) -> list[np.ndarray]:
        """Residual h [T, hidden] -> the RMS-normalized (no gain, float64) replicated inputs, one per position."""
        _check(h, self.layout.hidden)
        x = h.double()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return [replicate_input(r, self.layout.slots, self.layout.qkv_period) for r in x.numpy()]

    def mixture_rows(self, u: torch.Tensor) -> list[np.ndarray]:
        """Mixture u [T, Hq D] -> the replicated inputs of the output projection, one per position."""
        _check(u, self.layout.q_dim)
        return [replicate_input(r, self.layout.slots, self.layout.o_period) for r in u.double().numpy()]

    def split_qkv(self, values: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decrypted ``attn_qkv`` answers (one slot vector per position) -> q [T, Hq, D], k, v [T, Hkv, D]
        (float64, before RoPE)."""
        return self.split_rows(torch.from_numpy(np.stack([v[self.layout.qkv_slots] for v in values])))

    def split_rows(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[q; k; v]`` rows [T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k, v [T, Hkv, D]."""
        lay = self.layout
        q, k, v = flat.split([lay.q_dim, lay.kv_dim, lay.kv_dim], dim=-1)
        t = flat.shape[0]
        return (q.reshape(t, lay.num_heads, lay.head_dim), k.reshape(t, lay.num_kv_heads, lay.head_dim),
                v.reshape(t, lay.num_kv_heads, lay.head_dim))

    def output(self, values: list[np.ndarray]) -> torch.Tensor:
        """Decrypted ``attn_o`` answers (one per position) -> the attention output [T, hidden] (float64): add
        it to h."""
        return torch.from_numpy(np.stack([v[self.layout.o_slots] for v in values]))

    def encrypt(self, rows: list[np.ndarray]) -> list[Ciphertext]:
        return [self.client.encrypt(r) for r in rows]

    def decrypt(self, cts: list[Ciphertext]) -> list[np.ndarray]:
        return [self.client.decrypt(c) for c in cts]


def _check(v: torch.Tensor, n: int) -> None:
    if v.ndim != 2 or v.shape[1] != n:
        raise ShapeError(f"expected [T, {n}] values, got shape {tuple(v.shape)}")
    if not torch.isfinite(v).all():
        raise ShapeError("cannot encrypt NaN/inf")


@dataclass
class ClientKV:
    """The client's clear K/V cache of one layer (after RoPE): k, v [T, Hkv, D], float64."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append k, v; the exact causal GQA attention of q [T, Hq, D] over the whole cache."""
        start = 0 if self.k is None else self.k.shape[0]
        self.k = k if self.k is None else torch.cat([self.k, k])
        self.v = v if self.v is None else torch.cat([self.v, v])
        return causal_attention(q.double(), self.k.double(), self.v.double(), start)


def run_client_aided(server: EncryptedAttentionLinear, client: AttentionLinearClient, layer: DecoderLayer,
                     rope, h: torch.Tensor, positions: torch.Tensor, cache: ClientKV, keys: EvalKeys
                     ) -> torch.Tensor:
    """A chunk of positions through the two steps in process (tests, benchmarks), one ciphertext per position
    (the service's chunk layout is :meth:`EncryptedAttentionLinear.chunk`): h [T, hidden] -> the attention
    output [T, hidden] (float64); ``rope`` is the model's :class:`RotaryEmbedding`."""
    q, k, v = client.split_qkv(client.decrypt([server.qkv(ct, keys)
                                               for ct in client.encrypt(client.input_rows(h))]))
    u = cache.attend(rope(q, positions), rope(k, positions), v).reshape(h.shape[0], -1)
    return client.output(client.decrypt([server.o(ct, keys) for ct in client.encrypt(client.mixture_rows(u))]))


__all__ = ["ATTENTION_PARTS", "AttentionLinearClient", "AttentionLinearLayout", "AttentionLinearWeights", "ClientKV",
           "EncryptedAttentionLinear", "attention_geometry", "run_client_aided"]
