"""Evaluation keys of one client key set, expanded once on the CPU and kept on the device.

The upload (SEAL's seeded, compressed form) goes through the SEAL backend's allow-list and SEAL's
own validation (:func:`fhe.backends.seal.wire.keys_from_payloads`), is saved again by SEAL (now
expanded: the seeded half regenerated) and parsed into tensors ``[Lk, 2, Lk+1, N]`` per key: the
decomposition components of the Lk data primes of the key's chain, the key's two polynomials, every
prime of that chain (rows 0..Lk-1, then the special prime). A full-chain key has Lk = K; a level-aware
key (``galois_keys@L``, docs/protocol.md) has Lk = L and switches any ciphertext at a level <= L
(its rows are the same primes in the same order, so the kernels read it unchanged).
Device memory per key: ``2 Lk (Lk+1) N 8`` bytes (81.8 MB at N = 32768, Lk = 12; see docs/fhe.md).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from fhe import sealio
from fhe.backends.gpu.galois import galois_elt
from fhe.backends.gpu.rns import RNSContext
from fhe.backends.seal import hazmat as seal
from fhe.backends.seal import wire
from fhe.backends.seal.keys import ServerKeys
from fhe.errors import KeyMismatchError, LevelError, WireError
from fhe.params import CKKSParams, KeyLevels


@dataclass
class GpuKeys:
    """The gpu backend's :class:`fhe.evaluator.EvalKeys`: relin key and Galois keys as device tensors."""

    backend: ClassVar[str] = "gpu"
    params: CKKSParams
    relin: torch.Tensor                           # [Lr, 2, Lr+1, N]
    galois: dict[int, torch.Tensor]               # Galois element -> [Lk, 2, Lk+1, N]
    rotation_steps: tuple[int, ...]
    fingerprint: str
    #: per (galois element, level): the hoisting correction (keyswitch.hoisted_correction)
    corrections: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False)
    #: CUDA graphs of whole rotations/relinearizations with these keys (gpu.graphs.GraphCache, made on use)
    graphs: object | None = field(default=None, repr=False)

    def nbytes(self) -> int:
        """Device bytes of the expanded keys (what a worker's key budget counts)."""
        return sum(t.numel() * 8 for t in [self.relin, *self.galois.values()])

    def galois_key(self, step: int, level: int | None = None) -> tuple[int, torch.Tensor]:
        """(Galois element, key) of a left rotation by ``step`` of a ciphertext at ``level``.

        Raises:
            KeyMismatchError: no key for ``step``. LevelError: its key was made below ``level``.
        """
        elt = galois_elt(step, self.params.slots)
        if elt not in self.galois:
            raise KeyMismatchError(f"no Galois key for rotation step {step % self.params.slots}")
        key = self.galois[elt]
        if level is not None and level > key.shape[0]:
            raise LevelError(f"rotation by {step} at level {level}: its key serves levels <= {key.shape[0]}")
        return elt, key

    def relin_key(self, level: int) -> torch.Tensor:
        """The relinearization key for a ciphertext at ``level`` (LevelError if made below it)."""
        if level > self.relin.shape[0]:
            raise LevelError(f"relinearization at level {level}: the key serves levels <= {self.relin.shape[0]}")
        return self.relin


def key_nbytes(n: int, level: int) -> int:
    """Device bytes of one expanded key made at ``level`` (Lk data primes)."""
    return 2 * level * (level + 1) * n * 8


def key_set_nbytes(params: CKKSParams, levels: KeyLevels) -> int:
    """Device bytes of a whole key set (relin + one Galois key per step at its level): what a worker's
    device key budget is divided by, known before any key arrives."""
    n = params.poly_modulus_degree
    return key_nbytes(n, levels.relin) + sum(key_nbytes(n, lv) for _, lv in levels.galois)


def _stack(comps: list[sealio.RawCiphertext], ctx: RNSContext, level: int, device: torch.device) -> torch.Tensor:
    """Decomposition components of a key made at ``level`` -> [Lk, 2, Lk+1, N] int64 (residues checked
    below their primes, parms_id = the key chain's)."""
    if len(comps) != level or any(c.data.shape != (2, level + 1, ctx.n) for c in comps):
        raise WireError("key-switching key of unexpected shape")
    pid = struct.pack("<4Q", *ctx.kit.key_context(level).key_parms_id)
    if any(c.parms_id != pid for c in comps):
        raise KeyMismatchError("key made for another prime chain")
    arr = np.stack([c.data for c in comps])
    primes = ctx.primes[:level] + ctx.primes[-1:]
    if np.any(arr >= np.asarray(primes, dtype=np.uint64).reshape(1, 1, -1, 1)):
        raise WireError("key residue out of range")
    return torch.from_numpy(arr.astype(np.int64)).to(device)


def _table_bound(ctx: RNSContext, entries: int, level: int) -> int:
    """Decompressed bytes a key table of ``entries`` keys may take (refuse more: zip bombs)."""
    return 8 * 2 * ctx.n + entries * level * (2 * (level + 1) * ctx.n * 8 + 512) + 4096


def _read_table(obj, ctx: RNSContext, entries: int, level: int) -> dict[int, list[sealio.RawCiphertext]]:
    return sealio.read_kswitch_keys(seal.to_bytes(obj), ctx.n, _table_bound(ctx, entries, level))


def keys_from_server(ctx: RNSContext, server: ServerKeys) -> GpuKeys:
    """SEAL keys already through the allow-list (:class:`ServerKeys`, full or level-aware) -> :class:`GpuKeys`
    on ``ctx.device``."""
    levels = server.levels
    relin = _read_table(server.relin, ctx, 1, levels.relin)
    if set(relin) != {0}:
        raise WireError("relinearization keys must hold exactly the key of s^2")
    galois: dict[int, torch.Tensor] = {}
    for level, gk in server.galois_levels.items():
        table = _read_table(gk, ctx, len(levels.steps_at(level)) + 1, level)
        galois |= {2 * index + 1: _stack(comps, ctx, level, ctx.device) for index, comps in table.items()}
    return GpuKeys(ctx.kit.params, _stack(relin[0], ctx, levels.relin, ctx.device), galois,
                   server.rotation_steps, server.fingerprint)


def load_keys(ctx: RNSContext, blobs: Mapping[str, bytes], rotation_steps: Iterable[int] | KeyLevels,
              fingerprint: str | None = None) -> GpuKeys:
    """Untrusted SEAL key payloads (full, or level-aware when ``rotation_steps`` is a KeyLevels) ->
    :class:`GpuKeys` on ``ctx.device``."""
    server = wire.keys_from_payloads(blobs, ctx.kit, rotation_steps, fingerprint=fingerprint)
    return keys_from_server(ctx, server)


__all__ = ["GpuKeys", "key_nbytes", "key_set_nbytes", "keys_from_server", "load_keys"]
