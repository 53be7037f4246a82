"""Several positions per linear step with one rotation for all of them: the position-interleaved chunk
layout of the offload plan's multi-position steps (prefill chunks, speculative verify steps; issue 18).

The one-position hybrid product (:class:`fhe.linalg.HybridMatvec`) already fills a ciphertext at N = 8192
(the MLP's 3072 outputs of 576 inputs), so packing positions into its blocks saves little (pack17). Here the
m positions of a chunk share every rotation instead:

* **Slots.** With S slots and m positions, slot ``i*m + p`` belongs to position p, row i (``R = S/m`` rows).
  A rotation by ``m*r`` moves row i + r to row i for every position at once, cyclically over the R rows.
* **Input** (the client's layout, :meth:`ChunkShape.pack`): the n_in inputs are cut in ``T`` tiles of
  ``tile`` values (a power of two dividing R); ciphertext t holds, in row i of position p,
  ``x_p[t*tile + (i mod tile)]`` (zero past n_in, and for the absent positions of a short chunk).
* **Output** (:meth:`ChunkShape.unpack`): ciphertext g (``G = ceil(n_out/R)``) holds ``y_p[g*R + o]`` in
  row ``heads(g)[o]`` of position p: row o itself for a full group; a short last group of ``n_g`` outputs
  folds ``c_g`` ways (the largest power of two with ``n_g*c_g <= R``, as the hybrid product does): output
  o's partial sum k sits at ``head + k*w`` (``w = tile/c_g``) and reads the tile's values
  ``(head + k*w + r) mod tile``, r < w, and ``log2 c_g`` rotations at level 1 add them into the head.
* **Product.** ``y_g = sum_t sum_{r < w_g} d_{g,t,r} * rot(x_t, m*r)`` with
  ``d_{g,t,r}[i*m + p] = W[out(i), t*tile + (i + r) mod tile]`` (the same for every p), by baby-step /
  giant-step with ``r = j + baby*k``: the babies ``rot(x_t, m*j)`` by repeated rotation by m (one key), the
  per-(g, k) sums rescaled, then Horner over k with the key ``m*baby`` at level 1 (rotations there are
  cheaper), so a chunk costs ``T*(baby - 1) + sum_g (giants_g - 1 + log2 c_g)`` rotations — shared by its m
  positions and, for the babies, by every output ciphertext — and ``sum_g T*w_g`` plaintext products, at or
  near the slot floor ``m*n_in*n_out/S`` (SmolLM2 at m = 8: 873 per position and layer against 864).

Costs: the plaintexts are m times those of one position (each holds R distinct weights, repeated for the m
positions), so the server holds ``~m*n_in*n_out/S`` plaintexts per part (docs/fhe.md §10). Everything goes
through :class:`fhe.evaluator.Evaluator`; nothing here names a CKKS library.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from fhe.errors import LevelError, ShapeError
from fhe.evaluator import Ciphertext, EvalKeys, Evaluator, check_fresh, encode_groups
from fhe.linalg import rotate_sum, rotate_sum_steps

#: positions per chunk of a multi-position step (a speculative verify step of k + 1 = 8 positions fills
#: one); every multi-position step is cut into chunks of this many. 8 and not 4: at N = 8192 a 576-output
#: part (attn_o, mlp_down) then fills a 512-row group and folds its last 64 outputs 8 ways, so its products
#: reach the slot floor (4 positions leave 448 of 1024 rows idle); the price is twice the plaintexts
CHUNK_POSITIONS = 8
#: a rotation's cost in plaintext products (multiply + add) on SEAL at N = 8192, fresh level: 1.30 ms
#: against 0.149 ms (docs/benchmarks.md, issue 18 item 2); picks the tile and baby step
ROTATION_COST = 9.0
#: a ciphertext on the wire in plaintext products: the client's encryption or decryption (~1.3 ms), the
#: server's parse or serialization (~1 ms) and ~0.2 MB of transfer; keeps the tiles few
CIPHERTEXT_COST = 20.0


@dataclass(frozen=True)
class ChunkShape:
    """The chunk layout of one ``n_out x n_in`` product for ``positions`` positions (from shapes alone:
    client and server build the same one)."""

    slots: int
    n_in: int
    n_out: int
    positions: int
    tile: int
    baby: int

    def __post_init__(self) -> None:
        m, t = self.positions, self.tile
        if m < 1 or m & (m - 1) or self.slots % m:
            raise ShapeError(f"{m} positions must be a power of two dividing {self.slots} slots")
        if t < 1 or t & (t - 1) or self.rows % t or self.baby < 1 or self.baby > t:
            raise ShapeError(f"tile {t} must be a power of two dividing {self.rows} rows, baby in [1, tile]")

    @property
    def rows(self) -> int:
        """R = S/m: the rows of one position."""
        return self.slots // self.positions

    @property
    def tiles(self) -> int:
        """T: input ciphertexts per chunk."""
        return -(-self.n_in // self.tile)

    @property
    def groups(self) -> int:
        """G: output ciphertexts per chunk."""
        return -(-self.n_out // self.rows)

    def outputs(self, g: int) -> int:
        """Outputs of output ciphertext g (R, the last one fewer)."""
        return min(self.rows, self.n_out - g * self.rows)

    def fold(self, g: int) -> int:
        """c_g: partial sums per output of output ciphertext g, the largest power of two with
        ``outputs(g) * c_g <= R`` (and ``<= tile``): a short last group reads ``tile / c_g`` diagonals per
        tile instead of ``tile`` and folds its partial sums with ``log2 c_g`` rotations."""
        c = 1
        while 2 * c <= self.tile and self.outputs(g) * 2 * c <= self.rows:
            c *= 2
        return c

    def window(self, g: int) -> int:
        """w_g = tile / c_g: the diagonals per tile of output ciphertext g."""
        return self.tile // self.fold(g)

    def heads(self, g: int) -> np.ndarray:
        """[outputs(g)] the row of each output of ciphertext g: ``p*tile + u`` (u < w_g); its partial sum k
        sits at row ``head + k*w_g`` and reads the tile's values ``(head + k*w_g + r) mod tile``, r < w_g."""
        w = self.window(g)
        rows = (np.arange(self.rows // self.tile)[:, None] * self.tile + np.arange(w)[None, :]).ravel()
        return rows[: self.outputs(g)]

    def giants(self, g: int) -> int:
        return -(-self.window(g) // self.baby)

    @property
    def rotations(self) -> int:
        """Rotations of one chunk (shared by its positions): babies, giants and folds."""
        return self.tiles * (self.baby - 1) + sum(self.giants(g) - 1 + len(rotate_sum_steps(1, self.fold(g)))
                                                  for g in range(self.groups))

    @property
    def products(self) -> int:
        """Plaintext products of one chunk (an upper bound: all-zero diagonals are skipped)."""
        return sum(self.tiles * self.window(g) for g in range(self.groups))

    @property
    def rotation_steps(self) -> set[int]:
        """Galois steps: m (babies), m * baby (giants) and the folds' m * w_g * 2^i."""
        m = self.positions
        steps = {m} if self.baby > 1 else set()
        for g in range(self.groups):
            if self.giants(g) > 1:
                steps.add(m * self.baby)
            steps |= set(rotate_sum_steps(m * self.window(g), self.fold(g)))
        return {s % self.slots for s in steps} - {0}

    # -- the client's side ---------------------------------------------------------------------------
    def pack(self, xs: np.ndarray) -> list[np.ndarray]:
        """xs [count <= m, n_in] -> the T input slot vectors [S] of one chunk (slot i*m + p: row i, position p)."""
        xs = np.asarray(xs, np.float64)
        if xs.ndim != 2 or not 1 <= xs.shape[0] <= self.positions or xs.shape[1] != self.n_in:
            raise ShapeError(f"a chunk takes [1..{self.positions}, {self.n_in}] inputs, got {xs.shape}")
        pad = np.zeros((self.positions, self.tiles * self.tile))
        pad[: xs.shape[0], : self.n_in] = xs
        reps = self.rows // self.tile
        # tile t: [tile, m] (row i, position p) repeated down the R rows, then row-major = slot i*m + p
        return [np.tile(pad[:, t * self.tile:(t + 1) * self.tile].T, (reps, 1)).ravel() for t in range(self.tiles)]

    def unpack(self, values: list[np.ndarray], count: int) -> np.ndarray:
        """The G decrypted output slot vectors of one chunk -> y [count, n_out]."""
        if len(values) != self.groups or not 1 <= count <= self.positions:
            raise ShapeError(f"a chunk answers {self.groups} ciphertexts for 1..{self.positions} positions")
        rows = np.concatenate([np.asarray(v)[: self.slots].reshape(self.rows, self.positions)[self.heads(g)]
                               for g, v in enumerate(values)])
        return rows[:, :count].T

    # -- the server's side ---------------------------------------------------------------------------
    def diagonals(self, weight: np.ndarray) -> dict[tuple[int, int], list[tuple[int, int, np.ndarray]]]:
        """Per (group g, giant k): [(tile t, baby j, rot(d_{g,t,j+baby*k}, -m*baby*k) as a dense [S] vector)],
        all-zero diagonals left out (a backend may refuse a transparent plaintext)."""
        if weight.shape != (self.n_out, self.n_in):
            raise ShapeError(f"weight {weight.shape} for a {self.n_out} x {self.n_in} chunk product")
        m, tl = self.positions, self.tile
        wp = np.zeros((self.n_out, self.tiles * tl))
        wp[:, : self.n_in] = weight
        out: dict[tuple[int, int], list[tuple[int, int, np.ndarray]]] = {}
        for g in range(self.groups):
            w, heads = self.window(g), self.heads(g)
            rows = (heads[:, None] + np.arange(self.fold(g))[None, :] * w).ravel()    # [n_g * c]: partial-sum rows
            outs = np.repeat(np.arange(len(heads)) + g * self.rows, self.fold(g))      # the output each row sums
            for t in range(self.tiles):
                for r in range(w):
                    d = np.zeros(self.rows)
                    d[rows] = wp[outs, t * tl + (rows + r) % tl]  # row reads x[t*tile + (row+r) mod tile]
                    if not np.any(d):
                        continue
                    j, k = r % self.baby, r // self.baby
                    out.setdefault((g, k), []).append((t, j, np.roll(np.repeat(d, m), m * self.baby * k)))
        return out

    def encode(self, ev: Evaluator, weight: np.ndarray, level: int) -> EncodedChunk:
        """Pre-encode the diagonals for inputs at ``level`` (outputs rescaled to level - 1)."""
        if level < 2:
            raise LevelError("a chunk product needs a level to rescale into")
        scale = ev.prime(level)
        return EncodedChunk(self, level, encode_groups(ev, self.diagonals(weight), level, scale))


@dataclass
class EncodedChunk:
    """A chunk product with its diagonals encoded; call it on the T input ciphertexts of one chunk."""

    shape: ChunkShape
    level: int
    plaintexts: dict

    def __call__(self, ev: Evaluator, cts: list[Ciphertext], keys: EvalKeys) -> list[Ciphertext]:
        """T fresh input ciphertexts -> the G output ciphertexts at ``level - 1``."""
        sh = self.shape
        if len(cts) != sh.tiles:
            raise ShapeError(f"a chunk product takes {sh.tiles} ciphertexts, got {len(cts)}")
        if any(ev.level(c) != self.level for c in cts):
            raise LevelError(f"chunk product encoded for level {self.level}")
        babies = [self._babies(ev, ct, keys) for ct in cts]               # [T][j]: rot(x_t, m*j)
        return [self._group(ev, g, babies, keys) for g in range(sh.groups)]

    def _babies(self, ev: Evaluator, ct: Ciphertext, keys: EvalKeys) -> list[Ciphertext]:
        out = [ct]
        for _ in range(1, self.shape.baby):
            out.append(ev.rotate(out[-1], self.shape.positions, keys))
        return out

    def _group(self, ev: Evaluator, g: int, babies: list[list[Ciphertext]], keys: EvalKeys) -> Ciphertext:
        """Output ciphertext g: per giant k the rescaled sum of its products, then Horner over k at level - 1."""
        sh = self.shape
        out = None
        for k in range(sh.giants(g) - 1, -1, -1):
            if out is not None:
                out = ev.rotate(out, sh.positions * sh.baby, keys)
            grp = self.plaintexts.get((g, k))
            if grp:
                part = ev.dot_plain([(babies[t][j], pt) for t, j, pt in grp])
                ev.rescale_inplace(part)
                out = part if out is None else ev.add(out, part)
        if out is None:
            raise ShapeError(f"output ciphertext {g} of the chunk has no non-zero weight")
        return rotate_sum(ev, out, sh.positions * sh.window(g), sh.fold(g), keys)


class ChunkProducts:
    """A server block's chunk products, one per part, encoded once (at construction).

    Args:
        ev: the block's evaluator.
        weights: part -> W [n_out, n_in] (float64).
        biases: part -> b [n_out], added to that part's outputs (``attn_qkv`` of models with q/k/v biases).
        positions: m.
    """

    def __init__(self, ev: Evaluator, weights: dict[str, np.ndarray], biases: dict[str, np.ndarray] | None = None,
                 positions: int = CHUNK_POSITIONS) -> None:
        self.ev = ev
        self.shapes = {p: chunk_shape(ev.slots, w.shape[1], w.shape[0], positions) for p, w in weights.items()}
        self.encoded = {p: self.shapes[p].encode(ev, w, ev.top) for p, w in weights.items()}
        self._bias = dict(biases or {})
        self._bias_pt: dict[tuple[str, int], object] = {}

    @property
    def rotation_steps(self) -> set[int]:
        return {s for sh in self.shapes.values() for s in sh.rotation_steps}

    def __call__(self, part: str, cts: list[Ciphertext], keys: EvalKeys) -> list[Ciphertext]:
        """The fresh inputs of a step's chunks (T per chunk, in order) -> their outputs at level 1 (G per
        chunk, in order)."""
        sh, ev = self.shapes[part], self.ev
        if not cts or len(cts) % sh.tiles:
            raise ShapeError(f"{part}: chunks of {sh.tiles} ciphertexts, got {len(cts)}")
        for ct in cts:
            check_fresh(ev, keys, ct)
        out = []
        for c in range(0, len(cts), sh.tiles):
            out += self.chunk_outputs(ev, part, cts[c:c + sh.tiles], keys)
        return out

    def chunk_outputs(self, ev: Evaluator, part: str, tiles: list, keys: EvalKeys) -> list:
        """One chunk's T tiles -> its G outputs at level 1 (bias added where the part has one). ``ev`` may be
        another evaluator sharing this one's plaintexts: the gpu backend's batched evaluator runs a batch of
        chunks, one per row, in one call (``server.private.compute``, CUDA graphs of chunk steps)."""
        res = self.encoded[part](ev, tiles, keys)
        if part in self._bias:
            res = [ev.add_plain(r, self._bias_plain(part, g, r)) for g, r in enumerate(res)]
        return [ev.mod_switch(r, 1) for r in res]

    def _bias_plain(self, part: str, g: int, like: Ciphertext):
        if (part, g) not in self._bias_pt:
            sh = self.shapes[part]
            b = np.zeros(sh.groups * sh.rows)
            b[: sh.n_out] = self._bias[part]
            vals = np.repeat(b[g * sh.rows:(g + 1) * sh.rows], sh.positions)    # slot i*m + p: b[g*R + i]
            self._bias_pt[(part, g)] = self.ev.encode(vals, self.ev.level(like), self.ev.scale_of(like))
        return self._bias_pt[(part, g)]


def chunk_count(count: int, positions: int = CHUNK_POSITIONS) -> int:
    """Chunks of a multi-position step of ``count`` positions."""
    return -(-count // positions)


@functools.lru_cache(maxsize=64)
def chunk_shape(slots: int, n_in: int, n_out: int, positions: int = CHUNK_POSITIONS) -> ChunkShape:
    """The cheapest chunk layout of an ``n_out x n_in`` product (tile and baby step, powers of two) by the
    cost model ``products + ROTATION_COST * rotations + CIPHERTEXT_COST * (T + G)``: deterministic, so
    client and server agree."""
    rows = slots // positions
    best, best_cost = None, math.inf
    tile = 1
    while tile <= rows:
        baby = 1
        while baby <= tile:
            sh = ChunkShape(slots, n_in, n_out, positions, tile, baby)
            cost = sh.products + ROTATION_COST * sh.rotations + CIPHERTEXT_COST * (sh.tiles + sh.groups)
            if cost < best_cost:
                best, best_cost = sh, cost
            baby *= 2
        tile *= 2
    if best is None:
        raise ShapeError(f"no chunk layout of {positions} positions in {slots} slots")
    return best


def chunk_rotation_steps(chunks: ChunkProducts | None) -> set[int]:
    """A block's chunk-layout Galois steps (none where the block was built without the layout)."""
    return set() if chunks is None else chunks.rotation_steps


def require_chunks(chunks: ChunkProducts | None) -> ChunkProducts:
    """The block's chunk products, or a ShapeError where it was built without them (``[private]
    offload_chunk_layout = false``: steps of several positions go one ciphertext per position)."""
    if chunks is None:
        raise ShapeError("this block was built without the chunk layout: one ciphertext per position")
    return chunks


__all__ = ["CHUNK_POSITIONS", "ChunkProducts", "ChunkShape", "EncodedChunk", "chunk_count", "chunk_rotation_steps",
           "chunk_shape", "require_chunks"]
