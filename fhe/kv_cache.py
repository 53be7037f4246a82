"""The per-session encrypted KV cache of one layer (server memory; never leaves the server).

K block b holds ``k_{j,g(h),d}`` at ``slot(d, j, h)`` of the band layout (:mod:`fhe.packing`), newest
token in row 0; V blocks likewise. Blocks are opaque ciphertexts of the layer's evaluator.

Speculative decoding (``docs/fhe.md`` §3b) appends a verify step's positions one by one and may then
roll the cache back to any length inside that step. Every operation on a block is out of place (a
decode insert makes a new ciphertext for the last block), so the state after each position is just the
tuple of block references: :meth:`begin_speculation` / :meth:`mark` record them, :meth:`rollback`
restores one exactly — no masking, no rotation, no level spent, and no key the plan does not have.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fhe.errors import RollbackError
from fhe.evaluator import Ciphertext, Evaluator


@dataclass
class EncryptedKVCache:
    """One session's encrypted K/V blocks for one layer (server memory; never leaves the server)."""

    block_tokens: int
    max_tokens: int
    k_blocks: list[Ciphertext] = field(default_factory=list)
    v_blocks: list[Ciphertext] = field(default_factory=list)
    length: int = 0
    #: The evaluator whose ciphertexts the blocks are (sizes are asked of it).
    evaluator: Evaluator | None = field(default=None, repr=False, compare=False)
    #: length -> (K blocks, V blocks) at each position of the last speculative step: the lengths a
    #: rollback may return to (empty: every position is committed).
    marks: dict[int, tuple[tuple[Ciphertext, ...], tuple[Ciphertext, ...]]] = field(
        default_factory=dict, repr=False, compare=False)

    def rows_in(self, b: int) -> int:
        """Tokens held by block b."""
        return min(self.block_tokens, self.length - b * self.block_tokens)

    def nbytes(self) -> int:
        """Approximate in-memory size of the blocks (0 without an evaluator to ask)."""
        if self.evaluator is None:
            return 0
        return sum(self.evaluator.nbytes(c) for c in self.k_blocks + self.v_blocks)

    # --- speculation ---------------------------------------------------------------------------
    def begin_speculation(self) -> None:
        """Commit everything so far; the positions appended from here on may be rolled back."""
        self.marks = {}
        self.mark()

    def mark(self) -> None:
        """Record the current length as a rollback target (call after each speculative position)."""
        self.marks[self.length] = (tuple(self.k_blocks), tuple(self.v_blocks))

    def commit(self) -> None:
        """Every position is final (no rollback target is kept: the references free their blocks)."""
        self.marks = {}

    def rollback(self, length: int) -> int:
        """Forget the positions from ``length`` on; returns how many were dropped.

        ``length`` may be the current length (nothing to drop) or any length recorded by the last
        speculative step; anything else is a :class:`~fhe.errors.RollbackError`. The cache is committed
        afterwards (one rollback per verify step)."""
        if length == self.length:
            self.commit()
            return 0
        if not 0 <= length < self.length:
            raise RollbackError(f"rollback to {length} positions: the cache holds {self.length}")
        if length not in self.marks:
            lo = min(self.marks) if self.marks else self.length
            raise RollbackError(f"rollback to {length} positions: positions before {lo} are committed")
        k, v = self.marks[length]
        dropped = self.length - length
        self.k_blocks, self.v_blocks, self.length = list(k), list(v), length
        self.commit()
        return dropped
