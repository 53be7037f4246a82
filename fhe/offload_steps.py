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

A step of several positions (a prefill chunk, a speculative verify step) runs every part in the
position-interleaved chunk layout instead (:mod:`fhe.interleaved`, :func:`chunk_shapes`): chunks of
:data:`fhe.interleaved.CHUNK_POSITIONS` positions, each ``T`` ciphertexts in and ``G`` out per part.

Both kinds run at the same parameters under one key set whose Galois steps are the union of the parts'
(:func:`offload_rotation_steps`).

A fused plan (:mod:`fhe.offload_fused`) adds two parts, ``o_up`` and ``down_qkv`` (``[u; x]`` in, ``[Wo u;
W_gu (x + Wo u)]`` out; ``[a; x']`` in, ``[W_down a; W_qkv (x' + W_down a)]`` out, both before the client's
RMS scaling), laid out the same way by shapes: its key set holds the four parts' steps and theirs.
"""

from __future__ import annotations

import functools

import numpy as np

from engine.config import ModelConfig
from fhe.interleaved import CHUNK_POSITIONS, ChunkShape, chunk_count, chunk_shape
from fhe.mlp import MLP_PARAMS, MLPLayout, MLPWeights, _matvec, _up_matvecs
from fhe.offload_attention import ATTENTION_PARTS, attention_geometry
from fhe.offload_fused import FUSED_PARTS, fused_geometry, fused_shape
from fhe.params import CKKSParams

MLP_PARTS = ("mlp_up", "mlp_down")
#: every part an unfused offload key set runs (the envelope's ``part``; ``attention`` is the calibrated block)
OFFLOAD_PARTS = ATTENTION_PARTS + MLP_PARTS
#: every linear part, fused plans' included
LINEAR_PARTS = OFFLOAD_PARTS + FUSED_PARTS


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


def part_shape(cfg: ModelConfig, part: str) -> tuple[int, int]:
    """(n_out, n_in) of a linear part's product (``mlp_up``: gate and up stacked, one product; the fused
    parts: :func:`fhe.offload_fused.fused_shape`)."""
    if part in FUSED_PARTS:
        return fused_shape(cfg, part)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = {"attn_qkv": (q + 2 * kv, h), "attn_o": (h, q), "mlp_up": (2 * i, h), "mlp_down": (h, i)}
    return shapes[part]


def chunk_shapes(cfg: ModelConfig, params: CKKSParams = MLP_PARAMS,
                 positions: int = CHUNK_POSITIONS, *, fused: bool = False) -> dict[str, ChunkShape]:
    """Per part, the chunk layout of a multi-position step (from shapes alone: client and server agree);
    ``fused``: the fused parts' too."""
    slots = params.poly_modulus_degree // 2
    return {part: chunk_shape(slots, part_shape(cfg, part)[1], part_shape(cfg, part)[0], positions)
            for part in (LINEAR_PARTS if fused else OFFLOAD_PARTS)}


def step_blobs(shape: ChunkShape, count: int) -> tuple[int, int]:
    """(ciphertexts in, ciphertexts out) of a multi-position step of ``count`` >= 2 positions."""
    chunks = chunk_count(count, shape.positions)
    return chunks * shape.tiles, chunks * shape.groups


#: ``offload.mlp.chunk_layout`` of a deployment without the chunk layout: one ciphertext per position
NO_CHUNK_LAYOUT = {"name": "none", "version": 1}


def chunk_layout_manifest(chunks: dict[str, ChunkShape] | None) -> dict:
    """The manifest's ``offload.mlp.chunk_layout``: how a step of >= 2 positions is laid out (docs/protocol.md,
    "Offload steps"; ``chunks`` None: :data:`NO_CHUNK_LAYOUT`); the SDK refuses a server whose layout differs
    from the one it computes."""
    if chunks is None:
        return dict(NO_CHUNK_LAYOUT)
    some = next(iter(chunks.values()))
    return {"name": "interleaved", "version": 1, "positions": some.positions,
            "parts": {p: {"tile": sh.tile, "baby": sh.baby, "tiles": sh.tiles, "groups": sh.groups,
                          "folds": [sh.fold(g) for g in range(sh.groups)]}
                      for p, sh in chunks.items()}}


def offload_rotation_steps(cfg: ModelConfig, params: CKKSParams = MLP_PARAMS, *, attention: bool = True,
                           mlp: bool = True, chunks: bool = True, fused: bool = False) -> tuple[int, ...]:
    """The Galois steps of the offload key set: the union of the attention linear steps' (when the plan has
    a server attention with ``softmax = client``) and the MLP's (when it has a server MLP), one position
    and (``chunks``: where the server runs it) chunk layouts alike; ``fused``: the fused parts' too."""
    steps: set[int] = set()
    shapes = chunk_shapes(cfg, params, fused=fused) if chunks else {}
    if fused:
        steps |= set(fused_geometry(cfg, params)[1])
        steps |= {s for p in FUSED_PARTS if p in shapes for s in shapes[p].rotation_steps}
    if attention:
        steps |= set(attention_geometry(cfg, params)[1])
        steps |= {s for p in ATTENTION_PARTS if p in shapes for s in shapes[p].rotation_steps}
    if mlp:
        steps |= set(mlp_geometry(cfg, params)[1])
        steps |= {s for p in MLP_PARTS if p in shapes for s in shapes[p].rotation_steps}
    return tuple(sorted(steps))


def fresh_blob_limit(params: CKKSParams) -> int:
    """Upper bound on one serialized fresh ciphertext of ``params`` (two polynomials over the data primes,
    8 bytes a coefficient, before any compression or seeding) plus its wire envelope: the per-blob size
    limit of an MLP step, checked before a worker parses anything."""
    return 2 * (len(params.coeff_mod_bit_sizes) - 1) * params.poly_modulus_degree * 8 + 4096


def outputs_per_position(layout: MLPLayout, part: str) -> int:
    """Result ciphertexts per position of a step of ``part`` (one for every part but a split ``mlp_up``)."""
    return len(layout.up_slots) if part == "mlp_up" else 1


__all__ = ["ATTENTION_PARTS", "FUSED_PARTS", "LINEAR_PARTS", "MLP_PARTS", "NO_CHUNK_LAYOUT", "OFFLOAD_PARTS",
           "chunk_layout_manifest", "chunk_shapes", "fresh_blob_limit", "mlp_geometry", "offload_rotation_steps",
           "outputs_per_position", "part_shape", "step_blobs"]
