"""Whole offload linear steps as one CUDA graph each (issue 17: a step was ~11-20 ms of launches).

An offload step (``mlp_up``, ``mlp_down``, ``attn_qkv``, ``attn_o``: an :class:`fhe.linalg.EncodedMatvec`
then a mod-switch) is a fixed sequence of some thousand kernels for a given input shape: its plaintexts
stay put, only the ciphertexts and the session's keys change. :class:`StepGraphs` runs it through the
:class:`~fhe.backends.gpu.batched.BatchedEvaluator` (one ciphertext is a batch of one; B ciphertexts,
a step's several positions or several sessions' steps, one batch) and captures it once per
(step, batch size, input shape and scale) as a CUDA graph that reads

* its input from a static buffer (the rows are copied in), and
* its keys from static buffers per batch size (``[B, Lk, 2, Lk+1, N]`` per Galois element), filled from
  the rows' key sets only when they change (the same sessions stepping layer after layer copy nothing),

so the graphs belong to the worker, not to a session: one capture per step and batch size for the
worker's life. Batch sizes are rounded up to a power of two (padded rows compute on zeros, dropped), so
a prefill of any length reuses a few graphs. A replay computes the same kernels on the same canonical
residues as the eager batched path, which computes the one-session path's residues (SEAL's, bit for
bit: tests/fhe/test_gpu_backend_step.py, bench/gpu_step.py on the GPU).

Off CUDA (the CPU reference, CI) :meth:`StepGraphs.run` is the eager batched path, the same code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fhe.backends.gpu.batched import BatchedEvaluator, BatchKeys, GpuBatch
from fhe.backends.gpu.evaluator import GpuCiphertext, GpuEvaluator
from fhe.backends.gpu.keys import GpuKeys
from fhe.errors import KeyMismatchError, ShapeError

#: ``fn(ev, batch, keys) -> GpuBatch | list[GpuBatch]``: one step on a batch, every operation through ``ev``
StepFn = Callable[[BatchedEvaluator, GpuBatch, BatchKeys], object]


def bucket(count: int) -> int:
    """The batch size a step of ``count`` ciphertexts runs at (the next power of two)."""
    return 1 << max(count - 1, 0).bit_length()


@dataclass
class _Captured:
    graph: object
    inp: torch.Tensor                  # [B, size, L, N] static input
    outs: list[torch.Tensor]           # static outputs [B, size, L', N]
    scales: list[float]
    single: bool                       # fn returned one batch, not a list


@dataclass
class _StaticKeys:
    keys: BatchKeys                    # static buffers the graphs of this batch size read
    rows: tuple                        # the GpuKeys last copied in, row by row (strong references)


class StepGraphs:
    """Linear steps of one evaluator's plaintexts, captured per (name, batch size, shape, scale)."""

    def __init__(self, ev: GpuEvaluator, graphs: bool = True) -> None:
        self.ev = ev
        self.bev = BatchedEvaluator(ev)
        self.cuda = graphs and ev.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self._graphs: dict[tuple, _Captured] = {}
        self._keys: dict[tuple, _StaticKeys] = {}
        #: graph replays and captures so far (what the benchmark and the tests read)
        self.replays = 0
        self.captures = 0
        self.capture_s = 0.0                    # wall seconds spent in warm-ups and captures

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, name, fn: StepFn, cts: Sequence[GpuCiphertext],
            keys: GpuKeys | Sequence[GpuKeys]) -> list[list[GpuCiphertext]]:
        """``fn`` on every ciphertext of ``cts`` (one size, level and scale) -> per input, its outputs.

        ``keys``: one key set for all rows (a step's positions) or one per row (several sessions).
        ``name`` identifies ``fn`` (its plaintexts): the same name must always mean the same step.
        """
        if not cts:
            raise ShapeError("a step of no ciphertexts")
        rows = [keys] * len(cts) if isinstance(keys, GpuKeys) else list(keys)
        if len(rows) != len(cts):
            raise ShapeError(f"{len(cts)} ciphertexts but {len(rows)} key sets")
        batch = self.bev.stack(cts)
        if not self.cuda:
            bkeys = BatchKeys.shared(rows[0], len(cts)) if isinstance(keys, GpuKeys) else BatchKeys.of(rows)
            return self._split(fn(self.bev, batch, bkeys), len(cts))
        size = bucket(len(cts))
        static = self._static_keys(size, rows)
        key = (name, size, tuple(batch.data.shape[1:]), batch.scale, self._signature(rows[0]))
        cap = self._graphs.get(key)
        if cap is None:
            cap = self._graphs[key] = self._capture(fn, size, batch, static.keys)
        cap.inp[: len(cts)].copy_(batch.data)
        cap.graph.replay()
        self.replays += 1
        outs = [GpuBatch(o[: len(cts)].clone(), s) for o, s in zip(cap.outs, cap.scales, strict=True)]
        return self._split(outs[0] if cap.single else outs, len(cts))

    # --- internals -----------------------------------------------------------------------------------
    @staticmethod
    def _signature(keys: GpuKeys) -> tuple:
        return tuple(sorted((e, tuple(t.shape)) for e, t in keys.galois.items()))

    def _static_keys(self, size: int, rows: list[GpuKeys]) -> _StaticKeys:
        """The static key buffers of batch size ``size`` holding ``rows`` (padded with the first row)."""
        sig = self._signature(rows[0])
        if any(self._signature(k) != sig or k.params != self.ev.params for k in rows[1:]):
            raise KeyMismatchError("the rows' key sets differ in parameters or Galois elements")
        slot = self._keys.get((size, sig))
        if slot is None:
            galois = {e: torch.empty((size, *t.shape), dtype=t.dtype, device=t.device)
                      for e, t in rows[0].galois.items()}
            slot = self._keys[(size, sig)] = _StaticKeys(BatchKeys(self.ev.params, galois, size), ())
        padded = tuple(rows) + (rows[0],) * (size - len(rows))
        if len(slot.rows) != size or any(a is not b for a, b in zip(slot.rows, padded, strict=True)):
            for e, buf in slot.keys.galois.items():
                if all(k is padded[0] for k in padded):
                    buf.copy_(padded[0].galois[e].expand_as(buf))
                else:
                    torch.stack([k.galois[e] for k in padded], out=buf)
            slot.rows = padded
        return slot

    def _capture(self, fn: StepFn, size: int, batch: GpuBatch, keys: BatchKeys) -> _Captured:
        t0 = time.perf_counter()
        try:
            return self._capture_now(fn, size, batch, keys)
        finally:
            self.capture_s += time.perf_counter() - t0

    def _capture_now(self, fn: StepFn, size: int, batch: GpuBatch, keys: BatchKeys) -> _Captured:
        inp = torch.zeros((size, *batch.data.shape[1:]), dtype=batch.data.dtype, device=batch.data.device)
        inp[: batch.batch].copy_(batch.data)
        static = GpuBatch(inp, batch.scale)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                        # warm-up: Triton compiles, tables and caches fill
            fn(self.bev, static, keys)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            res = fn(self.bev, static, keys)
        single = isinstance(res, GpuBatch)
        outs = [res] if single else list(res)
        self.captures += 1
        return _Captured(graph, inp, [o.data for o in outs], [o.scale for o in outs], single)

    @staticmethod
    def _split(res, count: int) -> list[list[GpuCiphertext]]:
        outs = [res] if isinstance(res, GpuBatch) else list(res)
        return [[GpuCiphertext(o.data[i], o.scale) for o in outs] for i in range(count)]


__all__ = ["StepFn", "StepGraphs", "bucket"]
