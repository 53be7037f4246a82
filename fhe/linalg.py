"""Encrypted x plain linear algebra on CKKS slots: the diagonal method with baby-step/giant-step.

Every linear map here is a *slot map*: ``y[dst] = sum w * x[src]`` over a sparse list of
``(dst, src, w)`` triples on the S slots of one ciphertext. Grouping the triples by rotation offset
``r = src - dst (mod S)`` gives the generalized diagonals ``diag_r``, and

    y = sum_r diag_r * rot(x, r) = sum_G rot( sum_j rot(diag_{G+j}, -G) * rot(x, j), G )

with baby steps j (rotations of the input, shared) and giant steps G (one rotation per group).
The rotated diagonals are encoded once (:meth:`SlotMap.encode`), at the input's level and at scale
``q_l`` (the prime the following rescale drops), so the output comes back at the input's scale.
Everything runs through an :class:`fhe.evaluator.Evaluator` (any backend) and its opaque keys.

:class:`HybridMatvec` is the dense matrix x vector product used for the projections: the client
replicates ``x`` with period ``P`` over all slots, output ``o`` is accumulated in ``c`` partial sums
at slots ``s_o + k*w`` (``w = P/c`` offsets each, no rotation wraps a period), and ``log2 c``
rotate-and-adds fold them into ``s_o``. Cost: about ``2*sqrt(w) + log2(c)`` rotations and ``w``
plaintext multiplications for up to ``c``-fold fewer diagonals than the plain diagonal method.
See ``docs/fhe.md`` for the layouts and measured costs.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np

from fhe.errors import LevelError, ShapeError
from fhe.evaluator import Ciphertext, EvalKeys, Evaluator, encode_groups


def _signed(r: np.ndarray | int, slots: int):
    """Offsets mod S mapped to (-S/2, S/2] (shorter rotations read better; keys are the same)."""
    r = np.mod(r, slots)
    return np.where(r > slots // 2, r - slots, r)


def _bsgs_split(offsets: np.ndarray, slots: int) -> int:
    """Baby-step size b minimizing |baby steps| + |giant steps| for these offsets."""
    best_b, best_cost = 1, math.inf
    for b in range(1, max(2, int(math.isqrt(len(offsets) * 4)) + 2)):
        j = np.mod(offsets, b)
        cost = len(np.unique(j)) + len(np.unique(offsets - j))
        if cost < best_cost:
            best_b, best_cost = b, cost
    return best_b


@dataclass(frozen=True)
class Steps:
    """Few-key BSGS structure: every offset is ``pre + k*baby + j*mid + m*giant`` (k < n_baby, j < n_mid,
    m < n_giant).

    Babies are made by repeated rotation by ``baby`` (then, for j > 0, of those by ``mid``) and giants
    summed Horner-style by repeated rotation by ``giant``, so a map needs at most four Galois keys (pre,
    baby, mid, giant) whatever its number of diagonals; it costs ``(n_baby - 1) + n_baby (n_mid - 1) +
    (n_giant - 1) (+1 for pre)`` rotations. The middle dimension balances a map whose diagonals form a long
    arithmetic run: 9 x 64 offsets cost 8 + 63 = 71 rotations with ``giant = W``, 8 + 9 + 31 = 48 with
    ``mid = W, giant = 2W``.

    ``hoist``: the babies are instead each one rotation of the input by its own step ``pre + k*baby + j*mid``
    (``rotate_many``: one decomposition shared by all of them on a backend that hoists, issue 16): one Galois key
    per baby; the giants stay Horner with one key. ``giants_each`` (with ``hoist``): the giant sums are instead
    each one rotation by ``m*giant`` (``rotate_each``: one batch on a backend that has it), then one sum: one key
    per giant too.
    """

    pre: int
    baby: int
    n_baby: int
    giant: int = 0
    n_giant: int = 1
    mid: int = 0
    n_mid: int = 1
    hoist: bool = False
    giants_each: bool = False

    def baby_step(self, index: int) -> int:
        """The rotation of baby ``index`` (= k + n_baby * j)."""
        return self.pre + (index % self.n_baby) * self.baby + (index // self.n_baby) * self.mid

    def decompose(self, offsets: np.ndarray, slots: int) -> dict[int, tuple[int, int]]:
        """offset (mod S) -> (baby index k + n_baby * j, m); ShapeError if an offset has no decomposition."""
        table = {}
        for m in range(self.n_giant - 1, -1, -1):
            for j in range(self.n_mid - 1, -1, -1):
                for k in range(self.n_baby - 1, -1, -1):
                    off = self.pre + k * self.baby + j * self.mid + m * self.giant
                    table[off % slots] = (k + self.n_baby * j, m)
        out = {}
        for r in offsets:
            key = int(r) % slots
            if key not in table:
                raise ShapeError(f"offset {int(r)} is not pre + k*baby + j*mid + m*giant for {self}")
            out[int(r)] = table[key]
        return out

    def keys(self) -> set[int]:
        if self.hoist:
            ks = {self.baby_step(i) for i in range(self.n_baby * self.n_mid)}
            if self.giants_each:
                return (ks | {m * self.giant for m in range(self.n_giant)}) - {0}
            return (ks | ({self.giant} if self.n_giant > 1 else set())) - {0}
        ks = {self.pre} if self.pre else set()
        if self.n_baby > 1:
            ks.add(self.baby)
        if self.n_mid > 1:
            ks.add(self.mid)
        if self.n_giant > 1:
            ks.add(self.giant)
        return ks


#: the diagonal groups of recent slot maps by (slots, steps, dst, src): a plan's layers share their shapes,
#: so an offload worker's 28 layers compute each part's groups once (~3 s a layer on a 2-core box, issue 17)
_GROUPS: dict[tuple, dict[int, list[tuple[int, np.ndarray]]]] = {}
_GROUPS_MAX = 32


def _map_groups(slots: int, dst: np.ndarray, src: np.ndarray, steps: Steps | None
                ) -> dict[int, list[tuple[int, np.ndarray]]]:
    """Giant step m -> [(baby k, indices of the triples with that offset)] (from the slot indices alone)."""
    key = (slots, steps, hashlib.sha256(np.ascontiguousarray(dst, np.int64)).hexdigest(),
           hashlib.sha256(np.ascontiguousarray(src, np.int64)).hexdigest())
    if key in _GROUPS:
        return _GROUPS[key]
    off = _signed(src - dst, slots)
    uniq = np.unique(off)
    if steps is None:
        b = _bsgs_split(uniq, slots)
        km = {int(r): (int(np.mod(r, b)), int(r - np.mod(r, b))) for r in uniq}
    else:
        km = steps.decompose(uniq, slots)
    groups: dict[int, list[tuple[int, np.ndarray]]] = {}
    order = np.argsort(off, kind="stable")                        # indices of each offset, ascending
    bounds = np.searchsorted(off[order], uniq, side="left").tolist() + [len(off)]
    for i, r in enumerate(uniq):
        k, m = km[int(r)]
        groups.setdefault(m, []).append((k, order[bounds[i]:bounds[i + 1]]))
    if len(_GROUPS) >= _GROUPS_MAX:
        _GROUPS.pop(next(iter(_GROUPS)))
    _GROUPS[key] = groups
    return groups


@dataclass
class SlotMap:
    """A sparse linear map on the slots of one ciphertext, evaluated by BSGS.

    Args:
        slots: S.
        dst, src: int arrays [n] of slot indices; ``weight`` float array [n] (may be re-given per call
            through :meth:`encode`, e.g. RoPE coefficients that depend on the position).
        steps: a few-key :class:`Steps` structure, or None for free BSGS (one key per distinct step).
    """

    slots: int
    dst: np.ndarray
    src: np.ndarray
    weight: np.ndarray
    steps: Steps | None = None
    _groups: dict[int, list[tuple[int, np.ndarray]]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not (len(self.dst) == len(self.src) == len(self.weight)):
            raise ShapeError("dst, src and weight must have one entry per triple")
        if len(self.dst) and (self.dst.min() < 0 or self.dst.max() >= self.slots):
            raise ShapeError("dst slot out of range")
        self._groups = _map_groups(self.slots, self.dst, self.src, self.steps)

    def _giant_step(self, m: int) -> int:
        return m if self.steps is None else m * self.steps.giant

    @property
    def rotation_steps(self) -> set[int]:
        """Rotation steps (Galois keys) this map needs."""
        if self.steps is not None:
            return {s % self.slots for s in self.steps.keys()} - {0}
        steps = {j for grp in self._groups.values() for j, _ in grp} | set(self._groups)
        return {s % self.slots for s in steps} - {0}

    @property
    def num_diagonals(self) -> int:
        return sum(len(g) for g in self._groups.values())

    def diagonals(self, weight: np.ndarray | None = None) -> dict[int, list[tuple[int, np.ndarray]]]:
        """Per giant index m: [(baby index k, rot(diag, -giant_step(m)) as a dense [S] vector)]."""
        w = self.weight if weight is None else weight
        out: dict[int, list[tuple[int, np.ndarray]]] = {}
        for m, grp in self._groups.items():
            for k, idx in grp:
                diag = np.zeros(self.slots)
                np.add.at(diag, self.dst[idx], w[idx])
                if np.any(diag):  # SEAL refuses products that are transparent (all-zero plaintext)
                    # rot(v, -G)[s] = v[s - G]
                    out.setdefault(m, []).append((k, np.roll(diag, self._giant_step(m))))
        return out

    def encode(self, ev: Evaluator, level: int, weight: np.ndarray | None = None,
               extra_scale: float = 1.0) -> EncodedMap:
        """Pre-encode the diagonals for inputs at ``level`` (output rescaled to level - 1)."""
        if level < 2:
            raise LevelError("a slot map needs a level to rescale into")
        scale = ev.prime(level) * extra_scale
        return EncodedMap(self, level, encode_groups(ev, self.diagonals(weight), level, scale))

    def apply_plain(self, x: np.ndarray, weight: np.ndarray | None = None) -> np.ndarray:
        """The same map on a clear slot vector [S] (reference for tests)."""
        w = self.weight if weight is None else weight
        y = np.zeros(self.slots)
        np.add.at(y, self.dst, w * x[self.src])
        return y


def _babies(ev: Evaluator, ct: Ciphertext, steps: Steps, needed: set[int],
            keys: EvalKeys) -> dict[int, Ciphertext]:
    """The rotations of ``ct`` by ``pre + k*baby + j*mid`` that index ``k + n_baby*j`` in ``needed`` names:
    k by repeated rotation by ``baby``, then j by repeated rotation of those by ``mid``."""
    if steps.hoist:                                 # each baby one rotation of ct: hoisted where available
        by_step = ev.rotate_many(ct, sorted({steps.baby_step(i) for i in needed}), keys)
        return {i: by_step[steps.baby_step(i)] for i in needed}
    nb = steps.n_baby
    top_k = max(i % nb for i in needed)
    top_j = max(i // nb for i in needed)
    row, cur = {}, ev.rotate(ct, steps.pre, keys)
    for k in range(top_k + 1):
        if k:
            cur = ev.rotate(cur, steps.baby, keys)
        row[k] = cur
    out = {k: c for k, c in row.items() if k in needed}
    for j in range(1, top_j + 1):
        row = {k: ev.rotate(c, steps.mid, keys) for k, c in row.items()
               if any(k + nb * jj in needed for jj in range(j, top_j + 1))}
        out.update({k + nb * j: c for k, c in row.items() if k + nb * j in needed})
    return out


@dataclass
class EncodedMap:
    """A :class:`SlotMap` with its diagonals encoded for one input level."""

    map: SlotMap
    level: int
    plaintexts: dict

    def __call__(self, ev: Evaluator, ct: Ciphertext, keys: EvalKeys, rescale: bool = True) -> Ciphertext:
        """Apply to ``ct`` (at :attr:`level`); returns the result rescaled to ``level - 1``."""
        if ev.level(ct) != self.level:
            raise LevelError(f"map encoded for level {self.level}, input at {ev.level(ct)}")
        sm = self.map
        ks = sorted({k for grp in self.plaintexts.values() for k, _ in grp})
        if sm.steps is None:
            rotated = ev.rotate_many(ct, ks, keys)       # one input, many steps: hoisted where available
        else:
            rotated = _babies(ev, ct, sm.steps, set(ks), keys)
        parts = {m: ev.dot_plain([(rotated[k], pt) for k, pt in grp]) for m, grp in self.plaintexts.items()}
        if sm.steps is not None and sm.steps.giants_each:   # every giant rotated by its own key, one batch
            ms = sorted(parts)
            out = ev.add_many(rotate_each(ev, [parts[m] for m in ms], [m * sm.steps.giant for m in ms], keys))
        elif sm.steps is None:
            out = ev.add_many([ev.rotate(a, m, keys) for m, a in parts.items()])
        else:  # Horner over the giant index: one Galois key
            out = None
            for m in range(max(parts), -1, -1):
                if out is not None:
                    out = ev.rotate(out, sm.steps.giant, keys)
                if m in parts:
                    out = parts[m] if out is None else ev.add(out, parts[m])
        if rescale:
            ev.rescale_inplace(out)
        return out


def rotate_each(ev: Evaluator, cts: list[Ciphertext], steps: list[int], keys: EvalKeys) -> list[Ciphertext]:
    """``[rotate(ct, step) ...]``: the backend's ``rotate_each`` where it has one (the gpu backend batches the key
    switches), else one by one; the same ciphertexts either way."""
    each = getattr(ev, "rotate_each", None)
    if each is not None:
        return each(cts, steps, keys)
    return [ev.rotate(ct, s, keys) for ct, s in zip(cts, steps, strict=True)]


def rotate_sum_steps(step: int, count: int) -> list[int]:
    """Rotations :func:`rotate_sum` uses to add ``count`` copies at multiples of ``step``."""
    steps, have = [], 1
    while have * 2 <= count:
        steps.append(step * have)
        have *= 2
    rest, done = count - have, have
    while rest:
        take = 1 << (rest.bit_length() - 1)
        steps.append(step * done)
        done += take
        rest -= take
    return steps


def rotate_sum(ev: Evaluator, ct: Ciphertext, step: int, count: int, keys: EvalKeys,
               horner: bool = False) -> Ciphertext:
    """sum_{k < count} rot(ct, k*step), exact in slot s for the terms s + k*step.

    Default: a log-depth tree (power-of-two partial sums P_1, P_2, P_4..., then shifted copies of the
    smaller ones for the remainder, so no term beyond ``count`` is ever included; keys for each
    step in :func:`rotate_sum_steps`). ``horner=True``: ``count - 1`` rotations with the single key ``step``.
    """
    if horner:
        out = ct
        for _ in range(count - 1):
            out = ev.add(ev.rotate(out, step, keys), ct)
        return out
    partial = {1: ct}
    have = 1
    while have * 2 <= count:
        partial[have * 2] = ev.add(partial[have], ev.rotate(partial[have], step * have, keys))
        have *= 2
    out, done = partial[have], have
    while done < count:
        take = 1 << ((count - done).bit_length() - 1)
        out = ev.add(out, ev.rotate(partial[take], step * done, keys))
        done += take
    return out


@dataclass
class HybridMatvec:
    """Dense ``y = W x`` (W [n_out, n_in]) from a period-``P`` replicated input, output at chosen slots.

    Args:
        slots: S.
        weight: W [n_out, n_in] (float64).
        out_slots: [n_out] final slot of each output (must be valid heads, see :func:`hybrid_slots`).
        period: P >= n_in, a multiple of ``fold``.
        fold: c, the number of partial sums per output (power of two).
        hoist: babies by ``rotate_many`` (one key each, :class:`Steps`), about sqrt(2w) of them (a hoisted
            baby costs less than a giant), instead of sqrt(w) babies by repeated rotation by 1.
        giants_each: (with ``hoist``) each giant sum rotated by its own key through ``rotate_each``.
    """

    slots: int
    weight: np.ndarray
    out_slots: np.ndarray
    period: int
    fold: int
    hoist: bool = False
    giants_each: bool = False
    map: SlotMap = field(init=False)

    def __post_init__(self) -> None:
        n_out, n_in = self.weight.shape
        p, c = self.period, self.fold
        if p < n_in or p % c or c & (c - 1):
            raise ShapeError(f"period {p} must be >= n_in {n_in} and a multiple of fold {c} (power of 2)")
        if self.slots < p:
            raise ShapeError(f"period {p} does not fit {self.slots} slots")
        cyclic = self.slots % p == 0
        if len(self.out_slots) != n_out or (not cyclic and np.any(self.out_slots + p > self.slots)):
            raise ShapeError("every output slot s needs s + period <= slots (or a period dividing S)")
        w = p // c
        k, r = np.meshgrid(np.arange(c), np.arange(w), indexing="ij")
        kr = (k * w + r).ravel()                                     # [c*w]: read offset within the window
        s_o = self.out_slots[:, None]
        src = (s_o + kr[None, :])                                    # [n_out, P]
        col = np.mod(src, p)                                         # input index read there
        dst = s_o + (k.ravel() * w)[None, :]
        ok = col < n_in
        wt = np.where(ok, self.weight[np.arange(n_out)[:, None], np.minimum(col, n_in - 1)], 0.0)
        keep = ok.ravel()
        b = math.isqrt(w - 1) + 1 if w > 1 else 1                     # babies 0..b-1, giants of b
        if self.hoist and w > 1:
            b = min(w, math.isqrt(2 * w))
        steps = Steps(0, 1, b, b, -(-w // b), hoist=self.hoist, giants_each=self.hoist and self.giants_each)
        dst, src, wt = dst.ravel()[keep], src.ravel()[keep], wt.ravel()[keep]
        self.map = SlotMap(self.slots, np.mod(dst, self.slots), np.mod(src, self.slots), wt, steps)

    @property
    def window(self) -> int:
        return self.period // self.fold

    @property
    def rotation_steps(self) -> set[int]:
        return self.map.rotation_steps | set(rotate_sum_steps(self.window, self.fold))

    def encode(self, ev: Evaluator, level: int) -> EncodedMatvec:
        return EncodedMatvec(self, self.map.encode(ev, level))


@dataclass
class EncodedMatvec:
    """A :class:`HybridMatvec` with encoded diagonals; call it on a replicated input ciphertext."""

    mv: HybridMatvec
    encoded: EncodedMap

    def __call__(self, ev: Evaluator, ct: Ciphertext, keys: EvalKeys) -> Ciphertext:
        partial = self.encoded(ev, ct, keys)
        return rotate_sum(ev, partial, self.mv.window, self.mv.fold, keys)


def hybrid_slots(slots: int, period: int, fold: int, count: int) -> np.ndarray:
    """The first ``count`` usable output slots of a hybrid product: ``p*P + u`` with ``u < P/fold``."""
    w = period // fold
    cand = [p * period + u for p in range(slots // period + 1) for u in range(w)
            if p * period + u + period <= slots]
    if len(cand) < count:
        raise ShapeError(f"{count} outputs do not fit: capacity {len(cand)} "
                         f"(S={slots}, P={period}, c={fold})")
    return np.asarray(cand[:count])


def replicate_input(x: np.ndarray, slots: int, period: int) -> np.ndarray:
    """Client-side layout of a matvec input: x (zero-padded to ``period``) repeated over all slots."""
    if len(x) > period:
        raise ShapeError(f"input of {len(x)} does not fit period {period}")
    v = np.zeros(period)
    v[: len(x)] = x
    return np.resize(v, slots)


def pick_fold(slots: int, n_in: int, n_out: int) -> tuple[int, int]:
    """Largest power-of-two fold c (and its period) whose capacity still holds ``n_out`` outputs."""
    best = None
    c = 1
    while c <= n_in:
        period = -(-n_in // c) * c
        try:
            hybrid_slots(slots, period, c, n_out)
            best = (c, period)
        except ShapeError:
            break
        c *= 2
    if best is None:
        raise ShapeError(f"{n_out} outputs of {n_in} inputs do not fit {slots} slots")
    return best


@dataclass
class PlainMatrix:
    """Encrypted vector x plain matrix for one token: the benchmark's ``x @ W`` (W [n_in, n_out]).

    Client encrypts :meth:`layout` of x; server calls :meth:`__call__`; client reads :meth:`extract`.
    """

    ev: Evaluator
    weight: np.ndarray            # [n_in, n_out], x @ W
    hoist: bool = False           # babies by rotate_many (see :class:`HybridMatvec`)
    giants_each: bool = False     # with hoist: giants one key each, through rotate_each
    mv: HybridMatvec = field(init=False)
    encoded: EncodedMatvec = field(init=False)

    def __post_init__(self) -> None:
        n_in, n_out = self.weight.shape
        fold, period = pick_fold(self.ev.slots, n_in, n_out)
        slots_out = hybrid_slots(self.ev.slots, period, fold, n_out)
        self.mv = HybridMatvec(self.ev.slots, np.asarray(self.weight, np.float64).T, slots_out, period, fold,
                               self.hoist, self.giants_each)
        self.encoded = self.mv.encode(self.ev, self.ev.top)

    @property
    def rotation_steps(self) -> set[int]:
        return self.mv.rotation_steps

    def layout(self, x: np.ndarray) -> np.ndarray:
        return replicate_input(x, self.ev.slots, self.mv.period)

    def __call__(self, ct: Ciphertext, keys: EvalKeys) -> Ciphertext:
        return self.encoded(self.ev, ct, keys)

    def extract(self, slots_vec: np.ndarray) -> np.ndarray:
        return slots_vec[self.mv.out_slots]
