"""Searching what a server received, logged or wrote for secret bytes: many needles, haystacks of hundreds of MB.

``needle in hay`` once per needle costs a pass over the haystack per needle: 66 needles over the ~1 GB a
private server writes (the client bundle, the stored key set) took ~50 s of one end-to-end test, since
serialized CKKS residues (64-bit words with zero high bytes) defeat the search's skip table. Here every
needle of ``2 * WORD - 1`` bytes or more is found in **one** pass over the haystack's aligned 8-byte words:
an occurrence at offset p covers the aligned word at ``ceil(p / 8) * 8``, which equals the needle's 8 bytes
at offset ``(-p) mod 8`` (< 8, so inside the needle). The pass looks every aligned word up among the needles'
pieces at offsets 0..7 (a table indexed by a 24-bit multiplicative hash of the word, then the pieces
themselves), and each hit is confirmed by comparing the whole needle there. Shorter needles fall back to ``in``.
"""

from __future__ import annotations

import numpy as np

WORD = 8
_CHUNK = 1 << 23      # words per lookup: bounds the temporaries to ~150 MB whatever the haystack
_BITS = 24
_MUL = np.uint64(0x9E3779B97F4A7C15)


def _hash(words: np.ndarray) -> np.ndarray:
    return ((words * _MUL) >> np.uint64(64 - _BITS)).astype(np.intp)


def found(needles: dict[str, bytes], hay: bytes | bytearray | memoryview) -> list[str]:
    """The names of the ``needles`` that occur in ``hay``, in the order given (empty: none does)."""
    hay = bytes(hay) if not isinstance(hay, bytes) else hay
    hits = {name for name, n in needles.items() if len(n) < 2 * WORD - 1 and n in hay}
    pieces: dict[int, list[tuple[str, int]]] = {}
    for name, n in needles.items():
        if len(n) >= 2 * WORD - 1:
            for s in range(WORD):
                pieces.setdefault(int.from_bytes(n[s:s + WORD], "little"), []).append((name, s))
    if pieces:
        keys = np.array(sorted(pieces), dtype=np.uint64)
        table = np.zeros(1 << _BITS, dtype=bool)        # a one-pass filter by a multiplicative hash of the word
        table[_hash(keys)] = True
        words = np.frombuffer(hay, dtype="<u8", count=len(hay) // WORD)
        for lo in range(0, len(words), _CHUNK):
            part = words[lo:lo + _CHUNK]
            for w in np.flatnonzero(table[_hash(part)]):
                for name, s in pieces.get(int(part[w]), ()):
                    start = (lo + int(w)) * WORD - s
                    n = needles[name]
                    if start >= 0 and hay[start:start + len(n)] == n:
                        hits.add(name)
    return [name for name in needles if name in hits]


__all__ = ["WORD", "found"]
