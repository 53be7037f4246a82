"""Block manager: ref counts, slot mapping, salted prefix caching, LRU eviction, copy-on-write."""

from __future__ import annotations

from engine.block_manager import BlockManager
from tests.engine.engine_helpers import make_seq, run_to_computed


def test_allocate_and_slots():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(10)))
    assert bm.admit(seq, [], 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert [bm.slot(seq, p) for p in (0, 3, 4, 9)] == [
        seq.block_table[0] * 4, seq.block_table[0] * 4 + 3,
        seq.block_table[1] * 4, seq.block_table[2] * 4 + 1]
    seq.num_computed_tokens = 10
    seq.token_ids.append(7)
    assert bm.allocate_slots(seq, 1) and len(seq.block_table) == 3   # position 10 fits block 2
    seq.num_computed_tokens = 12
    seq.token_ids += [1, 2]
    assert bm.allocate_slots(seq, 1) and len(seq.block_table) == 4   # position 12 opens block 3
    bm.free(seq)
    assert bm.num_free_blocks == 8 and bm.usage == 0.0


def test_allocation_fails_cleanly_when_full():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(list(range(12)))
    assert not bm.admit(seq, [], 12)
    assert bm.num_free_blocks == 2 and seq.block_table == []


def test_prefix_hit_shares_full_blocks_and_leaves_one_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(list(range(12)), seq_id=0)
    run_to_computed(bm, a)
    b = make_seq(list(range(12)), seq_id=1)
    hits = bm.match_prefix(b)
    assert hits == a.block_table[:2]  # 3 full blocks, but the last token must be computed again
    assert bm.admit(b, hits, 4)
    assert b.num_computed_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert bm.ref_counts[a.block_table[0]] == 2
    assert bm.prefix_hits == 8 and bm.prefix_queries == 24
    c = make_seq(list(range(8)) + [99, 98, 97, 96, 95], seq_id=2)
    assert bm.match_prefix(c) == a.block_table[:2]  # diverges in block 2


def test_different_salts_never_share_blocks():
    bm = BlockManager(num_blocks=32, block_size=4)
    tokens = list(range(20))
    a = make_seq(tokens, seq_id=0, salt="tenant-a")
    run_to_computed(bm, a)
    b = make_seq(tokens, seq_id=1, salt="tenant-b")
    assert bm.match_prefix(b) == []
    run_to_computed(bm, b)
    assert not set(a.block_table) & set(b.block_table)
    for salt in (None, ""):  # no salt and the empty salt are distinct namespaces too
        c = make_seq(tokens, seq_id=2, salt=salt)
        assert bm.match_prefix(c) == []
    a_blocks, b_blocks = set(a.block_table), set(b.block_table)
    bm.free(a)  # a's blocks are free but still cached: still invisible to tenant-b
    d = make_seq(tokens, seq_id=3, salt="tenant-b")
    assert set(bm.match_prefix(d)) <= b_blocks
    e = make_seq(tokens, seq_id=4, salt="tenant-a")
    assert bm.match_prefix(e) and set(bm.match_prefix(e)) <= a_blocks


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_seq(list(range(8)), seq_id=0)        # 2 full blocks
    run_to_computed(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    # cached blocks outlive their owner
    assert bm.match_prefix(make_seq(list(range(9)), seq_id=1)) == a_blocks
    # fill the pool with other data: the cached blocks are evicted, least recently freed first
    big = make_seq(list(range(100, 124)), seq_id=2)
    assert bm.admit(big, [], 24)
    assert bm.match_prefix(make_seq(list(range(9)), seq_id=3)) == []


def test_unhashed_blocks_are_reused_before_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(list(range(6)), seq_id=0)   # 1 full (cached) block + 1 partial
    run_to_computed(bm, a)
    full = a.block_table[0]
    bm.free(a)
    b = make_seq([50, 51], seq_id=1)
    assert bm.admit(b, [], 2)
    assert b.block_table[0] != full   # the partial (unhashed) or a never-used block is taken first
    assert bm.match_prefix(make_seq(list(range(6)), seq_id=2)) == [full]


def test_fork_shares_blocks_and_copies_partial_block_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq(list(range(6)), seq_id=0)
    run_to_computed(bm, parent)
    child = make_seq(list(range(6)), seq_id=1)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert all(bm.ref_counts[b] == 2 for b in parent.block_table)
    child.token_ids.append(1)
    parent.token_ids.append(2)
    assert bm.allocate_slots(child, 1)
    assert child.block_table[0] == parent.block_table[0]     # full block stays shared
    assert child.block_table[1] != parent.block_table[1]     # partial block was copied
    assert bm.take_copies() == [(parent.block_table[1], child.block_table[1])]
    assert bm.allocate_slots(parent, 1) and bm.take_copies() == []  # now sole owner: writes in place
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8
