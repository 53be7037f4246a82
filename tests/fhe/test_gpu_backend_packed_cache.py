"""The packed prefill's kept diagonals (``fhe.packed.PLAIN_CACHE_BYTES``, session 23): the cache's byte budget, least
recently used first out, and ``plain_block``'s views. That a chunk seen before takes its projections' encoded
diagonals from the cache and every output ciphertext stays SEAL's, byte for byte, runs on the gpu backend's
torch-CPU reference in tests/fhe/test_gpu_backend_packed_cpu.py (``test_kept_diagonals_give_seals_ciphertexts``,
there since session 24: it goes on from that module's packed prefill instead of running its own).
"""

from __future__ import annotations

import torch

from fhe import packed
from fhe.backends.gpu.evaluator import GpuPlaintext


def _entry(nbytes: int) -> dict:
    return {0: ([0], [GpuPlaintext(torch.zeros(nbytes // 8, dtype=torch.int64), 1.0)])}


def test_plain_cache_keeps_the_budget_least_recently_used_first_out(monkeypatch):
    monkeypatch.setattr(packed, "PLAIN_CACHE_BYTES", 3000)
    store = packed.PlainCache()
    assert store.put("a", _entry(1000)) and store.put("b", _entry(1000)) and store.put("c", _entry(1000))
    assert store.nbytes == 3000 and store.get("a") is not None      # "a" now the most recently used
    assert store.put("d", _entry(1600))                             # drops "b", then "c"
    assert store.get("b") is None and store.get("c") is None and store.get("a") is not None
    assert store.nbytes == 2600 and len(store) == 2
    assert not store.put("e", _entry(4000)) and len(store) == 2     # over the whole budget: not kept
    assert store.put("a", _entry(2000)) and store.nbytes == 2000 and len(store) == 1   # replaced; "d" dropped
    assert store.get("a")[0][1][0].data.numel() == 250
    assert (store.hits, store.misses) == (3, 2)


def test_plain_block_is_a_view_of_consecutive_rows_only():
    """``plain_block``: ``encode_many``'s plaintexts (consecutive rows of one tensor) as one ``[K, L, N]`` view, read
    in place by ``dot_with``; anything else None (then stacked: a copy)."""
    from fhe.backends.gpu.evaluator import plain_block

    residues = torch.arange(5 * 3 * 8, dtype=torch.int64).view(5, 3, 8)
    pts = [GpuPlaintext(residues[i], 1.0) for i in range(5)]
    block = plain_block(pts[1:4])
    assert block is not None and torch.equal(block, residues[1:4])
    assert block.data_ptr() == residues[1].data_ptr()                       # no copy
    assert plain_block([pts[0], pts[2]]) is None                            # a gap
    assert plain_block([pts[1], pts[0]]) is None                            # out of order
    assert plain_block([pts[0], GpuPlaintext(residues[1].clone(), 1.0)]) is None   # another tensor
    assert plain_block([GpuPlaintext(residues[0, :2], 1.0), GpuPlaintext(residues[0, 2:], 1.0)]) is None  # shapes
