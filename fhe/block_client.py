"""The client half of the encrypted attention blocks: input layout, decryption, exact normalization.

Works with any :class:`fhe.evaluator.KeyHolder` (the SEAL client in production).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.config import ModelConfig
from fhe.errors import OutputRangeError, ShapeError
from fhe.evaluator import Ciphertext, KeyHolder
from fhe.geometry import Geometry
from fhe.linalg import replicate_input
from fhe.packing import BandLayout


@dataclass
class BlockClient:
    """Client side of the encrypted blocks: input layout, decryption and the exact normalization."""

    client: KeyHolder
    layout: BandLayout
    period: int
    #: The block geometry (for the packed prefill layout); set by :meth:`for_model`.
    geo: Geometry | None = None

    @classmethod
    def for_model(cls, client: KeyHolder, cfg: ModelConfig, kind: str = "sqexp",
                  squarings: int = 6) -> BlockClient:
        geo = Geometry.build(cfg, client.params, kind, squarings)
        return cls(client, geo.layout, geo.period, geo)

    def layout_input(self, x_row: torch.Tensor) -> np.ndarray:
        """One token's x̂ [hidden] -> its input slot vector [S] (replicated with the block's period)."""
        return replicate_input(x_row.detach().double().cpu().numpy(), self.layout.slots, self.period)

    def encrypt_input(self, x_normed: torch.Tensor) -> list[Ciphertext]:
        """x̂ [T, hidden] (RMS-normalized residual, no gain) -> one ciphertext per token."""
        if x_normed.ndim != 2 or x_normed.shape[1] != self.layout.hidden:
            raise ShapeError(f"expected [T, {self.layout.hidden}], got {tuple(x_normed.shape)}")
        x = x_normed.detach().double().cpu().numpy()
        return [self.client.encrypt(replicate_input(row, self.layout.slots, self.period)) for row in x]

    def encrypt_packed(self, x_normed: torch.Tensor) -> list[Ciphertext]:
        """x̂ [T, hidden] -> ceil(T / B) packed ciphertexts (:meth:`Geometry.packed_input_slots`)."""
        return [self.client.encrypt(v) for v in self.layout_packed(x_normed)]

    def layout_packed(self, x_normed: torch.Tensor) -> list[np.ndarray]:
        """x̂ [T, hidden] -> the slot vector of each packed chunk of up to B tokens."""
        if x_normed.ndim != 2 or x_normed.shape[1] != self.layout.hidden:
            raise ShapeError(f"expected [T, {self.layout.hidden}], got {tuple(x_normed.shape)}")
        geo = self.geo
        b = 0 if geo is None else geo.packed_chunk
        if not b:
            raise ShapeError("this block has no packed prefill layout")
        x = x_normed.detach().double().cpu().numpy()
        out = []
        for s in range(0, len(x), b):
            rows = x[s:s + b]
            vec = np.zeros(self.layout.slots)
            vec[geo.packed_input_slots(len(rows)).ravel()] = rows.ravel()
            out.append(vec)
        return out

    def decrypt_output(self, cts: list[Ciphertext]) -> tuple[torch.Tensor, torch.Tensor]:
        """Output ciphertexts -> y [T, Hq, hidden], z [T, Hq] (float64)."""
        ys, zs = zip(*(self.layout.split_output(self.client.decrypt(c)) for c in cts), strict=True)
        return torch.from_numpy(np.stack(ys)), torch.from_numpy(np.stack(zs))

    @staticmethod
    def finish(y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """attn_out [T, hidden] = sum_h y_h / z_h (the exact normalization, on the client).

        Every z_h is a sum of positive weights; a z <= 0 or a non-finite value means the server's
        values overflowed the last prime (inputs far outside the plan's calibrated range) or were
        tampered with: OutputRangeError rather than a silently wrong token.
        """
        if not (torch.isfinite(y).all() and torch.isfinite(z).all() and (z > 0).all()):
            raise OutputRangeError("decrypted attention output out of range (z <= 0 or not finite)")
        return (y / z[..., None]).sum(1)
