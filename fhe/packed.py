"""Packed prefill: up to B prompt tokens per ciphertext through one encrypted attention block.

A chunk of n <= B tokens (B = tokens per cache block) starting at a block boundary arrives as ONE
ciphertext in the band layout (:meth:`fhe.geometry.Geometry.packed_input_slots`): token row r holds
position ``start + n - 1 - r`` (newest in row 0, as in the cache), hidden index ``i = h'*D + d'`` at
``slot(d', r, h') + Hq - 1``. Then, on the server:

1. q, k (GQA-expanded) and v come out of dense per-row maps directly in the band layout, RoPE and the
   per-row step gain folded into the q/k diagonals (positions are public): one level, no repack, no
   copy of q. The diagonals are ``(a, b)`` with offset ``a*W + b`` (64 band shifts times
   ``Hq + hidden/D - 1`` in-row shifts); babies by +1 from the input, giants Horner by W after rescaling.
   K and V of the chunk are a cache block as they stand (:meth:`PackedPrefill.run`). q's map reads the
   fresh input; k's and v's read it switched down to one level above where they are used (k needs no
   level for the mask, so its products run at one prime fewer).
2. Scores by row shift: for delta = 0..n-1, q rotated down delta rows (one -Hq rotation each, chained)
   and masked to the rows whose key is ``delta`` rows older meets K in the same rows; masking spends the
   level the repack no longer needs, so the score path (band sums, beta, squarings, p.V) is the decode
   path's, unchanged. Causality inside the chunk is the mask (keys are never newer than the query).
   Earlier full cache blocks add the pairs with an older key on a lower row (K and V rotated down
   instead of q). The products land on the key's row; a Horner sum over delta by +Hq brings each
   query's sum Σ_j p_rj v_j to its own row r.
3. Per token: U rotated up r rows, then the decode step's output map and z map (they read row 0 only).

With ``layer.processes == 2`` a forked child (:mod:`fhe.fork`) runs the k/v maps, the larger row shifts
and half the output maps (:meth:`PackedPrefill._run_forked`).

The first token of a session takes the single-token path (its weight is exactly 1), as in decode.
Everything is checked against the token-by-token path and ``fhe.simulator`` (tests/fhe/test_packed.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

import numpy as np
import torch

from fhe.errors import ShapeError
from fhe.evaluator import Ciphertext, EvalKeys, Evaluator, add_plain_values, check_fresh, encode_many, relin_rescale
from fhe.geometry import Geometry
from fhe.kv_cache import EncryptedKVCache
from fhe.linalg import rotate_sum


def _rope_rows(w: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """w [H, D, ...] -> [n, H, D, ...]: RoPE of each row's position applied along D (rotate_half)."""
    d = w.shape[1]
    half = d // 2
    partner = np.concatenate([np.arange(half, d), np.arange(half)])
    sign = np.concatenate([-np.ones(half), np.ones(d - half)])
    extra = (None,) * (w.ndim - 2)
    c = cos[(slice(None), None, slice(None)) + extra]
    s = (sin * sign)[(slice(None), None, slice(None)) + extra]
    return c * w[None] + s * w[None][:, :, partner]


def _rope_rows_torch(w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`_rope_rows` in torch (on the evaluator's device): the same float64 operations in the same
    order, so the same values bit for bit."""
    d = w.shape[1]
    half = d // 2
    partner = torch.cat([torch.arange(half, d), torch.arange(half)]).to(w.device)
    sign = torch.cat([-torch.ones(half, dtype=w.dtype), torch.ones(d - half, dtype=w.dtype)]).to(w.device)
    extra = (None,) * (w.ndim - 2)
    c = cos[(slice(None), None, slice(None)) + extra]
    s = (sin * sign)[(slice(None), None, slice(None)) + extra]
    return c * w[None] + s * w[None][:, :, partner]


def _values_device(ev: Evaluator) -> torch.device | None:
    """Where the backend takes plaintext values as torch tensors (the gpu backend: its device), else None
    (numpy on the host). A chunk's ~3,300 diagonals then never leave the device before encoding."""
    dev = getattr(ev, "device", None)
    return dev if isinstance(dev, torch.device) and getattr(ev, "encode_many", None) is not None else None


def _on_device(ints: list[int], dev: torch.device) -> torch.Tensor:
    """``ints`` as a tensor on ``dev``; a run of consecutive ones (up or down) by ``arange``, which needs no copy
    from the host (a pageable copy waits for the device's queue)."""
    step = ints[1] - ints[0] if len(ints) > 1 else 1
    if abs(step) == 1 and ints == list(range(ints[0], ints[-1] + step, step)):
        return torch.arange(ints[0], ints[-1] + step, step, device=dev)
    return torch.tensor(ints, device=dev)


def _on(a: np.ndarray, dev: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(dev)


class PackedMap:
    """Dense per-row linear map of a packed chunk: out[slot(d, r, h)] = sum_i w[r, h*D + d, i] x[r, i].

    ``w`` is [n or 1, Hq*D, hidden] (one matrix for every row when its first dim is 1).
    """

    def __init__(self, geo: Geometry, w: np.ndarray, key: tuple | None = None) -> None:
        lay = geo.layout
        self.geo, self.w = geo, w
        #: what ``w`` depends on besides the layer's weights (which map, the rows' positions or count): where the
        #: encoded diagonals are kept between chunks (:class:`PlainCache`); None: never kept
        self.key = key
        self.kin = lay.hidden // lay.head_dim
        self.shift = lay.num_heads - 1
        self.n_baby = lay.num_heads + self.kin - 1

    def plaintexts(self, a: int, rows: int) -> Iterator[tuple[int, np.ndarray]]:
        """(baby b, rot(diag_{a,b}, -a*W)) for band shift a: the in-row shifts with a nonzero entry."""
        lay, w = self.geo.layout, self.w
        D, Hq = lay.head_dim, lay.num_heads
        b = np.arange(self.n_baby)[:, None, None, None]
        d = np.arange(D)[None, :, None, None]
        r = np.arange(rows)[None, None, :, None]
        h = np.arange(Hq)[None, None, None, :]
        hp = h + b - self.shift
        ok = (hp >= 0) & (hp < self.kin)
        rr = r if w.shape[0] > 1 else np.zeros_like(r)
        vals = w[rr, h * D + d, np.clip(hp, 0, self.kin - 1) * D + (d + a) % D] * ok   # [nb, D, rows, Hq]
        dst = np.broadcast_to(lay.slot(d, r, h)[0], vals.shape[1:]).ravel()
        for k in range(self.n_baby):
            if not ok[k].any():
                continue
            diag = np.zeros(lay.slots)
            diag[dst] = vals[k].ravel()
            if np.any(diag):
                yield k, np.roll(diag, a * lay.band)

    def diagonals(self, a: int, rows: int) -> tuple[list[int], torch.Tensor]:
        """:meth:`plaintexts` at once, for ``w`` a torch tensor: (babies, their diagonals [K, slots] on w's
        device), the same values (the same gathers, products by the mask and roll)."""
        lay, w, dev = self.geo.layout, self.w, self.w.device
        D, Hq = lay.head_dim, lay.num_heads
        b = torch.arange(self.n_baby, device=dev)[:, None, None, None]
        d = torch.arange(D, device=dev)[None, :, None, None]
        r = torch.arange(rows, device=dev)[None, None, :, None]
        h = torch.arange(Hq, device=dev)[None, None, None, :]
        hp = h + b - self.shift
        ok = (hp >= 0) & (hp < self.kin)
        rr = r if w.shape[0] > 1 else torch.zeros_like(r)
        vals = w[rr, h * D + d, torch.clamp(hp, 0, self.kin - 1) * D + (d + a) % D] * ok   # [nb, D, rows, Hq]
        dn, rn, hn = np.arange(D)[:, None, None], np.arange(rows)[None, :, None], np.arange(Hq)[None, None, :]
        dst = torch.from_numpy(np.broadcast_to(lay.slot(dn, rn, hn), vals.shape[1:]).ravel().copy()).to(dev)
        diag = torch.zeros(self.n_baby, lay.slots, dtype=w.dtype, device=dev)
        diag[:, dst] = vals.reshape(self.n_baby, -1)
        keep = (ok.reshape(self.n_baby, -1).any(dim=1) & (diag != 0).any(dim=1)).nonzero().view(-1)
        return keep.tolist(), torch.roll(diag[keep], a * lay.band, dims=1)

    def _babies_in_use(self) -> list[int]:
        """The babies with an entry at some row and head (the same at every band shift: no values read)."""
        Hq = self.geo.layout.num_heads
        hp = np.arange(Hq)[None, :] + np.arange(self.n_baby)[:, None] - self.shift
        return np.flatnonzero(((hp >= 0) & (hp < self.kin)).any(axis=1)).tolist()

    def diagonals_many(self, shifts: list[int], rows: int) -> tuple[list[int], torch.Tensor]:
        """:meth:`diagonals` at several band shifts in one gather and scatter, without its host sync: (babies,
        ``[len(shifts), K, slots]``). The babies are the shape's (:meth:`_babies_in_use`), so a diagonal whose
        weights are all zero is kept, as zeros (its product adds 0: the same sums); the others' values are
        :meth:`diagonals`' bit for bit (the same gathers and products by the mask; the roll is the scatter's
        index shifted by ``a * band``)."""
        lay, w, dev = self.geo.layout, self.w, self.w.device
        D, Hq = lay.head_dim, lay.num_heads
        keep = self._babies_in_use()
        b = _on_device(keep, dev)[None, :, None, None, None]
        a = _on_device(shifts, dev)[:, None, None, None, None]
        d = torch.arange(D, device=dev)[None, None, :, None, None]
        r = torch.arange(rows, device=dev)[None, None, None, :, None]
        h = torch.arange(Hq, device=dev)[None, None, None, None, :]
        hp = h + b - self.shift
        ok = (hp >= 0) & (hp < self.kin)
        rr = r if w.shape[0] > 1 else torch.zeros_like(r)
        vals = w[rr, h * D + d, torch.clamp(hp, 0, self.kin - 1) * D + (d + a) % D] * ok   # [S, K, D, rows, Hq]
        dst = (d * lay.band + r * Hq + h)[0, 0].expand(vals.shape[2:]).reshape(-1)        # lay.slot(d, r, h)
        at = (dst[None, :] + a.view(-1, 1) * lay.band) % lay.slots                           # [S, M]
        diag = torch.zeros(len(shifts), len(keep), lay.slots, dtype=w.dtype, device=dev)
        src = vals.reshape(len(shifts), len(keep), -1)
        diag.scatter_(2, at[:, None, :].expand(src.shape), src)
        return keep, diag

    def encoded(self, ev: Evaluator, shifts: list[int], rows: int, level: int,
                scale: float) -> dict[int, tuple[list[int], list]]:
        """{shift: (babies, their plaintexts)} for ``shifts``, built (:meth:`diagonals_many`) and encoded
        (one :func:`encode_many`) together."""
        keep, diag = self.diagonals_many(shifts, rows)
        pts = encode_many(ev, diag.reshape(-1, diag.shape[-1]), level, scale) if keep else []
        k = len(keep)
        return {a: (keep, pts[i * k:(i + 1) * k]) for i, a in enumerate(shifts)}


#: band shifts whose diagonals a device-side map (``w`` a torch tensor) builds and encodes together: one gather and
#: one batched encode per group instead of per shift (issue 16, session 19: the chunk's 192 shifts each paid two
#: host syncs and ~40 launches for ~17 diagonals). 0: one shift at a time (:meth:`PackedMap.diagonals`), as before.
#: 8 since session 20: with :data:`BATCH_ROWS` the 28-token chunk 0.707 -> 0.405 s and 32 tokens as the SDK sends them
#: 0.807 -> 0.540 s on an H100, in turn in one run, every output ciphertext the same (bench/gpu_packed.py --ab-group 8
#: --ab-rows; = SEAL on CUDA, tests/fhe/test_gpu_backend_packed.py). A group of 8 holds ~8x one shift's plaintexts
#: (about 430 MB at 12 primes for a 17-baby map) while it is used.
SHIFT_GROUP = 8
#: The chunk's per-row output maps (``enc_out``, ``enc_z``: ~1,670 of a 28-token chunk's ~2,380 key switches, at
#: low levels where a switch is a few µs of launches) as one batch over its rows on the gpu backend (session 19: the
#: outputs took 0.21 s of a 0.74 s chunk on an H100). On since session 20 (measured with :data:`SHIFT_GROUP`, above;
#: not apart from it). Each row's ciphertext is the same either way.
BATCH_ROWS = True
#: device bytes of encoded projection diagonals one attention layer keeps between packed chunks (:class:`PlainCache`;
#: 0: none, every chunk encodes its own, as before session 23). A chunk's q, k and v diagonals depend only on public
#: facts — the layer's weights, the rows' positions (RoPE, step gains) and their count — so the first chunk of every
#: prompt of >= B tokens (positions 0..B-1), in any session, has the same ones. At the shipped plan (N = 32768,
#: B = 28) one chunk's are 7.7 GB a layer (1,088 plaintexts each for q at 12 primes, k at 11, v at 4; 256 KiB a
#: prime); kept, a chunk skips their ~3,300 FFTs, roundings and ~29,000 NTT rows.
PLAIN_CACHE_BYTES = 0
#: a map's babies stacked once for its 64 band shifts' dot products (the backend's ``dot_with``) instead of once per
#: shift inside ``dot_plain``, and the shift's plaintexts read in place (session 23: a 28-token chunk stacked ~22 GB
#: at N = 32768, babies ~15 GB of it). The same kernel on the same operands.
STACK_BABIES = True


class PlainCache:
    """One layer's encoded packed-map diagonals, ``{(map key, rows, level, scale): {shift: (babies, plaintexts)}}``,
    the least recently used dropped first past :data:`PLAIN_CACHE_BYTES` (read at each store). Only public values
    are in it (encoded weights); it serves every session of the layer."""

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple, dict] = OrderedDict()
        self._sizes: dict[tuple, int] = {}
        #: lookups that found an entry / found none
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the plaintexts held."""
        return sum(self._sizes.values())

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple) -> dict | None:
        got = self._entries.get(key)
        if got is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return got

    def put(self, key: tuple, shifts: dict) -> bool:
        """Keep ``shifts`` under ``key``, dropping the least recently used entries it needs room from; False
        (nothing kept) when it alone is over the budget."""
        size = sum(p.data.element_size() * p.data.numel() for _, pts in shifts.values() for p in pts)
        if size > PLAIN_CACHE_BYTES:
            return False
        self._drop(key)
        while self._entries and self.nbytes + size > PLAIN_CACHE_BYTES:
            self._drop(next(iter(self._entries)))
        self._entries[key], self._sizes[key] = shifts, size
        return True

    def _drop(self, key: tuple) -> None:
        self._entries.pop(key, None)
        self._sizes.pop(key, None)


def apply_packed(ev: Evaluator, babies: dict[int, Ciphertext], maps: list[PackedMap], rows: int,
                 keys: EvalKeys, store: PlainCache | None = None) -> list[Ciphertext]:
    """The maps on one input whose in-row shifts ``babies[b] = rot(x, b)`` are given (x at one level);
    each output rescaled once per band shift, then summed Horner-style by W one level lower. With ``store``,
    a device map with a ``key`` takes its encoded diagonals from there, or leaves them there (the same
    plaintexts either way: the same sums)."""
    geo = maps[0].geo
    level = ev.level(babies[0])
    scale = ev.prime(level)
    outs: list[Ciphertext | None] = [None] * len(maps)
    ready: list[dict] = [{} for _ in maps]                 # device maps: shift -> (babies, plaintexts), a group ahead
    kept = [_kept(store, m, ev, rows, level, scale) for m in maps]   # (cache key, shift -> (babies, pts)) or None
    dots: dict[tuple, object] = {}                                  # babies in use -> their dot (stacked once)
    for a in range(geo.layout.head_dim - 1, -1, -1):
        for i, m in enumerate(maps):
            if outs[i] is not None:
                outs[i] = ev.rotate(outs[i], geo.layout.band, keys)
            if kept[i] is not None and kept[i][2]:            # every shift's plaintexts from the store
                ks, pts = kept[i][1][a]
            elif isinstance(m.w, torch.Tensor) and SHIFT_GROUP:
                if a not in ready[i]:
                    ready[i] = m.encoded(ev, list(range(a, max(a - SHIFT_GROUP, -1), -1)), rows, level, scale)
                ks, pts = ready[i].pop(a)
            elif isinstance(m.w, torch.Tensor):                 # SHIFT_GROUP = 0: one shift at a time, as before
                ks, vals = m.diagonals(a, rows)
                pts = encode_many(ev, vals, level, scale)
            else:
                diags = list(m.plaintexts(a, rows))
                ks, pts = [k for k, _ in diags], encode_many(ev, [p for _, p in diags], level, scale)
            if kept[i] is not None and not kept[i][2]:
                kept[i][1][a] = (ks, pts)
            if not ks:          # SEAL refuses all-zero plaintexts: nothing to add at this shift
                continue
            inner = _dot(ev, babies, ks, dots)(pts)
            ev.rescale_inplace(inner)
            outs[i] = inner if outs[i] is None else ev.add(outs[i], inner)
    for got in kept:
        if got is not None and not got[2]:
            store.put(got[0], got[1])
    return outs


def _dot(ev: Evaluator, babies: dict[int, Ciphertext], ks: list[int], dots: dict):
    """``pts -> Σ_j babies[ks[j]] * pts[j]``: through the backend's ``dot_with`` where it has one and
    :data:`STACK_BABIES` is on (the gpu backend: the babies stacked once for every band shift that uses them),
    else ``dot_plain``. The same sums."""
    with_ = getattr(ev, "dot_with", None) if STACK_BABIES else None
    if with_ is None:
        return lambda pts: ev.dot_plain(list(zip([babies[k] for k in ks], pts, strict=True)))
    key = tuple(ks)
    if key not in dots:
        dots[key] = with_([babies[k] for k in ks])
    return dots[key]


def _kept(store: PlainCache | None, m: PackedMap, ev: Evaluator, rows: int, level: int,
          scale: float) -> tuple[tuple, dict, bool] | None:
    """(cache key, shift -> (babies, plaintexts), found) of a map whose diagonals the store serves or will
    keep, or None: no store, no key, a host map (SEAL's plaintexts stay per chunk), or more bytes than the
    budget holds (then nothing is held past its group, as without a store)."""
    if store is None or m.key is None or not isinstance(m.w, torch.Tensor) or not SHIFT_GROUP:
        return None
    key = (m.key, rows, level, float(scale))
    got = store.get(key)
    if got is not None:
        return key, got, True
    lay = m.geo.layout
    need = lay.head_dim * len(m._babies_in_use()) * level * ev.params.poly_modulus_degree * 8
    return (key, {}, False) if need <= PLAIN_CACHE_BYTES else None


def _babies(ev: Evaluator, x: Ciphertext, count: int, keys: EvalKeys) -> dict[int, Ciphertext]:
    out, cur = {0: x}, x
    for k in range(1, count):
        cur = ev.rotate(cur, 1, keys)
        out[k] = cur
    return out


class PackedPrefill:
    """The packed path of one :class:`fhe.attention.EncryptedAttentionLayer` (it holds the weights)."""

    def __init__(self, layer) -> None:
        self.layer, self.ev, self.geo = layer, layer.ev, layer.geo

    # --- projections -------------------------------------------------------------------------
    def _rows(self, start: int, n: int) -> np.ndarray:
        """Position of each token row (row r holds position start + n - 1 - r)."""
        return start + n - 1 - np.arange(n)

    def _rope(self, start: int, n: int):
        """cos, sin [n, D/2 or D] of each row's position (torch: computed before any fork)."""
        pos = self._rows(start, n)
        return tuple(t.double().numpy() for t in self.layer.rope.cos_sin(torch.tensor(pos)))

    def _project(self, ct: Ciphertext, start: int, n: int, keys: EvalKeys):
        rope = self._rope(start, n)
        return (self._project_q(ct, start, n, keys, rope),) + self._project_kv(ct, start, n, keys, rope)

    def _babies(self, ct: Ciphertext, keys: EvalKeys) -> dict[int, Ciphertext]:
        lay = self.geo.layout
        return _babies(self.ev, ct, lay.num_heads + lay.hidden // lay.head_dim - 1, keys)

    def _project_q(self, ct: Ciphertext, start: int, n: int, keys: EvalKeys, rope) -> Ciphertext:
        """q (level 11): RoPE and each row's step gain folded into the diagonals."""
        layer, ev, lay = self.layer, self.ev, self.geo.layout
        wq, bq = layer.packed_weights[:2]
        cos, sin = rope
        gain = np.array([layer._step_gain(int(t) + 1) for t in self._rows(start, n)])
        D, Hq = lay.head_dim, lay.num_heads
        qmap = self._rope_map(wq.reshape(Hq, D, -1), cos, sin, gain, key=("q", start))
        (q,) = apply_packed(ev, self._babies(ct, keys), [qmap], n, keys, self._store())
        ev.set_scale(q, ev.scale)
        if bq is not None:
            q = add_plain_values(ev, q, self._bias_vec(_rope_rows(bq.reshape(Hq, D), cos, sin) * gain[:, None, None]))
        return q

    def _project_kv(self, ct: Ciphertext, start: int, n: int, keys: EvalKeys, rope):
        """k (GQA-expanded, RoPE folded, level_qk) and v (level_v), each from x switched down to one level
        above its own: k needs no mask level (q does), so its 1088 diagonals are encoded and multiplied at
        11 primes instead of 12 (measured: 9.9 vs 14.8 ms each, docs/benchmarks.md)."""
        layer, ev, geo, lay = self.layer, self.ev, self.geo, self.geo.layout
        _, _, wk, bk, wv, bv = layer.packed_weights
        cos, sin = rope
        D, Hq = lay.head_dim, lay.num_heads
        heads = np.arange(Hq) // lay.group                       # KV head of each query head
        kmap = self._rope_map(wk.reshape(-1, D, wk.shape[1])[heads], cos, sin, key=("k", start))
        xk = ev.mod_switch(ct, geo.level_qk + 1)
        (k,) = apply_packed(ev, self._babies(xk, keys), [kmap], n, keys, self._store())
        ev.set_scale(k, ev.scale)
        if bk is not None:
            k = add_plain_values(ev, k, self._bias_vec(_rope_rows(bk.reshape(-1, D)[heads], cos, sin)))
        xv = ev.mod_switch(ct, geo.level_v + 1)
        wv_rows = wv.reshape(-1, D, wv.shape[1])[heads].reshape(1, Hq * D, -1)
        dev = _values_device(ev)
        vmap = PackedMap(geo, wv_rows if dev is None else _on(wv_rows, dev), key=("v",))    # one matrix: any start
        (v,) = apply_packed(ev, _babies(ev, xv, vmap.n_baby, keys), [vmap], n, keys, self._store())
        ev.set_scale(v, ev.scale)
        if bv is not None:
            v = add_plain_values(ev, v, self._bias_vec(np.broadcast_to(bv.reshape(-1, D)[heads], (n, Hq, D))))
        return k, v

    def _rope_map(self, w, cos, sin, gain=None, key: tuple | None = None) -> PackedMap:
        """A chunk's map of ``w`` [heads, D, hidden] with each row's RoPE (and step gain) folded in; built
        in torch on the evaluator's device where it takes values there (same values), else numpy. ``key``:
        the map's :class:`PlainCache` key (which map and the chunk's first position; the rows are added)."""
        dev = _values_device(self.ev)
        if dev is None:
            rows = _rope_rows(w, cos, sin)
            scale = None if gain is None else gain[:, None, None, None]
        else:
            rows = _rope_rows_torch(_on(w, dev), _on(cos, dev), _on(sin, dev))
            scale = None if gain is None else _on(gain, dev)[:, None, None, None]
        rows = rows if scale is None else rows * scale
        return PackedMap(self.geo, rows.reshape(len(cos), -1, w.shape[-1]), key)

    def _store(self) -> PlainCache | None:
        """The layer's :class:`PlainCache` (made on first use), or None while :data:`PLAIN_CACHE_BYTES` is 0."""
        if not PLAIN_CACHE_BYTES:
            return None
        if getattr(self.layer, "packed_plaintexts", None) is None:
            self.layer.packed_plaintexts = PlainCache()
        return self.layer.packed_plaintexts

    def _bias_vec(self, b: np.ndarray) -> np.ndarray:
        """[n, Hq, D] per-row values -> slot vector (rows >= n stay 0, as their inputs are)."""
        lay = self.geo.layout
        n = b.shape[0]
        r, h, d = np.meshgrid(np.arange(n), np.arange(lay.num_heads), np.arange(lay.head_dim), indexing="ij")
        vec = np.zeros(lay.slots)
        vec[lay.slot(d, r, h).ravel()] = b.ravel()
        return vec

    # --- masks ---------------------------------------------------------------------------------
    def _rows_mask(self, rows: np.ndarray, values: np.ndarray | None = None) -> np.ndarray:
        """[S]: ``values[i, h]`` (default 1) on token row ``rows[i]`` of every band, 0 elsewhere."""
        lay = self.geo.layout
        vals = np.ones((len(rows), lay.num_heads)) if values is None else values
        vec = np.zeros(lay.slots)
        d, i, h = np.meshgrid(np.arange(lay.head_dim), np.arange(len(rows)), np.arange(lay.num_heads),
                              indexing="ij")
        vec[lay.slot(d, rows[i], h).ravel()] = vals[i, h].ravel()
        return vec

    def _masked(self, ct: Ciphertext, rows: np.ndarray) -> Ciphertext:
        """ct (one level above q.k's) kept on ``rows`` only, rescaled to q.k's level at the same scale."""
        ev = self.ev
        lvl = ev.level(ct)
        out = ev.mul_plain(ct, ev.encode(self._rows_mask(rows), lvl, ev.prime(lvl)))
        ev.rescale_inplace(out)
        ev.set_scale(out, ev.scale)
        return out

    def _beta(self, rows: np.ndarray, query_pos: np.ndarray):
        """beta_h times each query's step gain, on the rows where its scores sit."""
        layer = self.layer
        gains = np.array([layer._step_gain(int(t) + 1) for t in query_pos])
        vec = self._rows_mask(rows, gains[:, None] * layer.beta[None, :])
        return self.ev.encode(vec, self.geo.level_qk - 1, layer.scale_s)

    # --- scores --------------------------------------------------------------------------------
    def _p(self, q: Ciphertext, k_b: Ciphertext, beta, rows: np.ndarray, tokens: int, keys: EvalKeys) -> Ciphertext:
        """The decode step's score path: q.K, band sums, + beta, squarings (or polyexp's P) -> p at level_p.

        polyexp carries its gain on P, not on q/beta, so one gain serves the whole chunk (that of its
        last position, ``tokens``: the smallest, so no row's p overflows): the same factor on a query
        row's every p keeps y/z exact.
        """
        layer, ev = self.layer, self.ev
        s = self._scores(q, k_b, beta, keys)
        if layer._poly is not None:  # constants only where a score sits: masked rows get p = 0
            return layer.poly_evaluator(("packed", rows.tobytes()), lambda: self._rows_mask(rows), tokens)(s, keys)
        for _ in range(self.geo.squarings):
            s = relin_rescale(ev, ev.square(s), keys)
        ev.set_scale(s, layer.scale_p)
        return s

    def _scores(self, q: Ciphertext, k_b: Ciphertext, beta, keys: EvalKeys) -> Ciphertext:
        """q.K summed over the bands, + beta (level_qk - 1)."""
        layer, ev, lay = self.layer, self.ev, self.geo.layout
        s = relin_rescale(ev, ev.mul(q, k_b), keys)
        s = rotate_sum(ev, s, lay.band, lay.head_dim, keys)
        ev.set_scale(s, layer.scale_s)
        ev.add_plain_inplace(s, beta)
        return s

    def _p_v(self, q: Ciphertext, k_b: Ciphertext, v_b: Ciphertext, beta, rows: np.ndarray, tokens: int,
             keys: EvalKeys) -> tuple[Ciphertext, Ciphertext]:
        """(p at level_p, p ⊙ V_b of size 3 one level above level_u): with ``fold_v`` the product rides in
        polyexp's P (:meth:`fhe.poly.PolyEvaluator.with_values`), else it is one more product."""
        layer = self.layer
        if self.geo.fold_v:
            s = self._scores(q, k_b, beta, keys)
            poly = layer.poly_evaluator(("packed", rows.tobytes()), lambda: self._rows_mask(rows), tokens)
            return poly.with_values(s, v_b, layer.scale_u, keys)
        p = self._p(q, k_b, beta, rows, tokens, keys)
        return p, self.ev.mul(p, v_b)

    def _deltas(self, older: bool, n: int) -> int:
        """Row shifts of q the chunk's scores need: n within the chunk, B with earlier full blocks."""
        return self.geo.layout.block_tokens if older else n

    def _down(self, cache: EncryptedKVCache, q: Ciphertext, k: Ciphertext, v: Ciphertext, start: int, n: int,
              deltas: range, keys: EvalKeys) -> list[tuple[Ciphertext, Ciphertext]]:
        """Per δ in ``deltas``: (Σ p ⊙ V relinearized and rescaled, Σ p at level_u) of the pairs whose key
        sits δ rows below its query."""
        ev, geo, lay = self.ev, self.geo, self.geo.layout
        B, Hq = lay.block_tokens, lay.num_heads
        pos = self._rows(start, n)
        older = list(zip(cache.k_blocks, cache.v_blocks, strict=True))
        out = []
        shifted = q
        for delta in range(deltas.stop):
            if delta:
                shifted = ev.rotate(shifted, -Hq, keys)         # row r -> row r + delta (no wrap: masked)
            if delta < deltas.start:
                continue
            pv, ps = [], []
            for k_b, v_b, rows_b in [(k, v, n)] + [(kb, vb, B) for kb, vb in older]:
                rows = np.arange(delta, min(n + delta, rows_b))   # key rows whose query is delta rows up
                if rows.size == 0:
                    continue
                p, p_v = self._p_v(self._masked(shifted, rows), k_b, v_b, self._beta(rows, pos[rows - delta]),
                                   rows, int(pos.max()) + 1, keys)
                pv.append(p_v)
                ps.append(p)
            w = relin_rescale(ev, ev.add_many(pv), keys)
            ev.set_scale(w, self.layer.scale_u)
            out.append((w, ev.mod_switch(ev.add_many(ps), geo.level_u)))
        return out

    def _horner(self, terms: list[tuple[Ciphertext, Ciphertext]], keys: EvalKeys, u=None, z=None):
        """Σ_δ rot(w_δ, δ·Hq) (and of z) for the δs of ``terms`` in increasing order, continuing from (u, z),
        the sum of the δs above them: row r + δ -> r."""
        ev, Hq = self.ev, self.geo.layout.num_heads
        for w, zt in reversed(terms):
            u = w if u is None else ev.add(ev.rotate(u, Hq, keys), w)
            z = zt if z is None else ev.add(ev.rotate(z, Hq, keys), zt)
        return u, z

    def _below(self, cache: EncryptedKVCache, q: Ciphertext, start: int, n: int, keys: EvalKeys):
        """(Σ p ⊙ V, Σ p) of the earlier full blocks' keys below their query row, or None without any."""
        ev, geo = self.ev, self.geo
        older = list(zip(cache.k_blocks, cache.v_blocks, strict=True))
        up_pv, up_p = self._older_below(older, q, self._rows(start, n), n, keys)
        if not up_pv:
            return None
        w = relin_rescale(ev, ev.add_many(up_pv), keys)
        ev.set_scale(w, self.layer.scale_u)
        return w, ev.mod_switch(ev.add_many(up_p), geo.level_u)

    def _attend(self, cache: EncryptedKVCache, q: Ciphertext, k: Ciphertext, v: Ciphertext, start: int,
                n: int, keys: EvalKeys) -> tuple[Ciphertext, Ciphertext]:
        """U, Z (level_u): query row r's Σ_j p_rj v_j and Σ_j p_rj on row r."""
        deltas = range(self._deltas(bool(cache.k_blocks), n))
        u, z = self._horner(self._down(cache, q, k, v, start, n, deltas, keys), keys)
        below = self._below(cache, q, start, n, keys)
        if below is not None:
            u, z = self.ev.add(u, below[0]), self.ev.add(z, below[1])
        return u, z

    def _older_below(self, older, q: Ciphertext, pos: np.ndarray, n: int, keys: EvalKeys):
        """Pairs (query row r, key row j < r) of the earlier full blocks: K, V rotated down r - j rows."""
        ev, Hq = self.ev, self.geo.layout.num_heads
        pv, ps = [], []
        for k_b, v_b in older:
            k_s, v_s = k_b, v_b
            for delta in range(1, n):
                k_s, v_s = ev.rotate(k_s, -Hq, keys), ev.rotate(v_s, -Hq, keys)
                rows = np.arange(delta, n)
                p, p_v = self._p_v(self._masked(q, rows), k_s, v_s, self._beta(rows, pos[rows]), rows,
                                   int(pos.max()) + 1, keys)
                pv.append(p_v)
                ps.append(p)
        return pv, ps

    # --- outputs -------------------------------------------------------------------------------
    def _outputs(self, u: Ciphertext, z: Ciphertext, v: Ciphertext, start: int, n: int,
                 keys: EvalKeys, rows: range | None = None) -> list[Ciphertext]:
        """One output ciphertext per token row in ``rows`` (default all), in position order (last row first)."""
        layer, ev, Hq = self.layer, self.ev, self.geo.layout.num_heads
        rows = range(n) if rows is None else rows
        if BATCH_ROWS and getattr(ev, "batched", None) is not None:
            return self._outputs_batched(u, z, v, start, n, keys, rows)
        outs: list[Ciphertext] = []
        for r in range(rows.stop):
            if r:
                u, z = ev.rotate(u, Hq, keys), ev.rotate(z, Hq, keys)
            if r < rows.start:
                continue
            if start == 0 and r == n - 1:
                outs.append(self._first_token(v, n, keys))
                continue
            y = layer.enc_out(ev, u, keys)
            zo = layer.enc_z(ev, z, keys)
            ev.set_scale(zo, ev.scale_of(y))
            outs.append(ev.add(y, zo))
        return [ev.mod_switch(c, 1) for c in reversed(outs)]

    def _outputs_batched(self, u: Ciphertext, z: Ciphertext, v: Ciphertext, start: int, n: int, keys: EvalKeys,
                         rows: range) -> list[Ciphertext]:
        """:meth:`_outputs` with :data:`BATCH_ROWS`: the rows' (u, z) gathered first (~2 x 28 ciphertexts at
        level_u held at once), then the output and row-sum maps as one batch over them
        (the evaluator's optional ``batched``: every key switch one launch sequence for all rows, each row's
        residues the one-row evaluator's)."""
        layer, ev, Hq = self.layer, self.ev, self.geo.layout.num_heads
        pairs: list[tuple[Ciphertext, Ciphertext] | None] = []    # (u, z) on row 0 per token row; None: position 0
        for r in range(rows.stop):
            if r:
                u, z = ev.rotate(u, Hq, keys), ev.rotate(z, Hq, keys)
            if r >= rows.start:
                pairs.append(None if start == 0 and r == n - 1 else (u, z))
        todo = [p for p in pairs if p is not None]
        mapped: list[Ciphertext] = []
        if todo:
            bev, bkeys = ev.batched(keys, len(todo))
            y = layer.enc_out(bev, bev.stack([u for u, _ in todo]), bkeys)          # [R, 2, L, N]
            zo = layer.enc_z(bev, bev.stack([z for _, z in todo]), bkeys)
            bev.set_scale(zo, bev.scale_of(y))
            mapped = bev.unstack(bev.add(y, zo))
        it = iter(mapped)
        outs = [self._first_token(v, n, keys) if p is None else next(it) for p in pairs]
        return [ev.mod_switch(c, 1) for c in reversed(outs)]

    def _first_token(self, v: Ciphertext, n: int, keys: EvalKeys) -> Ciphertext:
        """Position 0 attends only to itself: y_h = v_0 Wo_h, z_h = 1 (see ``_attend_single``)."""
        layer, ev, lay = self.layer, self.ev, self.geo.layout
        lvl = self.geo.level_u + 1
        v = ev.mod_switch(v, lvl)
        mask = ev.encode(self._rows_mask(np.array([n - 1])), lvl, layer.scale_u * ev.prime(lvl) / ev.scale_of(v))
        u = ev.mul_plain(v, mask)
        ev.rescale_inplace(u)
        ev.set_scale(u, layer.scale_u)
        for _ in range(n - 1):
            u = ev.rotate(u, lay.num_heads, keys)
        y = layer.enc_out(ev, u, keys)
        ones = np.zeros(ev.slots)
        ones[lay.output_slots()[1]] = 1.0
        return add_plain_values(ev, y, ones)

    # --- the chunk -----------------------------------------------------------------------------
    def run(self, cache: EncryptedKVCache, ct: Ciphertext, start: int, n: int, keys: EvalKeys) -> list[Ciphertext]:
        """A chunk of ``n`` tokens at positions ``start..`` -> one output ciphertext per token; its K/V
        become the cache's next block."""
        B = self.geo.layout.block_tokens
        if not 1 <= n <= B:
            raise ShapeError(f"a packed chunk holds 1..{B} tokens, got {n}")
        if start != cache.length or start % B:
            raise ShapeError(f"a packed chunk starts at a cache block boundary (cache holds {cache.length}, "
                             f"block {B}, chunk at {start})")
        if start + n > cache.max_tokens:
            raise ShapeError(f"session cache full ({cache.max_tokens} tokens)")
        check_fresh(self.ev, keys, ct)
        if self.layer.processes > 1 and n > 1:
            q, k, v, outs = self._run_forked(cache, ct, start, n, keys)
        else:
            q, k, v = self._project(ct, start, n, keys)
            u, z = self._attend(cache, q, k, v, start, n, keys)
            outs = self._outputs(u, z, v, start, n, keys)
        cache.k_blocks.append(k)
        cache.v_blocks.append(v)
        cache.length += n
        return outs

    def _run_forked(self, cache: EncryptedKVCache, ct: Ciphertext, start: int, n: int, keys: EvalKeys):
        """:meth:`run` on two cores (:mod:`fhe.fork`): a forked child projects k and v while this process
        projects q; then each scores about half of the row shifts δ (the child the larger ones, plus the
        pairs below the query row in earlier blocks) and the Horner sum over δ continues from the child's
        part; then each runs the output maps of half the token rows. Same operations in the same order per
        value, so the same results as one process."""
        from fhe.fork import Forked

        ev = self.ev
        rope = self._rope(start, n)            # torch before the fork: the child runs none
        total = self._deltas(bool(cache.k_blocks), n)
        cut = self._delta_cut(cache, n, total)
        half = n // 2

        def child(ch):
            k, v = self._project_kv(ct, start, n, keys, rope)
            ch.send([k, v])
            (q,) = ch.recv()
            u, z = self._horner(self._down(cache, q, k, v, start, n, range(cut, total), keys), keys)
            below = self._below(cache, q, start, n, keys)
            ch.send([u, z] + ([] if below is None else list(below)))
            u, z = ch.recv()
            return self._outputs(u, z, v, start, n, keys, range(half, n))

        with Forked(ev, child) as ch:
            q = self._project_q(ct, start, n, keys, rope)
            k, v = ch.recv()
            ch.send([q])
            mine = self._down(cache, q, k, v, start, n, range(cut), keys)
            u, z, *below = ch.recv()
            u, z = self._horner(mine, keys, u, z)
            if below:                           # no row shift: added after the Horner sum
                u, z = ev.add(u, below[0]), ev.add(z, below[1])
            ch.send([u, z])
            outs = self._outputs(u, z, v, start, n, keys, range(half))
            outs = ch.recv() + outs
        return q, k, v, outs

    def _delta_cut(self, cache: EncryptedKVCache, n: int, total: int) -> int:
        """The parent's row shifts are δ < cut: about half of the score paths (each δ pairs with the chunk
        while δ < n and with every earlier block), the child also taking the pairs below the query row."""
        older = len(cache.k_blocks)
        cost = [int(d < n) + older for d in range(total)]
        below = (n - 1) * older
        target, acc = (sum(cost) + below) / 2, 0
        for d, c in enumerate(cost):
            if acc + c > target:
                return max(1, d)
            acc += c
        return total - 1
