"""Slot layouts of the encrypted attention block (which slot holds which token, head, dim).

S = N/2 slots per ciphertext. Three layouts (drawn in ``docs/fhe.md``):

* **input** (client -> server): the RMS-normalized residual x [hidden], zero-padded to the period P
  and repeated over all S slots: ``slot s = x[s mod P]`` (:func:`fhe.linalg.replicate_input`).
* **band** (everything on the server after the projections): 64 = D bands of ``W = S/D`` slots, one
  band per head dim d; inside a band, ``B = W // Hq`` token rows of Hq query heads:
  ``slot(d, j, h) = d*W + j*Hq + h``. A K/V cache block holds B tokens (GQA: K/V of KV head g are
  stored once per query head h of its group, so the q.k product is slot-wise). Summing over the 64
  bands (rotations by multiples of W) gives q.k in every band, already broadcast for the V product.
* **output** (server -> client): ``y_h[o]`` at ``slot(o mod D, o div D, h)`` and ``z_h`` at
  ``slot(0, hidden/D, h)``.

For SmolLM2-135M (hidden 576, Hq 9, Hkv 3, D 64) at N = 16384: W = 128, B = 14 tokens per block,
band slots 126 and 127 stay 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fhe.errors import ShapeError


@dataclass(frozen=True)
class BandLayout:
    """The band layout for one model shape and slot count (see the module docstring)."""

    slots: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.slots % self.head_dim:
            raise ShapeError(f"{self.slots} slots do not split into {self.head_dim} bands")
        if self.num_heads % self.num_kv_heads:
            raise ShapeError("query heads must be a multiple of KV heads (GQA)")
        if self.block_tokens < 1:
            raise ShapeError(f"band of {self.band} slots cannot hold {self.num_heads} heads")
        if self.hidden % self.head_dim or self.hidden // self.head_dim >= self.block_tokens:
            raise ShapeError("the output layout needs hidden = k*D with k < tokens per block")

    @property
    def band(self) -> int:
        """W, the width of one band (slots per head dim)."""
        return self.slots // self.head_dim

    @property
    def block_tokens(self) -> int:
        """B, tokens per K/V cache block."""
        return self.band // self.num_heads

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def slot(self, d, j, h):
        """Slot of (dim d, token row j, query head h); broadcasts over numpy arrays."""
        return np.asarray(d) * self.band + np.asarray(j) * self.num_heads + np.asarray(h)

    def rows(self, j: int = 0) -> np.ndarray:
        """[Hq, D] slots of token row j."""
        h, d = np.meshgrid(np.arange(self.num_heads), np.arange(self.head_dim), indexing="ij")
        return self.slot(d, j, h)

    def valid(self, n_tokens: int, values: np.ndarray | None = None) -> np.ndarray:
        """[S] vector: ``values[h]`` (default 1) at rows j < n_tokens of every band, 0 elsewhere."""
        vals = np.ones(self.num_heads) if values is None else np.asarray(values, np.float64)
        out = np.zeros(self.slots)
        d, j, h = np.meshgrid(np.arange(self.head_dim), np.arange(n_tokens), np.arange(self.num_heads),
                              indexing="ij")
        out[self.slot(d, j, h).ravel()] = vals[h.ravel()]
        return out

    def output_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """(y slots [Hq, hidden], z slots [Hq]) of the output layout."""
        o = np.arange(self.hidden)
        y = np.stack([self.slot(o % self.head_dim, o // self.head_dim, h) for h in range(self.num_heads)])
        z = self.slot(0, self.hidden // self.head_dim, np.arange(self.num_heads))
        return y, z

    def split_output(self, vec: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Decrypted output slots [S] -> y [Hq, hidden], z [Hq]."""
        ys, zs = self.output_slots()
        return vec[ys], vec[zs]
