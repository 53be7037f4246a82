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
from fhe.linalg import EncodedMatvec, HybridMatvec, hybrid_slots, pack_inputs, pick_fold, replicate_input
from fhe.mlp import MLP_PARAMS, _matvec, linear_step_evaluator
from fhe.params import CKKSParams

ATTENTION_PARTS = ("attn_qkv", "attn_o")
#: most positions a chunk's attention linear step packs into one ciphertext
MAX_PACK = 8


def _packed_matvec(slots: int, weight: np.ndarray) -> HybridMatvec:
    """The product a chunk of >= 2 positions runs: m positions per ciphertext (block layout), the largest
    m <= :data:`MAX_PACK` whose outputs fit a block and whose plaintext products per position are no more
    than the one-position product's (so only rotations, ciphertexts and bytes per position go down); the
    one-position product itself (m = 1) when no m >= 2 qualifies. SmolLM2 at N = 8192: m = 2 for both."""
    n_out, n_in = weight.shape
    one = _matvec(slots, weight)
    best = one
    for m in range(2, min(MAX_PACK, slots // n_in) + 1):
        try:
            fold, period = pick_fold(slots // m, n_in, n_out)
        except ShapeError:
            break
        if (period // fold) <= m * one.window:
            best = HybridMatvec(slots, weight, hybrid_slots(slots // m, period, fold, n_out), period, fold, m)
    return best


@dataclass(frozen=True)
class PackedLayout:
    """A step's chunk layout: ``positions`` per ciphertext, input period, output slots [m, n_out]."""

    positions: int
    period: int
    slots: np.ndarray

    @classmethod
    def of(cls, mv: HybridMatvec) -> PackedLayout:
        return cls(mv.positions, mv.period, mv.position_slots)


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
    #: the layouts of a chunk of >= 2 positions (a decode step, one position, uses the fields above)
    qkv_packed: PackedLayout
    o_packed: PackedLayout

    def positions_per_ciphertext(self, part: str, count: int) -> int:
        """m of a step of ``part`` over ``count`` positions: 1 for one position, else the packed layout's."""
        if count <= 1:
            return 1
        return (self.qkv_packed if part == "attn_qkv" else self.o_packed).positions

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


def _heads(cfg: ModelConfig) -> tuple[int, int, int, int]:
    return cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim


def _layout(slots: int, heads: tuple[int, int, int, int], qkv: HybridMatvec, o: HybridMatvec,
            qkv_packed: HybridMatvec, o_packed: HybridMatvec) -> AttentionLinearLayout:
    return AttentionLinearLayout(slots, *heads, qkv.period, qkv.out_slots, o.period, o.out_slots,
                                 PackedLayout.of(qkv_packed), PackedLayout.of(o_packed))


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
        self.packed_qkv, self.packed_o = _packed_matvec(slots, w.qkv), _packed_matvec(slots, w.o)
        self.layout = _layout(slots, _heads(cfg), self.matvec_qkv, self.matvec_o, self.packed_qkv, self.packed_o)
        top = self.ev.top
        self._enc_qkv: EncodedMatvec = self.matvec_qkv.encode(self.ev, top)
        self._enc_o: EncodedMatvec = self.matvec_o.encode(self.ev, top)
        # pack17's block layout (m positions per ciphertext), encoded on first use: the service sends steps of
        # several positions in the chunk layout (``self.chunks``), so a worker normally never needs it
        self._enc_packed: dict[str, EncodedMatvec] = {}
        self._bias = w.bias
        self._bias_pt: dict[bool, object] = {}   # encoded on first use, at the product's output level and scale
        # a step of several positions (prefill chunk, verify step): the position-interleaved chunk layout
        self.chunks = (ChunkProducts(self.ev, {"attn_qkv": w.qkv, "attn_o": w.o},
                                     {"attn_qkv": w.bias} if w.bias is not None else None) if chunks else None)

    @property
    def rotation_steps(self) -> set[int]:
        """Galois keys both steps need, one position or a chunk (the client generates exactly these)."""
        return (_steps(self.ev.slots, self.matvec_qkv, self.matvec_o, self.packed_qkv, self.packed_o)
                | chunk_rotation_steps(self.chunks))

    def chunk(self, part: str, cts: list[Ciphertext], keys: EvalKeys) -> list[Ciphertext]:
        """A multi-position ``attn_qkv`` (+ bias) or ``attn_o`` step in the chunk layout
        (:mod:`fhe.interleaved`): T fresh ciphertexts per chunk in, G per chunk out, at level 1."""
        return require_chunks(self.chunks)(part, cts, keys)

    def encoded(self, part: str, packed: bool = False) -> EncodedMatvec:
        """The encoded product of ``part`` (``attn_qkv`` / ``attn_o``): one position, or (``packed``) the block
        layout of ``layout.qkv_packed`` / ``layout.o_packed`` — the one-position product itself when m = 1."""
        one = self._enc_qkv if part == "attn_qkv" else self._enc_o
        if not packed:
            return one
        if part not in self._enc_packed:
            mv = self.packed_qkv if part == "attn_qkv" else self.packed_o
            self._enc_packed[part] = one if mv.positions == 1 else mv.encode(self.ev, self.ev.top)
        return self._enc_packed[part]

    def qkv(self, ct: Ciphertext, keys: EvalKeys, packed: bool = False) -> Ciphertext:
        """Fresh replicated x̂ -> ``[q; k; v]`` (+ bias) at level 1 (the smallest download); ``packed``: the
        chunk layout (``layout.qkv_packed``: m positions in, m positions out)."""
        check_fresh(self.ev, keys, ct)
        out = self.encoded("attn_qkv", packed)(self.ev, ct, keys)
        if self._bias is not None:
            out = self.ev.add_plain(out, self._bias_plain(out, packed))
        return self.ev.mod_switch(out, 1)

    def o(self, ct: Ciphertext, keys: EvalKeys, packed: bool = False) -> Ciphertext:
        """Fresh replicated mixture u [Hq D] -> ``Wo u`` at level 1 (``packed``: ``layout.o_packed``)."""
        check_fresh(self.ev, keys, ct)
        return self.ev.mod_switch(self.encoded("attn_o", packed)(self.ev, ct, keys), 1)

    def _bias_plain(self, like: Ciphertext, packed: bool):
        if packed not in self._bias_pt:
            vals = np.zeros(self.ev.slots)
            if packed:
                vals[self.layout.qkv_packed.slots] = self._bias[None, :]
            else:
                vals[self.layout.qkv_slots] = self._bias
            self._bias_pt[packed] = self.ev.encode(vals, self.ev.level(like), self.ev.scale_of(like))
        return self._bias_pt[packed]


@functools.lru_cache(maxsize=8)
def _geometry(slots: int, heads: tuple[int, int, int, int]) -> tuple[AttentionLinearLayout, tuple[int, ...]]:
    hidden, hq, hkv, d = heads
    wq, wo = np.zeros(((hq + 2 * hkv) * d, hidden)), np.zeros((hidden, hq * d))
    mvs = (_matvec(slots, wq), _matvec(slots, wo), _packed_matvec(slots, wq), _packed_matvec(slots, wo))
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

    def input_rows(self, h: torch.Tensor, packed: bool = False) -> list[np.ndarray]:
        """Residual h [T, hidden] -> the RMS-normalized (no gain, float64) replicated inputs: one per position,
        or (``packed``, a chunk) one per ``layout.qkv_packed.positions`` positions."""
        _check(h, self.layout.hidden)
        x = h.double()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self._rows("attn_qkv", x.numpy(), packed)

    def mixture_rows(self, u: torch.Tensor, packed: bool = False) -> list[np.ndarray]:
        """Mixture u [T, Hq D] -> the replicated inputs of the output projection (``packed``: as above)."""
        _check(u, self.layout.q_dim)
        return self._rows("attn_o", u.double().numpy(), packed)

    def split_qkv(self, values: list[np.ndarray], count: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decrypted ``attn_qkv`` answers (one slot vector per position, or, with ``count``, per ciphertext of
        a packed chunk of ``count`` positions) -> q [T, Hq, D], k, v [T, Hkv, D] (float64, before RoPE)."""
        return self.split_rows(torch.from_numpy(self._values("attn_qkv", values, count)))

    def split_rows(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[q; k; v]`` rows [T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k, v [T, Hkv, D]."""
        lay = self.layout
        q, k, v = flat.split([lay.q_dim, lay.kv_dim, lay.kv_dim], dim=-1)
        t = flat.shape[0]
        return (q.reshape(t, lay.num_heads, lay.head_dim), k.reshape(t, lay.num_kv_heads, lay.head_dim),
                v.reshape(t, lay.num_kv_heads, lay.head_dim))

    def output(self, values: list[np.ndarray], count: int | None = None) -> torch.Tensor:
        """Decrypted ``attn_o`` answers (``count``: as in :meth:`split_qkv`) -> the attention output
        [T, hidden] (float64): add it to h."""
        return torch.from_numpy(self._values("attn_o", values, count))

    def _rows(self, part: str, x: np.ndarray, packed: bool) -> list[np.ndarray]:
        lay = self.layout
        if not packed:
            period = lay.qkv_period if part == "attn_qkv" else lay.o_period
            return [replicate_input(r, lay.slots, period) for r in x]
        pk = lay.qkv_packed if part == "attn_qkv" else lay.o_packed
        m = pk.positions
        return [pack_inputs(x[i:i + m], lay.slots, pk.period, m) for i in range(0, len(x), m)]

    def _values(self, part: str, values: list[np.ndarray], count: int | None) -> np.ndarray:
        lay = self.layout
        if count is None:
            slots = lay.qkv_slots if part == "attn_qkv" else lay.o_slots
            return np.stack([v[slots] for v in values])
        pk = lay.qkv_packed if part == "attn_qkv" else lay.o_packed
        if len(values) != -(-count // pk.positions):
            raise ShapeError(f"{count} positions in {len(values)} ciphertexts of {pk.positions} positions each")
        return np.concatenate([v[pk.slots] for v in values])[:count]

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
    """A chunk of positions through the two steps in process (tests, benchmarks): h [T, hidden] ->
    the attention output [T, hidden] (float64); ``rope`` is the model's :class:`RotaryEmbedding`."""
    t = h.shape[0]
    packed, count = t > 1, (t if t > 1 else None)     # a chunk packs; one position keeps its own layout
    qkv = client.decrypt([server.qkv(ct, keys, packed) for ct in client.encrypt(client.input_rows(h, packed))])
    q, k, v = client.split_qkv(qkv, count)
    u = cache.attend(rope(q, positions), rope(k, positions), v).reshape(t, -1)
    return client.output(client.decrypt([server.o(ct, keys, packed)
                                         for ct in client.encrypt(client.mixture_rows(u, packed))]), count)


__all__ = ["ATTENTION_PARTS", "MAX_PACK", "AttentionLinearClient", "AttentionLinearLayout", "AttentionLinearWeights",
           "ClientKV", "PackedLayout", "EncryptedAttentionLinear", "attention_geometry", "run_client_aided"]
