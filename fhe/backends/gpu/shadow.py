"""A metadata-only evaluator: a step's Python code run without device work (issue 16, whole-step graphs).

A decode step replayed as one CUDA graph (:mod:`fhe.backends.gpu.whole_step`) needs, before each replay,

* the plaintexts the step encodes (their values change with the position: RoPE weights, beta, the
  polynomial's constants), in the order the step asks for them, and
* a signature of everything else the step does — every operation in order, with its operands (which
  earlier result, which input, which encode, which plaintext it did not encode), sizes, levels, scales and
  rotation steps — so that a replay is only ever of a graph captured from the same operations.

:class:`ShadowEvaluator` gets both by running the same code on ciphertexts that carry only
(size, level, scale). Its scale arithmetic is :class:`~fhe.backends.gpu.evaluator.GpuEvaluator`'s (the same
double operations), so the encodes it records carry the levels and scales the real run asks for. It checks
nothing: the real run (the capture) makes every check the eager path makes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fhe.evaluator import ParamsQueries


@dataclass(eq=False)
class ShadowCiphertext:
    """A ciphertext's metadata; ``uid`` names the value (an in-place operation makes a new one)."""

    uid: int
    size: int
    level: int
    scale: float


@dataclass(eq=False)
class ShadowPlaintext:
    """The ``index``-th plaintext the step encodes."""

    index: int
    level: int
    scale: float


@dataclass
class EncodeRequest:
    """One vector the step encodes (what the real encoder gets before the replay)."""

    values: np.ndarray | torch.Tensor
    level: int
    scale: float


class ShadowEvaluator(ParamsQueries):
    """The evaluator protocol on metadata (see the module docstring); ``real`` gives parameters and primes.

    Attributes:
        trace: one tuple per operation (name, operand references, the metadata the result depends on).
        encodes: the step's encode requests, in order.
        external: plaintexts the step read but did not encode, by id (the graph keeps them alive).
        hoisted: whether the step used :meth:`rotate_many` (its replay reads the zero-digit flag).
    """

    def __init__(self, real) -> None:
        self.name = real.name
        self.params = real.params
        self.device = real.device
        self._primes = [float(q) for q in real.ctx.primes]
        self.trace: list[tuple] = []
        self.encodes: list[EncodeRequest] = []
        self.external: dict[int, object] = {}
        self.hoisted = False
        self._next = 0

    # --- inputs and bookkeeping ---------------------------------------------------------------------
    def input(self, size: int, level: int, scale: float) -> ShadowCiphertext:
        """A step input (its uid is its position among the inputs; its metadata goes into the trace)."""
        ct = self._new(size, level, scale)
        self.trace.append(("input", ct.uid, size, level, scale))
        return ct

    def signature(self) -> tuple:
        """Everything the step did but the values it encoded: equal signatures, equal graphs."""
        return tuple(self.trace)

    def _new(self, size: int, level: int, scale: float) -> ShadowCiphertext:
        self._next += 1
        return ShadowCiphertext(self._next, size, level, float(scale))

    def _ref(self, pt) -> tuple:
        if isinstance(pt, ShadowPlaintext):
            return ("enc", pt.index)
        self.external[id(pt)] = pt
        return ("ext", id(pt))

    def _op(self, name: str, *operands, extra=()) -> None:
        refs = tuple(o.uid if isinstance(o, ShadowCiphertext) else self._ref(o) for o in operands)
        self.trace.append((name, refs, extra))

    def _result(self, name: str, operands: Sequence, size: int, level: int, scale: float,
                extra=()) -> ShadowCiphertext:
        out = self._new(size, level, scale)
        self._op(name, *operands, extra=(out.uid, size, level, out.scale, *extra))
        return out

    def _renew(self, ct: ShadowCiphertext, name: str, *operands) -> None:
        """An in-place operation on ``ct``: a new value under the same object."""
        self._next += 1
        ct.uid = self._next
        self._op(name, *operands, extra=(ct.uid, ct.size, ct.level, ct.scale))

    # --- queries -------------------------------------------------------------------------------------
    def prime(self, level: int) -> float:
        return self._primes[level - 1]

    def level(self, ct) -> int:
        return ct.level

    def scale_of(self, ct) -> float:
        return ct.scale

    def size(self, ct) -> int:
        return ct.size

    def nbytes(self, ct) -> int:
        return ct.size * ct.level * self.params.poly_modulus_degree * 8

    def set_scale(self, ct: ShadowCiphertext, scale: float) -> None:
        ct.scale = float(scale)
        self._renew(ct, "set_scale")

    # --- encoding --------------------------------------------------------------------------------------
    def encode(self, values, level: int, scale: float) -> ShadowPlaintext:
        self.encodes.append(EncodeRequest(values, int(level), float(scale)))
        return ShadowPlaintext(len(self.encodes) - 1, int(level), float(scale))

    def encode_many(self, values, level: int, scale: float) -> list[ShadowPlaintext]:
        return [self.encode(v, level, scale) for v in values]

    # --- arithmetic (GpuEvaluator's metadata rules) ---------------------------------------------------
    def add(self, a, b) -> ShadowCiphertext:
        return self._result("add", (a, b), max(a.size, b.size), a.level, a.scale)

    def add_inplace(self, a, b) -> None:
        a.size = max(a.size, b.size)
        self._renew(a, "add_inplace", b)

    def add_many(self, cts) -> ShadowCiphertext:
        return self._result("add_many", cts, max(c.size for c in cts), cts[0].level, cts[0].scale)

    def add_plain(self, ct, pt) -> ShadowCiphertext:
        return self._result("add_plain", (ct, pt), ct.size, ct.level, ct.scale)

    def add_plain_inplace(self, ct, pt) -> None:
        self._renew(ct, "add_plain_inplace", pt)

    def mul_plain(self, ct, pt) -> ShadowCiphertext:
        return self._result("mul_plain", (ct, pt), ct.size, ct.level, ct.scale * pt.scale)

    def dot_plain(self, pairs) -> ShadowCiphertext:
        c0, p0 = pairs[0]
        flat = [x for pair in pairs for x in pair]
        return self._result("dot_plain", flat, max(c.size for c, _ in pairs), c0.level, c0.scale * p0.scale)

    def mul(self, a, b) -> ShadowCiphertext:
        return self._result("mul", (a, b), 3, a.level, a.scale * b.scale)

    def square(self, ct) -> ShadowCiphertext:
        return self._result("square", (ct,), 3, ct.level, ct.scale * ct.scale)

    def relinearize(self, ct, keys) -> ShadowCiphertext:
        return self._result("relinearize", (ct,), 2, ct.level, ct.scale)

    def rescale(self, ct) -> ShadowCiphertext:
        return self._result("rescale", (ct,), ct.size, ct.level - 1, ct.scale / self.prime(ct.level))

    def rescale_inplace(self, ct) -> None:
        ct.scale = ct.scale / self.prime(ct.level)
        ct.level -= 1
        self._renew(ct, "rescale_inplace")

    def mod_switch(self, ct, level: int):
        if level == ct.level:
            return ct
        return self._result("mod_switch", (ct,), ct.size, level, ct.scale)

    def rotate(self, ct, step: int, keys):
        if step % self.slots == 0:
            return ct
        return self._result("rotate", (ct,), ct.size, ct.level, ct.scale, extra=(int(step) % self.slots,))

    def rotate_many(self, ct, steps: Iterable[int], keys) -> dict:
        steps = [int(s) for s in steps]
        todo = [s for s in steps if s % self.slots]
        out = {s: ct for s in steps if not s % self.slots}
        if todo:
            self.hoisted = True
            self._op("rotate_many", ct, extra=tuple(todo))
            out |= {s: self._result("hoisted", (ct,), ct.size, ct.level, ct.scale, extra=(s,)) for s in todo}
        return out


__all__ = ["EncodeRequest", "ShadowCiphertext", "ShadowEvaluator", "ShadowPlaintext"]
