"""CUDA graphs of the key switch's fixed-shape halves (issue 16: the evaluator was launch-bound).

A key switch at level L is ~320 kernel launches; all but one (the inner product with the key, whose
tensor differs per key) have shapes fixed by L alone: the decomposition (INTT of the digits, their
reduction into every prime, the NTTs) and the finish (the special prime divided out). Each is captured
once per level and replayed: one launch instead of ~150, the same kernels, so the same residues.

A graph reads its input from a static buffer and writes its outputs to static buffers: a replay
overwrites the last one's outputs, so callers consume (or copy) them before the next replay of the same
graph. All graphs of one evaluator share one memory pool: they run one at a time on one stream, and
their outputs stay referenced, so no capture reuses another graph's live output.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class _Graph:
    """One captured call of ``fn`` on a static copy of an example input."""

    def __init__(self, fn: Callable, example: torch.Tensor, pool) -> None:
        self.inp = example.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                       # warm-up: Triton compiles, the allocator settles
            fn(self.inp)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = fn(self.inp)

    def __call__(self, x: torch.Tensor):
        self.inp.copy_(x)
        self.graph.replay()
        return self.out


class GraphCache:
    """Captured graphs by (name, input shape), made on first use."""

    def __init__(self, pool=None) -> None:
        self.pool = torch.cuda.graph_pool_handle() if pool is None else pool
        self._graphs: dict[tuple, _Graph] = {}

    def run(self, name: str | tuple, fn: Callable, x: torch.Tensor):
        """``fn(x)`` through the graph of (``name``, x's shape); ``fn`` must depend on nothing else that
        changes between calls (its tables are fixed per level)."""
        key = (name, tuple(x.shape))
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = _Graph(fn, x, self.pool)
        return graph(x)

    def __len__(self) -> int:
        return len(self._graphs)


__all__ = ["GraphCache"]
