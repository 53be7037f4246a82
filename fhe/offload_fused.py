"""Fused linear steps: two round trips per server layer instead of four (issue 17, fuse17).

A server layer of an offload plan with client-aided attention and SiLU is four linear steps per token
(``attn_qkv``, ``attn_o``, ``mlp_up``, ``mlp_down``). Two facts halve that:

* RMSNorm's factor ``r(x) = rsqrt(mean(x²) + eps)`` is a per-position scalar and commutes with any linear
  map: ``W diag(g) (r x) = r (W diag(g) x)``. The server can apply a projection to the **unnormalized**
  residual x, and the client, which holds x, multiplies the decrypted result by r afterwards;
* the residual add is linear too.

So, with the client uploading the residual beside its value, two consecutive parts are ONE linear map of
a concatenated input (each still one plaintext-matrix product, depth 1, at :data:`fhe.mlp.MLP_PARAMS`):

* ``o_up`` of layer l (``attn_o`` + ``mlp_up``): in ``[u; x]`` (u the client's attention mixture [Hq D], x
  the residual before the layer [hidden]), out ``[Wo u; W_gu diag(g2) (x + Wo u)]`` =
  ``[[Wo, 0], [W_gu diag(g2) Wo, W_gu diag(g2)]] [u; x]`` (W_gu = gate and up stacked, [2I, hidden]). The
  client: ``x' = x + Wo u``, ``gate|up = r(x') * (...)``, ``a = silu(gate) * up``.
* ``down_qkv`` of layer l (``mlp_down`` of l + ``attn_qkv`` of l + 1): in ``[a; x']``, out
  ``[W_down a; W_qkv diag(g1') (x' + W_down a)]`` = ``[[W_down, 0], [W_qkv diag(g1') W_down, W_qkv diag(g1')]]
  [a; x']``. The client: ``x'' = x' + W_down a``, ``q, k, v = r(x'') * (...)``, RoPE, its exact softmax
  attention on its own clear cache, -> u of layer l + 1.

A run of n consecutive server layers is ``attn_qkv`` (first layer), n ``o_up``, n - 1 ``down_qkv`` and
``mlp_down`` (last layer): 2n + 1 round trips per token instead of 4n (SmolLM2's 28 layers: 57, not 112).
Per token the same values go up and down as before (3264 up, 5184 down per layer for SmolLM2); the
server's multiply-adds grow ~1.9x (the two products W_gu·Wo and W_qkv·W_down it folds in). Biases of
q/k/v (Qwen2) do not commute with the client's scaling: such models keep the four steps
(:func:`check_fusable`).

Layouts (from shapes alone, client and server agree): one position is the hybrid product of
:mod:`fhe.linalg` on the concatenated input replicated with the product's period; where the outputs do not
fit one ciphertext (``o_up``: 3648 outputs of 1152 inputs hold 2944 slots at N = 8192) the rows are cut in
the fewest equal groups that fit, one output ciphertext each (:class:`FusedLayout`). Several positions run
the chunk layout of :mod:`fhe.interleaved` on the same matrices. Everything goes through
:class:`fhe.evaluator.Evaluator`; nothing here names a CKKS library.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from engine.config import ModelConfig
from engine.model import DecoderLayer
from fhe.errors import ShapeError
from fhe.evaluator import Ciphertext, EvalKeys, Evaluator, check_fresh
from fhe.interleaved import ChunkProducts, chunk_rotation_steps, require_chunks
from fhe.linalg import EncodedMatvec, HybridMatvec, hybrid_slots, pick_fold, replicate_input
from fhe.mlp import MLP_PARAMS, MLPWeights, linear_step_evaluator
from fhe.offload_attention import AttentionLinearWeights
from fhe.params import CKKSParams

#: the fused parts (the envelope's ``part``): ``o_up`` of layer l, ``down_qkv`` of layer l (its mlp_down and
#: layer l + 1's attn_qkv)
FUSED_PARTS = ("o_up", "down_qkv")


def fused_shape(cfg: ModelConfig, part: str) -> tuple[int, int]:
    """(n_out, n_in) of a fused part's product."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes = {"o_up": (h + 2 * i, q + h), "down_qkv": (h + q + 2 * kv, i + h)}
    return shapes[part]


def fuse(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """``[[A, 0], [B A, B]]`` for A = ``first`` [h, n] and B = ``second`` [m, h]: the map of ``[v; x]`` to
    ``[A v; B (x + A v)]`` (a residual add between two products), [h + m, n + h]."""
    h = first.shape[0]
    if second.shape[1] != h:
        raise ShapeError(f"cannot fuse {first.shape} then {second.shape}")
    top = np.concatenate([first, np.zeros((h, h))], axis=1)
    return np.concatenate([top, np.concatenate([second @ first, second], axis=1)])


def fused_weights(layer: DecoderLayer, part: str, next_layer: DecoderLayer | None = None) -> np.ndarray:
    """The fused matrix of ``part`` (float64): ``o_up`` from ``layer``'s o_proj and MLP gate/up (its
    post-attention gain folded in), ``down_qkv`` from ``layer``'s down_proj and ``next_layer``'s q/k/v (its
    input gain folded in)."""
    if part == "o_up":
        mlp = MLPWeights.of(layer)
        return fuse(AttentionLinearWeights.of(layer).o, np.concatenate([mlp.gate, mlp.up]))
    if part == "down_qkv":
        if next_layer is None:
            raise ShapeError("down_qkv needs the next layer's attention")
        att = AttentionLinearWeights.of(next_layer)
        if att.bias is not None:
            raise ShapeError("q/k/v biases do not commute with the client's RMS scaling: no fused steps")
        return fuse(MLPWeights.of(layer).down, att.qkv)
    raise ShapeError(f"not a fused part: {part!r}")


def check_fusable(cfg: ModelConfig) -> None:
    """ShapeError where a model cannot run fused steps (q/k/v biases)."""
    if cfg.attention_bias:
        raise ShapeError("q/k/v biases do not commute with the client's RMS scaling: no fused steps")


def split_matvecs(slots: int, weight: np.ndarray) -> list[HybridMatvec]:
    """The hybrid products of ``weight`` [n_out, n_in] for one position: one when its outputs fit one
    ciphertext, else the rows cut in the fewest equal groups that fit (one output ciphertext each)."""
    n_out, n_in = weight.shape
    for k in range(1, n_out + 1):
        size = -(-n_out // k)
        try:
            fold, period = pick_fold(slots, n_in, size)
        except ShapeError:
            if n_in > slots:
                raise
            continue
        return [HybridMatvec(slots, weight[lo:lo + size], hybrid_slots(slots, period, fold, len(weight[lo:lo + size])),
                             period, fold) for lo in range(0, n_out, size)]
    raise ShapeError(f"{n_out} outputs of {n_in} inputs do not fit {slots} slots")


@dataclass(frozen=True)
class FusedLayout:
    """Where the values of a one-position fused step sit (from shapes alone).

    Attributes:
        slots: S.
        n_in, n_out: the product's shape.
        period: the input's replication period.
        out_slots: per output ciphertext, the slots of its outputs (outputs in order across ciphertexts).
    """

    slots: int
    n_in: int
    n_out: int
    period: int
    out_slots: tuple[np.ndarray, ...]

    @property
    def outputs(self) -> int:
        """Result ciphertexts per position."""
        return len(self.out_slots)

    def pack(self, x: np.ndarray) -> np.ndarray:
        """One position's input [n_in] -> its replicated slot vector [S]."""
        if x.shape != (self.n_in,):
            raise ShapeError(f"a fused step takes {self.n_in} values, got {x.shape}")
        return replicate_input(x, self.slots, self.period)

    def unpack(self, values: list[np.ndarray]) -> np.ndarray:
        """One position's decrypted output slot vectors -> y [n_out]."""
        if len(values) != self.outputs:
            raise ShapeError(f"a fused step answers {self.outputs} ciphertexts per position, got {len(values)}")
        return np.concatenate([np.asarray(v)[s] for v, s in zip(values, self.out_slots, strict=True)])


def _layout(mvs: list[HybridMatvec]) -> FusedLayout:
    n_in = mvs[0].weight.shape[1]
    return FusedLayout(mvs[0].slots, n_in, sum(m.weight.shape[0] for m in mvs), mvs[0].period,
                       tuple(m.out_slots for m in mvs))


def _steps(slots: int, mvs: Iterable[HybridMatvec]) -> set[int]:
    steps: set[int] = set()
    for m in mvs:
        steps |= m.rotation_steps
    return {s % slots for s in steps} - {0}


@functools.lru_cache(maxsize=16)
def _geometry(slots: int, shapes: tuple[tuple[str, int, int], ...]) -> tuple[dict[str, FusedLayout], tuple[int, ...]]:
    layouts, steps = {}, set()
    for part, n_out, n_in in shapes:
        mvs = split_matvecs(slots, np.zeros((n_out, n_in)))
        if len({m.period for m in mvs}) != 1:
            raise ShapeError(f"{part}: the output groups need one input period")
        layouts[part] = _layout(mvs)
        steps |= _steps(slots, mvs)
    return layouts, tuple(sorted(steps))


def fused_geometry(cfg: ModelConfig, params: CKKSParams = MLP_PARAMS
                   ) -> tuple[dict[str, FusedLayout], tuple[int, ...]]:
    """(layout per fused part, Galois steps of their one-position products), from shapes only: equal to
    :class:`EncryptedFused`'s for any weights of that shape."""
    return _geometry(params.poly_modulus_degree // 2, tuple((p, *fused_shape(cfg, p)) for p in FUSED_PARTS))


class EncryptedFused:
    """Server side of one layer's fused steps (plaintext weights, public keys only).

    Args:
        weights: part -> its fused matrix (:func:`fused_weights`): ``o_up`` and/or ``down_qkv`` of this layer.
        params: CKKS parameters (default :data:`fhe.mlp.MLP_PARAMS`); need depth >= 1.
        evaluator: the backend that evaluates (default: the default backend for ``params``).
        chunks: also encode the chunk layout (steps of several positions).
    """

    def __init__(self, weights: dict[str, np.ndarray], params: CKKSParams = MLP_PARAMS, *,
                 evaluator: Evaluator | None = None, chunks: bool = True) -> None:
        self.ev = linear_step_evaluator(params, evaluator, "a fused linear step")
        slots, top = self.ev.slots, self.ev.top
        self.matvecs = {p: split_matvecs(slots, w) for p, w in weights.items()}
        self.layouts = {p: _layout(mvs) for p, mvs in self.matvecs.items()}
        self._enc_fused: list[EncodedMatvec] = []   # every part's, in order (server.private.compute counts bytes)
        self._encoded: dict[str, list[EncodedMatvec]] = {}
        for p, mvs in self.matvecs.items():
            self._encoded[p] = [m.encode(self.ev, top) for m in mvs]
            self._enc_fused += self._encoded[p]
        self.chunks = ChunkProducts(self.ev, dict(weights)) if chunks else None

    @property
    def rotation_steps(self) -> set[int]:
        """Galois keys of every part, one position or a chunk."""
        return _steps(self.ev.slots, (m for mvs in self.matvecs.values() for m in mvs)) | chunk_rotation_steps(
            self.chunks)

    def step(self, part: str, ct: Ciphertext, keys: EvalKeys) -> list[Ciphertext]:
        """One fresh replicated input -> the part's output ciphertexts at level 1 (the smallest download)."""
        if part not in self._encoded:
            raise ShapeError(f"this layer has no fused part {part!r}")
        check_fresh(self.ev, keys, ct)
        return [self.ev.mod_switch(enc(self.ev, ct, keys), 1) for enc in self._encoded[part]]

    def chunk(self, part: str, cts: list[Ciphertext], keys: EvalKeys) -> list[Ciphertext]:
        """A multi-position step in the chunk layout (:mod:`fhe.interleaved`): T fresh ciphertexts per chunk in,
        G per chunk out, at level 1."""
        return require_chunks(self.chunks)(part, cts, keys)


def fused_step_order(layers: Iterable[int]) -> tuple[tuple[int, str], ...]:
    """Per token, the linear steps of fused server layers ``layers`` in the order they run: per run of
    consecutive layers ``attn_qkv`` of its first, ``o_up`` of each, ``down_qkv`` between two, ``mlp_down``
    of its last."""
    s = set(layers)
    out: list[tuple[int, str]] = []
    for i in sorted(s):
        if i - 1 not in s:
            out.append((i, "attn_qkv"))
        out.append((i, "o_up"))
        out.append((i, "down_qkv" if i + 1 in s else "mlp_down"))
    return tuple(out)


__all__ = ["FUSED_PARTS", "EncryptedFused", "FusedLayout", "check_fusable", "fuse", "fused_geometry", "fused_shape",
           "fused_step_order", "fused_weights", "split_matvecs"]
