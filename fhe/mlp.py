"""The encrypted SwiGLU MLP block of one Llama-family layer, with client-aided SiLU.

``mlp(h) = W_down (silu(W_gate x) * (W_up x))`` with ``x = g * h / rms(h)`` (``g`` the post-attention
RMSNorm gain). The non-linear parts stay on the client, which holds the residual stream:

1. client: ``x̂ = h / rms(h)`` (no gain), replicated with period ``P1`` over all slots, encrypted;
2. server (:meth:`EncryptedMLP.gate_up`): ``[W_gate * g; W_up * g] x̂`` by the hybrid BSGS product of
   :mod:`fhe.linalg` (one level). Gate and up outputs share one ciphertext when the slots hold both
   (``2 I`` outputs), else one ciphertext each;
3. client: decrypts ``g_o, u_o``, computes ``a = silu(g_o) * u_o`` exactly, replicates ``a`` with period
   ``P2`` and encrypts it (the second round trip of the block);
4. server (:meth:`EncryptedMLP.down`): ``W_down a`` (one level); the client decrypts and adds it to ``h``.

Slot layouts (S = N/2): the input holds ``x̂[s mod P1]`` in slot s; output o of a product sits at
``hybrid_slots(S, P, c, n)[o]`` (gate outputs first, then up outputs when packed together). Each half has
multiplicative depth 1, so the block runs at its own shallow parameters (:data:`MLP_PARAMS`, N = 8192,
one rescale) with its own small keys, independent of the attention block's deep N = 32768 chain.
Everything goes through :class:`fhe.evaluator.Evaluator`; nothing here names a CKKS library.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.model import DecoderLayer
from fhe.errors import ParameterError, ShapeError
from fhe.evaluator import Ciphertext, EvalKeys, Evaluator, KeyHolder, check_fresh
from fhe.interleaved import ChunkProducts, chunk_rotation_steps, require_chunks
from fhe.linalg import EncodedMatvec, HybridMatvec, hybrid_slots, pick_fold, replicate_input
from fhe.params import CKKSParams

#: The MLP's own parameter set: depth 1 (each half is one plaintext product), 2^40 scale, 20 bits of
#: headroom in the 60-bit last prime; log2(Q) = 160 <= 218 (128-bit secure at N = 8192).
MLP_PARAMS = CKKSParams(8192, (60, 40, 60), 40)


@dataclass(frozen=True)
class MLPWeights:
    """The server's weights of one MLP block, float64; the post-attention RMSNorm gain folded into
    gate and up. Shapes: gate/up [I, hidden], down [hidden, I]."""

    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray

    @classmethod
    def of(cls, layer: DecoderLayer) -> MLPWeights:
        gain = layer.post_attention_layernorm.weight.detach().double().numpy()
        mlp = layer.mlp

        def w(lin: torch.nn.Linear) -> np.ndarray:
            return lin.weight.detach().double().numpy()

        return cls(w(mlp.gate_proj) * gain, w(mlp.up_proj) * gain, w(mlp.down_proj))

    @property
    def hidden(self) -> int:
        return self.gate.shape[1]

    @property
    def intermediate(self) -> int:
        return self.gate.shape[0]


def _matvec(slots: int, weight: np.ndarray) -> HybridMatvec:
    """The hybrid product of ``weight`` [n_out, n_in] with the largest fold whose outputs fit."""
    n_out, n_in = weight.shape
    fold, period = pick_fold(slots, n_in, n_out)
    return HybridMatvec(slots, weight, hybrid_slots(slots, period, fold, n_out), period, fold)


@dataclass(frozen=True)
class MLPLayout:
    """Where each value of the block sits (shared by client and server; built from shapes only)."""

    slots: int
    hidden: int
    intermediate: int
    #: one matvec [2I, hidden] when gate and up fit one ciphertext, else two [I, hidden]
    up_periods: tuple[int, ...]
    up_slots: tuple[np.ndarray, ...]
    down_period: int
    down_slots: np.ndarray

    @property
    def packed(self) -> bool:
        """Gate and up outputs in one ciphertext (one download instead of two)."""
        return len(self.up_slots) == 1


class EncryptedMLP:
    """Server side of one encrypted MLP block (plaintext weights, public keys only).

    Args:
        layer: the model's decoder layer (its MLP and post-attention norm gain).
        params: CKKS parameters (default :data:`MLP_PARAMS`); need depth >= 1.
        evaluator: the backend that evaluates (default: the default backend for ``params``).
    """

    def __init__(self, layer: DecoderLayer, params: CKKSParams = MLP_PARAMS, *,
                 evaluator: Evaluator | None = None, chunks: bool = True) -> None:
        self.ev = linear_step_evaluator(params, evaluator, "the MLP block")
        w = MLPWeights.of(layer)
        self.matvecs_up = _up_matvecs(self.ev.slots, w)
        self.matvec_down = _matvec(self.ev.slots, w.down)
        self.layout = MLPLayout(self.ev.slots, w.hidden, w.intermediate,
                                tuple(m.period for m in self.matvecs_up),
                                tuple(m.out_slots for m in self.matvecs_up),
                                self.matvec_down.period, self.matvec_down.out_slots)
        top = self.ev.top
        self._enc_up: list[EncodedMatvec] = [m.encode(self.ev, top) for m in self.matvecs_up]
        self._enc_down = self.matvec_down.encode(self.ev, top)
        # several positions per step (prefill chunks, verify steps): the position-interleaved chunk layout,
        # 8x the plaintexts of one position; without it (``chunks=False``) they go one ciphertext per position
        self.chunks = (ChunkProducts(self.ev, {"mlp_up": np.concatenate([w.gate, w.up]), "mlp_down": w.down})
                       if chunks else None)

    @property
    def rotation_steps(self) -> set[int]:
        """Galois keys both halves need, one position or a chunk (the client generates exactly these)."""
        steps = set(self.matvec_down.rotation_steps) | chunk_rotation_steps(self.chunks)
        for m in self.matvecs_up:
            steps |= m.rotation_steps
        return {s % self.ev.slots for s in steps} - {0}

    def gate_up(self, ct: Ciphertext, keys: EvalKeys) -> list[Ciphertext]:
        """Fresh replicated x̂ -> [gate|up] (one ciphertext) or [gate, up], at level 1 (the smallest download)."""
        check_fresh(self.ev, keys, ct)
        return [self.ev.mod_switch(enc(self.ev, ct, keys), 1) for enc in self._enc_up]

    def down(self, ct: Ciphertext, keys: EvalKeys) -> Ciphertext:
        """Fresh replicated ``silu(g) * u`` -> ``W_down a`` at level 1."""
        check_fresh(self.ev, keys, ct)
        return self.ev.mod_switch(self._enc_down(self.ev, ct, keys), 1)

    def chunk(self, part: str, cts: list[Ciphertext], keys: EvalKeys) -> list[Ciphertext]:
        """A multi-position ``mlp_up`` (``[gate; up]`` of each position) or ``mlp_down`` step in the chunk
        layout (:mod:`fhe.interleaved`): T fresh ciphertexts per chunk in, G per chunk out, at level 1."""
        return require_chunks(self.chunks)(part, cts, keys)


def _up_matvecs(slots: int, w: MLPWeights) -> list[HybridMatvec]:
    try:  # gate and up in one ciphertext when the slots hold 2I outputs
        return [_matvec(slots, np.concatenate([w.gate, w.up]))]
    except ShapeError:
        return [_matvec(slots, w.gate), _matvec(slots, w.up)]


@dataclass
class MLPClient:
    """Client side of the encrypted MLP: normalization, exact SiLU * up, layouts, decryption."""

    client: KeyHolder
    layout: MLPLayout
    eps: float

    def encrypt_input(self, h: torch.Tensor) -> Ciphertext:
        """Residual h [hidden] -> the encrypted, RMS-normalized (no gain), replicated input."""
        self._check(h, self.layout.hidden)
        x = h.double()
        x = x * torch.rsqrt(x.pow(2).mean() + self.eps)
        return self.client.encrypt(replicate_input(x.numpy(), self.layout.slots, self.layout.up_periods[0]))

    def activation(self, cts: list[Ciphertext]) -> torch.Tensor:
        """Decrypted gate/up ciphertexts -> ``a = silu(g) * u`` [I] (exact, float64)."""
        lay = self.layout
        if len(cts) != len(lay.up_slots):
            raise ShapeError(f"expected {len(lay.up_slots)} gate/up ciphertexts, got {len(cts)}")
        vals = np.concatenate([self.client.decrypt(c)[s] for c, s in zip(cts, lay.up_slots, strict=True)])
        g, u = torch.from_numpy(vals[:lay.intermediate]), torch.from_numpy(vals[lay.intermediate:])
        return F.silu(g) * u

    def encrypt_activation(self, a: torch.Tensor) -> Ciphertext:
        """a [I] -> the encrypted, replicated input of the down projection."""
        self._check(a, self.layout.intermediate)
        return self.client.encrypt(replicate_input(a.double().numpy(), self.layout.slots,
                                                   self.layout.down_period))

    def output(self, ct: Ciphertext) -> torch.Tensor:
        """The decrypted down projection [hidden] (float64): add it to the residual."""
        return torch.from_numpy(self.client.decrypt(ct)[self.layout.down_slots])

    @staticmethod
    def _check(v: torch.Tensor, n: int) -> None:
        if v.ndim != 1 or v.shape[0] != n:
            raise ShapeError(f"expected a vector of {n} values, got shape {tuple(v.shape)}")
        if not torch.isfinite(v).all():
            raise ShapeError("cannot encrypt NaN/inf")


def run_client_aided(server: EncryptedMLP, client: MLPClient, h: torch.Tensor, keys: EvalKeys) -> torch.Tensor:
    """One token's whole block in process (tests, benchmarks): h [hidden] -> mlp output [hidden]."""
    a = client.activation(server.gate_up(client.encrypt_input(h), keys))
    return client.output(server.down(client.encrypt_activation(a), keys))


def linear_step_evaluator(params: CKKSParams, evaluator: Evaluator | None, what: str) -> Evaluator:
    """The evaluator of a depth-1 linear step (``evaluator``, or the default backend for ``params``), checked
    to run ``params``: each half of a client-aided block is one plaintext product and one rescale."""
    if params.depth < 1:
        raise ParameterError(f"{what} needs one rescale per step (depth >= 1)")
    ev = evaluator if evaluator is not None else _default_evaluator(params)
    if ev.params != params:
        raise ParameterError(f"evaluator {ev.name!r} runs {ev.params}, {what} needs {params}")
    return ev


def _default_evaluator(params: CKKSParams) -> Evaluator:
    from fhe.backends import evaluator_for  # lazy: the backend (a CKKS library) loads on first use

    return evaluator_for(params)


__all__ = ["MLP_PARAMS", "EncryptedMLP", "MLPClient", "MLPLayout", "MLPWeights", "run_client_aided"]
