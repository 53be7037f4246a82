"""The server half of speculative decoding under encryption (``docs/fhe.md`` §3b).

The client proposes ``k`` drafts from its own plaintext history and sends its last token and the drafts
as one **verify** step per encrypted layer: ``k + 1`` fresh ciphertexts, one per position, appended
after the cache. Each runs the decode path (:meth:`fhe.attention.EncryptedAttentionLayer.forward`), so
position ``start + i`` attends to the cache and the ``i`` positions before it in the step — exactly what
a decode step at that position computes. The cache records its state after every position
(:meth:`fhe.kv_cache.EncryptedKVCache.mark`); the client verifies locally and rolls the cache back to the
accepted length with a ``rollback`` message (:meth:`fhe.kv_cache.EncryptedKVCache.rollback`).

Why not the packed prefill path (:mod:`fhe.packed`): a packed chunk must start on a cache block
boundary and becomes a block of its own, and dropping its newest rows would need a rotation the plan
has no key for at that level (the kept rows sit at the bottom of the chunk) or a mask the level budget
cannot pay; and its projection costs the same for 1 token as for a full chunk (~20 decode steps'
worth at N = 32768), so a verify step of a few drafts would cost more than decoding them.
"""

from __future__ import annotations

from fhe.evaluator import Ciphertext, EvalKeys
from fhe.kv_cache import EncryptedKVCache


def verify_step(block, cache: EncryptedKVCache, cts: list[Ciphertext], start: int,
                keys: EvalKeys) -> list[Ciphertext]:
    """Positions ``start ..`` of a verify step through ``block`` (an ``EncryptedAttentionLayer``), one
    decode per position; afterwards the cache may be rolled back to any length in ``start .. start + n``."""
    cache.begin_speculation()
    outs = []
    for i, ct in enumerate(cts):
        outs.append(block.forward(cache, ct, start + i, keys))
        cache.mark()
    return outs


__all__ = ["verify_step"]
