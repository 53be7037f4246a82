"""Whole steps (an attention block's decode step) as one CUDA graph each (issue 16: the host fed ~10,000 launches).

A decode step at context 128 was ~9,900 kernels and 59.6 ms of device time in 78.7 ms of wall (H100, session
16): the rest was the host issuing launches. :class:`WholeSteps` runs a step — ``body(ev, inputs) ->
outputs``, any code that reaches the device only through the evaluator — as one graph replay:

1. **Shadow run.** ``body`` runs on a :class:`~fhe.backends.gpu.shadow.ShadowEvaluator` (metadata only, no
   device work): it yields the plaintexts the step encodes at this position (RoPE weights, beta, the
   polynomial's constants), in order, and the step's signature (every operation, operand, level, size,
   scale and rotation step; the plaintexts read but not encoded, by identity).
2. **Encode.** Those values are encoded for real (batched per level and scale, ``encode_many``: the same
   residues as ``encode``) and copied into the graph's static plaintexts.
3. **Replay** the graph of (key shapes, signature), captured on its :data:`CAPTURE_AFTER`-th use (before, the
   same fed run without a graph): ``body`` warmed up, then captured
   on the real evaluator with its key-switch graphs off (the same kernels: the plain launches are what the
   graphs replay) and its encodes answered from the static plaintexts in order. Inputs (the fresh
   ciphertext, the session's cache blocks) are copied into static buffers shared by the key set's graphs,
   one per input slot, and only when the slot does not already hold that tensor (a session stepping on
   rewrites only its last cache block). Outputs are cloned out of the graph's pool.

Same kernels on the same inputs and plaintexts, so the same residues as the eager step (tests check it).
A step whose operations differ in anything but encoded values has another signature, hence another graph:
a replay never runs operations the step would not. ``rotate_many``'s host test (a zero digit makes the
hoisted result differ from SEAL's: probability ~N·L/2^50) becomes a device flag read after the replay; if
set, the step runs again eagerly (which rotates one by one there).

Keys are static too, as for the offload steps (:mod:`fhe.backends.gpu.step`): one static key set per key
shapes, which a session's keys are copied into when another session's were there last (the shipped set is
1.32 GB: ~0.8 ms of copy at an H100's bandwidth, estimated), so a graph serves every session's steps of its
signature and is captured once per evaluator, not per session. Static input and plaintext buffers are shared
by all graphs (one per input or encode position and shape: replays run one at a time), outputs are per graph
in one memory pool. At most :data:`MAX_GRAPHS` graphs (least recently used dropped). Off CUDA
(``GpuEvaluator(..., step_graphs=True)`` on the CPU reference) the same shadow run, encodes and fed run happen
without a graph: what CI checks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fhe.backends.gpu.shadow import ShadowCiphertext, ShadowEvaluator
from fhe.errors import KeyMismatchError, ShapeError

#: Whole-step graphs on by default on CUDA (``GpuEvaluator(step_graphs=...)`` overrides; benchmarks flip it).
STEP_GRAPHS = True
#: Graphs kept per evaluator (a layer's decode steps have ~2 signatures per cache block count; least recently
#: used dropped beyond this).
MAX_GRAPHS = 256
#: A signature is captured on its CAPTURE_AFTER-th use, and runs eagerly (the same fed run, no graph) before:
#: a capture costs ~0.65 s (H100, shipped plan) and saves 0-70 ms a step, so steps that occur once per session
#: (a cache block's first and last rows) are not captured until other sessions repeat them.
CAPTURE_AFTER = 3

#: ``body(ev, inputs, keys) -> outputs``: a step, every device operation through ``ev``, inputs left unchanged
StepBody = Callable[[object, list, object], Sequence]


@dataclass
class _Slot:
    buf: torch.Tensor
    held: tuple = ()                    # (tensor, its version) last copied in: a strong reference


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    outs: list                          # per output: an input index (passed through) or a static GpuCiphertext
    flag: torch.Tensor | None           # rotate_many saw a zero digit
    external: list                      # plaintexts the graph reads that the step did not encode


@dataclass
class _StaticKeys:
    keys: object                        # a GpuKeys whose tensors are static buffers (what the graphs read)
    held: object = None                 # the key set last copied in (a strong reference)


class WholeSteps:
    """Steps of one :class:`~fhe.backends.gpu.evaluator.GpuEvaluator` as graph replays (module docstring)."""

    def __init__(self, ev) -> None:
        self.ev = ev
        self.cuda = ev.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self._graphs: dict[tuple, _Graph] = {}          # (key shapes, signature) -> graph, least recently used first
        self._slots: dict[tuple, _Slot] = {}            # (kind, index, shape) -> static buffer
        self._keys: dict[tuple, _StaticKeys] = {}       # key shapes -> static key set
        self._seen: dict[tuple, int] = {}               # signature -> uses while not captured
        #: counters the benchmark and the tests read (eager: fed runs without a graph)
        self.replays = 0
        self.eager = 0
        self.captures = 0
        self.fallbacks = 0
        self.key_copies = 0
        self.capture_s = 0.0

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, body: StepBody, inputs: list, keys) -> list:
        """``body(ev, inputs, keys)``'s outputs (new ciphertexts, or the very input objects it passed through)."""
        sh = ShadowEvaluator(self.ev)
        souts = list(body(sh, [sh.input(*ct.data.shape[:2], ct.scale) for ct in inputs], keys))
        # an output that is an unchanged input (uid j + 1) is passed through, the others come from the graph
        outs = tuple(o.uid - 1 if isinstance(o, ShadowCiphertext) and o.uid <= len(inputs) else None
                     for o in souts)
        pts = self._encode(sh.encodes)
        sig = (self._key_shapes(keys), sh.signature(), outs)
        g = self._graphs.pop(sig, None)
        if g is None and (not self.cuda or self._count(sig) < CAPTURE_AFTER):
            return self._eager_fed(body, inputs, pts, keys, sh.hoisted, outs)
        if g is None:
            self._seen.pop(sig, None)
            g = self._capture(body, inputs, pts, self._static_keys(keys).keys, sh, outs)
            while len(self._graphs) >= MAX_GRAPHS:
                self._graphs.pop(next(iter(self._graphs)))
        else:
            self._static_keys(keys)
        self._graphs[sig] = g                                          # most recently used last
        return self._replay(g, body, inputs, pts, keys)

    def _count(self, sig: tuple) -> int:
        """Uses of ``sig`` so far, this one included (the counts are bounded like the graphs)."""
        n = self._seen.pop(sig, 0) + 1
        while len(self._seen) >= 4 * MAX_GRAPHS:
            self._seen.pop(next(iter(self._seen)))
        self._seen[sig] = n
        return n

    # --- encodes ------------------------------------------------------------------------------------------
    def _encode(self, requests) -> list:
        """The step's plaintexts for real: runs of one (level, scale) in one ``encode_many``."""
        out: list = []
        i = 0
        while i < len(requests):
            j = i
            while j < len(requests) and (requests[j].level, requests[j].scale) == (requests[i].level,
                                                                                   requests[i].scale):
                j += 1
            out += self.ev.encode_many([r.values for r in requests[i:j]], requests[i].level, requests[i].scale)
            i = j
        return out

    # --- the fed run (warm-up, capture, and the CPU path) ---------------------------------------------------
    def _fed(self, body: StepBody, data: list, inputs: list, plaintexts: list, keys, flag, outs: tuple) -> list:
        """``body`` on the real evaluator, its encodes answered by ``plaintexts`` in order."""
        from fhe.backends.gpu.evaluator import GpuCiphertext

        wrapped = [GpuCiphertext(d, ct.scale) for d, ct in zip(data, inputs, strict=True)]
        ev = self.ev
        ev._feed, ev._zero_flag = iter(plaintexts), flag
        try:
            if flag is not None:
                flag.zero_()
            res = list(body(ev, wrapped, keys))
            if next(ev._feed, None) is not None:
                raise ShapeError("a captured step encodes fewer plaintexts than its shadow run did")
        finally:
            ev._feed = ev._zero_flag = None
        # passed through: the very input, unchanged (an input relabelled or replaced in place is a new output,
        # as the shadow's new uid says; its residues then come out of the graph like any other output's)
        passed = [next((j for j, w in enumerate(wrapped)
                        if o is w and o.data is data[j] and o.scale == inputs[j].scale), None) for o in res]
        if passed != list(outs):
            raise ShapeError("a step's outputs pass other inputs through than its shadow run's")
        return [o if j is None else j for o, j in zip(res, passed, strict=True)]

    def _eager_fed(self, body: StepBody, inputs: list, pts: list, keys, hoisted: bool, outs: tuple) -> list:
        flag = torch.zeros((), dtype=torch.bool, device=self.ev.device) if hoisted else None
        res = self._fed(body, [ct.data for ct in inputs], inputs, pts, keys, flag, outs)
        if flag is not None and bool(flag):
            self.fallbacks += 1
            return list(body(self.ev, inputs, keys))
        self.eager += 1
        return [inputs[o] if isinstance(o, int) else o for o in res]

    # --- static buffers -----------------------------------------------------------------------------------
    def _slot(self, kind: str, index: int, like: torch.Tensor) -> _Slot:
        key = (kind, index, tuple(like.shape))
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _Slot(torch.empty_like(like))
        return slot

    def _fill(self, inputs: list, pts: list) -> tuple[list[torch.Tensor], list]:
        """The static buffers, holding ``inputs``' residues (copied only where a slot does not already hold
        that tensor) and ``pts``' (always: they change per step; one multi-tensor copy)."""
        from fhe.backends.gpu.evaluator import GpuPlaintext

        bufs = []
        for j, ct in enumerate(inputs):
            slot = self._slot("ct", j, ct.data)
            if not slot.held or slot.held[0] is not ct.data or slot.held[1] != ct.data._version:
                slot.buf.copy_(ct.data)
                slot.held = (ct.data, ct.data._version)
            bufs.append(slot.buf)
        static_pts = [GpuPlaintext(self._slot("pt", i, p.data).buf, p.scale) for i, p in enumerate(pts)]
        if pts:
            torch._foreach_copy_([p.data for p in static_pts], [p.data for p in pts])
        return bufs, static_pts

    @staticmethod
    def _key_shapes(keys) -> tuple:
        return (tuple(keys.relin.shape), tuple(sorted((e, tuple(t.shape)) for e, t in keys.galois.items())))

    def _static_keys(self, keys) -> _StaticKeys:
        """The static key set of ``keys``' shapes, holding ``keys`` (copied in only when another set was):
        graphs are shared by every session's steps of one shape, as the offload steps' (step.py) are."""
        from fhe.backends.gpu.keys import GpuKeys

        if keys.params != self.ev.params:
            raise KeyMismatchError("keys for other parameters than this evaluator's")
        shapes = self._key_shapes(keys)
        st = self._keys.get(shapes)
        if st is None:
            static = GpuKeys(keys.params, torch.empty_like(keys.relin),
                             {e: torch.empty_like(t) for e, t in keys.galois.items()},
                             keys.rotation_steps, "static")
            st = self._keys[shapes] = _StaticKeys(static)
        if st.held is not keys:
            st.keys.relin.copy_(keys.relin)
            for e, t in keys.galois.items():
                st.keys.galois[e].copy_(t)
            for (elt, lev), buf in st.keys.corrections.items():   # hoisting corrections the graphs read
                buf.copy_(self.ev._correction(keys, elt, keys.galois[elt], self.ev.ctx.level(lev)))
            st.held = keys
            self.key_copies += 1
        return st

    # --- graphs -------------------------------------------------------------------------------------------
    def _capture(self, body: StepBody, inputs: list, pts: list, keys, sh: ShadowEvaluator, outs: tuple) -> _Graph:
        t0 = time.perf_counter()
        bufs, static_pts = self._fill(inputs, pts)
        flag = torch.zeros((), dtype=torch.bool, device=self.ev.device) if sh.hoisted else None
        saved, self.ev.graphs = self.ev.graphs, None            # plain launches inside: no nested replays
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):                        # warm-up: Triton compiles, tables and caches fill
                self._fed(body, bufs, inputs, static_pts, keys, flag, outs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                res = self._fed(body, bufs, inputs, static_pts, keys, flag, outs)
        finally:
            self.ev.graphs = saved
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
        return _Graph(graph, res, flag, list(sh.external.values()))

    def _replay(self, g: _Graph, body: StepBody, inputs: list, pts: list, keys) -> list:
        from fhe.backends.gpu.evaluator import GpuCiphertext

        self._fill(inputs, pts)
        g.graph.replay()
        if g.flag is not None and bool(g.flag):                # a zero digit: SEAL's result needs the slow path
            self.fallbacks += 1
            return list(body(self.ev, inputs, keys))
        self.replays += 1
        return [inputs[o] if isinstance(o, int) else GpuCiphertext(o.data.clone(), o.scale) for o in g.outs]


__all__ = ["MAX_GRAPHS", "STEP_GRAPHS", "StepBody", "WholeSteps"]
