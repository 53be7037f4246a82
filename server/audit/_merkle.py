"""RFC 6962 Merkle tree hashing (Certificate Transparency, section 2.1).

``leaf = SHA-256(0x00 || data)``, ``node = SHA-256(0x01 || left || right)``, and for ``n > 1`` leaves
``MTH(D[0:n]) = node(MTH(D[0:k]), MTH(D[k:n]))`` with ``k`` the largest power of two below ``n``.
The prefixes keep a leaf from being passed off as an interior node (second-preimage attack).

:class:`MerkleFrontier` appends leaves in O(log n) memory and gives the root of the current size at
any time, which is what a streaming verifier needs; :func:`merkle_root` is the recursive definition,
kept as the reference the frontier is tested against.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

__all__ = [
    "EMPTY_ROOT",
    "MerkleFrontier",
    "inclusion_proof",
    "leaf_hash",
    "merkle_root",
    "node_hash",
    "verify_inclusion",
]

EMPTY_ROOT = hashlib.sha256(b"").digest()


def leaf_hash(data: bytes) -> bytes:
    """RFC 6962 leaf hash of ``data``."""
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """RFC 6962 interior node hash."""
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """Largest power of two strictly below ``n`` (n >= 2)."""
    return 1 << ((n - 1).bit_length() - 1)


def merkle_root(leaves: Sequence[bytes]) -> bytes:
    """MTH over already-hashed ``leaves`` (the recursive definition)."""
    n = len(leaves)
    if n == 0:
        return EMPTY_ROOT
    if n == 1:
        return leaves[0]
    k = _split(n)
    return node_hash(merkle_root(leaves[:k]), merkle_root(leaves[k:]))


class MerkleFrontier:
    """Incremental RFC 6962 tree: the roots of the perfect subtrees covering the leaves so far."""

    def __init__(self) -> None:
        self.size = 0
        self._stack: list[bytes] = []  # perfect-subtree roots, largest (leftmost) first

    def append(self, leaf: bytes) -> None:
        """Add one leaf hash; merges equal-height subtrees like a binary counter."""
        self._stack.append(leaf)
        self.size += 1
        n = self.size
        while n % 2 == 0:  # each trailing zero bit of the new size is one merge
            right = self._stack.pop()
            self._stack[-1] = node_hash(self._stack[-1], right)
            n //= 2

    def root(self) -> bytes:
        """MTH of all leaves appended so far (right fold over the subtree roots)."""
        if not self._stack:
            return EMPTY_ROOT
        acc = self._stack[-1]
        for left in reversed(self._stack[:-1]):
            acc = node_hash(left, acc)
        return acc

    def copy(self) -> MerkleFrontier:
        """An independent copy (for trying a hypothesis without disturbing this one)."""
        other = MerkleFrontier()
        other.size, other._stack = self.size, list(self._stack)
        return other


def inclusion_proof(leaves: Sequence[bytes], index: int) -> list[bytes]:
    """RFC 6962 audit path of leaf ``index`` in the tree over ``leaves`` (section 2.1.1)."""
    n = len(leaves)
    if not 0 <= index < n:
        raise IndexError(f"leaf {index} outside a tree of {n}")
    if n == 1:
        return []
    k = _split(n)
    if index < k:
        return inclusion_proof(leaves[:k], index) + [merkle_root(leaves[k:])]
    return inclusion_proof(leaves[k:], index - k) + [merkle_root(leaves[:k])]


def verify_inclusion(leaf: bytes, index: int, size: int, proof: Sequence[bytes], root: bytes) -> bool:
    """Check an audit path (RFC 9162 section 2.1.3.2 algorithm)."""
    if not 0 <= index < size:
        return False
    fn, sn, acc = index, size - 1, leaf
    for sibling in proof:
        if sn == 0:
            return False
        if fn % 2 == 1 or fn == sn:
            acc = node_hash(sibling, acc)
            while fn % 2 == 0 and fn != 0:
                fn, sn = fn >> 1, sn >> 1
        else:
            acc = node_hash(acc, sibling)
        fn, sn = fn >> 1, sn >> 1
    return sn == 0 and acc == root
