"""The per-session encrypted KV cache of one layer (server memory; never leaves the server).

K block b holds ``k_{j,g(h),d}`` at ``slot(d, j, h)`` of the band layout (:mod:`fhe.packing`), newest
token in row 0; V blocks likewise. Blocks are opaque ciphertexts of the layer's evaluator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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

    def rows_in(self, b: int) -> int:
        """Tokens held by block b."""
        return min(self.block_tokens, self.length - b * self.block_tokens)

    def nbytes(self) -> int:
        """Approximate in-memory size of the blocks (0 without an evaluator to ask)."""
        if self.evaluator is None:
            return 0
        return sum(self.evaluator.nbytes(c) for c in self.k_blocks + self.v_blocks)
