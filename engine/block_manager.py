"""KV block bookkeeping: ref-counted blocks, per-sequence block tables, slot mapping, prefix caching.

Prefix caching (vLLM's automatic prefix caching): every *full* block of a sequence gets a hash chained
from the start of the sequence, ``h_i = sha256(h_{i-1} || tokens of block i)``, whose root ``h_{-1}`` is
derived from the caller's ``cache_salt`` (the server passes the tenant id). Two sequences share a block
only if every token before and in it is equal *and* their salts are equal, so one tenant can never read,
or time, another tenant's cache. SHA-256 (not Python's ``hash``) so collisions cannot be crafted.

Per-block state is two flat lists (reference counts, hashes), not one object per block: a GPU pool has
10^5+ blocks, and as many Python objects made every full garbage collection walk them (~0.1–0.2 s a pass,
seen as jobs 50 % slower now and then, ``bench/engine_host_cpu.py``).

Blocks whose ref count drops to zero stay in the hash table and go to the back of an LRU free list;
allocation takes from the front and only then drops the old hash (lazy eviction). Blocks without a hash
go to the front, so they are reused before any cached block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from engine.sequence import Sequence


def root_hash(cache_salt: str | None) -> bytes:
    """The chain's root for a salt (None and "" differ)."""
    tag = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode("utf-8")
    return hashlib.sha256(b"cipherlm-kv-prefix-v1" + tag).digest()


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    """Hash of a full block given its parent's hash."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class BlockManager:
    """Allocates KV blocks to sequences; shares full blocks by prefix hash."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks               # sequences holding each block
        self.hashes: list[bytes | None] = [None] * num_blocks  # each block's prefix hash while cached
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write, applied by the runner
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0     # of which found

    # ---- accounting -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat slot (block * block_size + offset) of a token position of ``seq``."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    # ---- hashing ----------------------------------------------------------------------------------
    def update_hashes(self, seq: Sequence) -> list[bytes]:
        """Extend ``seq.block_hashes`` to every full block of its resolved tokens (placeholders of the
        overlapped loop are not hashed); return them."""
        bs, hashes = self.block_size, seq.block_hashes
        parent = hashes[-1] if hashes else root_hash(seq.request.cache_salt)
        for i in range(len(hashes), seq.num_resolved_tokens // bs):
            parent = chain_hash(parent, seq.token_ids[i * bs:(i + 1) * bs])
            hashes.append(parent)
        return hashes

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of ``seq`` (at least one token is always left to compute)."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for h in self.update_hashes(seq)[:(seq.num_tokens - 1) // self.block_size]:
            bid = self._cached.get(h)
            if bid is None:
                break
            hits.append(bid)
        return hits

    # ---- allocation -------------------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int, num_hit_blocks: int = 0) -> int:
        """Free blocks that scheduling ``num_new_tokens`` more tokens of ``seq`` would take."""
        held = max(len(seq.block_table), num_hit_blocks)
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - held) + (1 if self._needs_cow(seq) else 0)

    def admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> bool:
        """Give a waiting sequence its prefix hits plus room for ``num_new_tokens``; False if no room."""
        free_hits = sum(1 for b in hits if self.ref_counts[b] == 0)
        need = self.blocks_needed(seq, len(hits) * self.block_size + num_new_tokens, len(hits))
        if need > len(self._free) - free_hits:
            return False
        for bid in hits:
            self._ref(bid)
        seq.block_table = list(hits)
        seq.num_computed_tokens = seq.num_hashed_blocks = len(hits)
        seq.num_computed_tokens *= self.block_size
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += seq.num_computed_tokens
        return self.allocate_slots(seq, num_new_tokens)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make the block table cover ``num_new_tokens`` more tokens; False (nothing changed) if no room."""
        bs, table, computed = self.block_size, seq.block_table, seq.num_computed_tokens
        if computed + num_new_tokens <= len(table) * bs and (
                computed % bs == 0 or self.ref_counts[table[computed // bs]] == 1):
            return True  # the decode step's usual case: room in its own last block (the checks below, inlined)
        if self.blocks_needed(seq, num_new_tokens) > len(self._free):
            return False
        if self._needs_cow(seq):
            self._copy_on_write(seq)
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        while len(seq.block_table) < total:
            seq.block_table.append(self._take_free())
        return True

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references (tail first, so tails are evicted before shared heads)."""
        for bid in reversed(seq.block_table):
            self._release(bid)
        seq.block_table = []

    def trim(self, seq: Sequence) -> None:
        """KV rollback: drop the blocks past those the sequence's tokens need (a verify step allocated
        slots for drafts that were rejected; their K/V in the kept blocks is overwritten later)."""
        keep = -(-seq.num_tokens // self.block_size)
        for bid in reversed(seq.block_table[keep:]):
            self._release(bid)
        del seq.block_table[keep:]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share every block of ``parent`` (the shared partial block is copied on write)."""
        for bid in parent.block_table:
            self.ref_counts[bid] += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_hashed_blocks = parent.num_hashed_blocks

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly computed full blocks in the prefix cache (those whose tokens are all
        resolved: the overlapped loop calls again once a placeholder is filled in)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_resolved_tokens) // self.block_size
        if num_full <= seq.num_hashed_blocks:
            return
        hashes = self.update_hashes(seq)
        for i in range(seq.num_hashed_blocks, num_full):
            bid = seq.block_table[i]
            if self.hashes[bid] is None and hashes[i] not in self._cached:
                self.hashes[bid] = hashes[i]
                self._cached[hashes[i]] = bid
        seq.num_hashed_blocks = num_full

    # ---- KV transfer between instances (engine.disagg) ----------------------------------------------
    def cached_block(self, block_hash: bytes) -> int | None:
        """The block holding the full block of this hash, if it is still cached."""
        return self._cached.get(block_hash)

    def adopt_cached(self, block_hash: bytes) -> tuple[int, bool] | None:
        """A block to receive a transferred full block of this hash: (block id, whether its K/V must be
        written). The block enters the prefix cache unreferenced, so a request with this prefix hits it;
        None when every block is in use."""
        if block_hash in self._cached:
            return self._cached[block_hash], False
        if not self._free:
            return None
        bid = self._take_free()
        self.hashes[bid] = block_hash
        self._cached[block_hash] = bid
        self._release(bid)  # ref 0, hashed: back of the LRU, kept until space runs out
        return bid, True

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write (src, dst) block pairs the runner must apply before the next forward."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # ---- internals --------------------------------------------------------------------------------
    def _needs_cow(self, seq: Sequence) -> bool:
        """The next write lands in a partly filled block that another sequence also holds."""
        if seq.num_computed_tokens % self.block_size == 0 or not seq.block_table:
            return False
        last = seq.block_table[seq.num_computed_tokens // self.block_size]
        return self.ref_counts[last] > 1

    def _copy_on_write(self, seq: Sequence) -> None:
        idx = seq.num_computed_tokens // self.block_size
        src = seq.block_table[idx]
        dst = self._take_free()
        self.ref_counts[src] -= 1
        seq.block_table[idx] = dst
        self.pending_copies.append((src, dst))

    def _release(self, bid: int) -> None:
        self.ref_counts[bid] -= 1
        if self.ref_counts[bid] == 0:
            self._free[bid] = None
            if self.hashes[bid] is None:
                self._free.move_to_end(bid, last=False)  # nothing to keep: reuse first

    def _ref(self, bid: int) -> None:
        if self.ref_counts[bid] == 0:
            del self._free[bid]
        self.ref_counts[bid] += 1

    def _take_free(self) -> int:
        """Pop the least recently freed block, evicting its cached hash (lazy eviction)."""
        bid, _ = self._free.popitem(last=False)
        h = self.hashes[bid]
        if h is not None:
            if self._cached.get(h) == bid:
                del self._cached[h]
            self.hashes[bid] = None
        self.ref_counts[bid] = 1
        return bid
