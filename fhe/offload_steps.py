"""What client and server share to run an offload plan's linear steps (docs/protocol.md, "Offload steps").

The MLP block (:mod:`fhe.mlp`) runs at its own parameters (:data:`fhe.mlp.MLP_PARAMS`, N = 8192) with its
own key set. Both sides need the same slot layout and Galois steps; the server builds them from the
weights (:class:`fhe.mlp.EncryptedMLP`), the client, which has no server weights, from the shapes alone
(:func:`mlp_geometry`: the same hybrid products over zero matrices, so the layout cannot differ).

Per part, a step carries one fresh ciphertext per position:

* ``mlp_up``: x̂ replicated with period P1 in, ``[gate|up]`` out (one ciphertext per position, two when
  gate and up do not share the slots);
* ``mlp_down``: ``silu(g) * u`` replicated with period P2 in, ``W_down a`` out;
* ``attn_qkv`` / ``attn_o`` (:mod:`fhe.offload_attention`, a server attention with ``softmax = client``):
  x̂ in, ``[q; k; v]`` out; the mixture u in, ``Wo u`` out — one ciphertext each way per position.

Both kinds run at the same parameters under one key set whose Galois steps are the union of the parts'
(:func:`offload_rotation_steps`).
"""

from __future__ import annotations

import functools

import numpy as np

from engine.config import ModelConfig
from fhe.mlp import MLP_PARAMS, MLPLayout, MLPWeights, _matvec, _up_matvecs
from fhe.offload_attention import ATTENTION_PARTS, attention_geometry
from fhe.params import CKKSParams

MLP_PARTS = ("mlp_up", "mlp_down")
#: every part an offload key set runs (the envelope's ``part``; ``attention`` is the calibrated block)
OFFLOAD_PARTS = ATTENTION_PARTS + MLP_PARTS


@functools.lru_cache(maxsize=8)
def _geometry(slots: int, hidden: int, intermediate: int) -> tuple[MLPLayout, tuple[int, ...]]:
    zeros = MLPWeights(np.zeros((intermediate, hidden)), np.zeros((intermediate, hidden)),
                       np.zeros((hidden, intermediate)))
    ups, down = _up_matvecs(slots, zeros), _matvec(slots, zeros.down)
    layout = MLPLayout(slots, hidden, intermediate, tuple(m.period for m in ups), tuple(m.out_slots for m in ups),
                       down.period, down.out_slots)
    steps = set(down.rotation_steps)
    for m in ups:
        steps |= m.rotation_steps
    return layout, tuple(sorted({s % slots for s in steps} - {0}))


def mlp_geometry(cfg: ModelConfig, params: CKKSParams = MLP_PARAMS) -> tuple[MLPLayout, tuple[int, ...]]:
    """(layout, Galois steps) of the encrypted MLP of a model of shape ``cfg``, from shapes only: equal to
    :class:`fhe.mlp.EncryptedMLP`'s ``layout`` and ``rotation_steps`` for any weights of that shape."""
    return _geometry(params.poly_modulus_degree // 2, cfg.hidden_size, cfg.intermediate_size)


def offload_rotation_steps(cfg: ModelConfig, params: CKKSParams = MLP_PARAMS, *, attention: bool = True,
                           mlp: bool = True) -> tuple[int, ...]:
    """The Galois steps of the offload key set: the union of the attention linear steps' (when the plan has
    a server attention with ``softmax = client``) and the MLP's (when it has a server MLP)."""
    steps: set[int] = set()
    if attention:
        steps |= set(attention_geometry(cfg, params)[1])
    if mlp:
        steps |= set(mlp_geometry(cfg, params)[1])
    return tuple(sorted(steps))


def fresh_blob_limit(params: CKKSParams) -> int:
    """Upper bound on one serialized fresh ciphertext of ``params`` (two polynomials over the data primes,
    8 bytes a coefficient, before any compression or seeding) plus its wire envelope: the per-blob size
    limit of an MLP step, checked before a worker parses anything."""
    return 2 * (len(params.coeff_mod_bit_sizes) - 1) * params.poly_modulus_degree * 8 + 4096


def outputs_per_position(layout: MLPLayout, part: str) -> int:
    """Result ciphertexts per position of a step of ``part`` (one for every part but a split ``mlp_up``)."""
    return len(layout.up_slots) if part == "mlp_up" else 1


__all__ = ["ATTENTION_PARTS", "MLP_PARTS", "OFFLOAD_PARTS", "fresh_blob_limit", "mlp_geometry",
           "offload_rotation_steps", "outputs_per_position"]
