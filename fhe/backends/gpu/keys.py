"""Evaluation keys of one client key set, expanded once on the CPU and kept on the device.

The upload (SEAL's seeded, compressed form) goes through the SEAL backend's allow-list and SEAL's
own validation (:func:`fhe.backends.seal.wire.keys_from_payloads`), is saved again by SEAL (now
expanded: the seeded half regenerated) and parsed into tensors ``[K, 2, K+1, N]`` per key (K data
primes' decomposition components, the key's two polynomials, every prime of the key chain).
Device memory per key: ``2 K (K+1) N 8`` bytes (81.8 MB at N = 32768, K = 12; see docs/fhe.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from fhe.backends.gpu import sealio
from fhe.backends.gpu.galois import galois_elt
from fhe.backends.gpu.rns import RNSContext
from fhe.backends.seal import hazmat as seal
from fhe.backends.seal import wire
from fhe.errors import KeyMismatchError, WireError
from fhe.params import CKKSParams


@dataclass
class GpuKeys:
    """The gpu backend's :class:`fhe.evaluator.EvalKeys`: relin key and Galois keys as device tensors."""

    backend: ClassVar[str] = "gpu"
    params: CKKSParams
    relin: torch.Tensor                           # [K, 2, K+1, N]
    galois: dict[int, torch.Tensor]               # Galois element -> [K, 2, K+1, N]
    rotation_steps: tuple[int, ...]
    fingerprint: str
    #: per (galois element, level): the hoisting correction (keyswitch.hoisted_correction)
    corrections: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False)

    def nbytes(self) -> int:
        """Device bytes of the expanded keys (what a worker's key budget counts)."""
        return sum(t.numel() * 8 for t in [self.relin, *self.galois.values()])

    def galois_key(self, step: int) -> tuple[int, torch.Tensor]:
        """(Galois element, key) of a left rotation by ``step`` (KeyMismatchError if not uploaded)."""
        elt = galois_elt(step, self.params.slots)
        if elt not in self.galois:
            raise KeyMismatchError(f"no Galois key for rotation step {step % self.params.slots}")
        return elt, self.galois[elt]


def _stack(comps: list[sealio.RawCiphertext], ctx: RNSContext, device: torch.device) -> torch.Tensor:
    """Decomposition components -> [K, 2, K+1, N] int64 (residues checked below their primes)."""
    if len(comps) != ctx.K or any(c.data.shape != (2, ctx.K + 1, ctx.n) for c in comps):
        raise WireError("key-switching key of unexpected shape")
    if any(c.parms_id != ctx.parms_ids.get(ctx.K + 1, c.parms_id) for c in comps):
        raise KeyMismatchError("key made for another prime chain")
    arr = np.stack([c.data for c in comps])
    if np.any(arr >= np.asarray(ctx.primes, dtype=np.uint64).reshape(1, 1, -1, 1)):
        raise WireError("key residue out of range")
    return torch.from_numpy(arr.astype(np.int64)).to(device)


def _table_bound(ctx: RNSContext, entries: int) -> int:
    """Decompressed bytes a key table of ``entries`` keys may take (refuse more: zip bombs)."""
    return 8 * 2 * ctx.n + entries * ctx.K * (2 * (ctx.K + 1) * ctx.n * 8 + 512) + 4096


def load_keys(ctx: RNSContext, blobs: Mapping[str, bytes], rotation_steps: Iterable[int],
              fingerprint: str | None = None) -> GpuKeys:
    """Untrusted SEAL key payloads -> :class:`GpuKeys` on ``ctx.device``."""
    server = wire.keys_from_payloads(blobs, ctx.kit, rotation_steps)
    relin = sealio.read_kswitch_keys(seal.to_bytes(server.relin), ctx.n, _table_bound(ctx, 1))
    steps = server.rotation_steps
    gal = sealio.read_kswitch_keys(seal.to_bytes(server.galois), ctx.n, _table_bound(ctx, len(steps) + 1))
    if set(relin) != {0}:
        raise WireError("relinearization keys must hold exactly the key of s^2")
    galois = {2 * index + 1: _stack(comps, ctx, ctx.device) for index, comps in gal.items()}
    return GpuKeys(ctx.kit.params, _stack(relin[0], ctx, ctx.device), galois, steps,
                   fingerprint or server.fingerprint)


__all__ = ["GpuKeys", "load_keys"]
