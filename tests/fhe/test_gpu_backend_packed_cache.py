"""The packed prefill's kept diagonals (``fhe.packed.PLAIN_CACHE_BYTES``, session 23) on the gpu backend's torch-CPU
reference (CI): a chunk whose public shape (map, first position, rows, level) was seen before takes its projections'
encoded diagonals from the layer's :class:`fhe.packed.PlainCache` instead of building and encoding them, and every
output ciphertext stays SEAL's, byte for byte (tiny GQA model with biases, 2Quad, N = 16384, SEAL's encoder); a chunk
of another row count (other positions, other RoPE) must not take them. And the cache's byte budget, least recently
used first out.
"""

from __future__ import annotations

import torch

from fhe import packed
from fhe.attention import EncryptedAttentionLayer
from fhe.backends.gpu import GpuEvaluator
from fhe.backends.gpu.evaluator import GpuPlaintext
from fhe.backends.seal import hazmat as seal
from tests.fhe.test_gpu_backend_packed import packed_case


def _rows_encoded(ev, monkeypatch) -> list[int]:
    """Rows through ``ev.encode_many`` so far (a list that grows as the evaluator encodes)."""
    seen: list[int] = []
    many = ev.encode_many

    def counted(values, level, scale):
        seen.append(len(values))
        return many(values, level, scale)

    monkeypatch.setattr(ev, "encode_many", counted)
    return seen


def test_kept_diagonals_give_seals_ciphertexts(monkeypatch):
    monkeypatch.setattr(packed, "SHIFT_GROUP", 3)
    monkeypatch.setattr(packed, "PLAIN_CACHE_BYTES", 1 << 40)
    model, plan, params, x, client, bc, chunks, want = packed_case((3, 14, 15))
    cpu = EncryptedAttentionLayer(model.layers[1], model.rotary, plan, model.config, params, max_tokens=64)
    two = bc.encrypt_packed(x[1:])                               # another prompt: 2 rows at positions 0, 1
    want_two = cpu.prefill_packed(cpu.new_cache(), two, 0, 2, client.server_keys())
    ev = GpuEvaluator(params, device="cpu", encoder="seal")
    gpu = EncryptedAttentionLayer(model.layers[1], model.rotary, plan, model.config, params, max_tokens=64,
                                  evaluator=ev)
    keys = ev.keys_from_server(client.server_keys())
    rows = _rows_encoded(ev, monkeypatch)

    def run(cts, count, expected):
        got = gpu.prefill_packed(gpu.new_cache(), [ev.deserialize(seal.to_bytes(c)) for c in cts], 0, count, keys)
        assert len(got) == len(expected) == count
        for ours, theirs in zip(got, expected, strict=True):
            assert ev.serialize(ours) == ev.serialize(ev.deserialize(seal.to_bytes(theirs)))
        done = sum(rows)
        rows.clear()
        return done

    first = run(chunks, 3, want)                                 # fills q, k, v
    store = gpu.packed_plaintexts
    assert (len(store), store.hits, store.misses) == (3, 0, 3) and store.nbytes > 0
    lay = gpu.geo.layout
    kmap = packed.PackedMap(gpu.geo, torch.zeros(1, lay.num_heads * lay.head_dim, lay.hidden))
    projections = 3 * lay.head_dim * len(kmap._babies_in_use())
    again = run(chunks, 3, want)                                 # a second session, the same chunk shape: all kept
    assert (store.hits, store.misses) == (3, 3)
    assert again == first - projections                         # none of the projections' diagonals encoded
    other = run(two, 2, want_two)                                # 2 rows: other positions in each row, own entries
    assert (len(store), store.hits, store.misses) == (6, 3, 6) and other >= projections


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
