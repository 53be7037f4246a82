"""Packed prefill (fhe/packed.py) on the gpu backend's torch-CPU reference = the SEAL backend, ciphertext for
ciphertext (CI): the device-side path of the projections' diagonals (built in torch, several band shifts per
gather and encode: ``SHIFT_GROUP``, session 19) and the token rows' output maps as one batch (``BATCH_ROWS``,
session 19), with SEAL's encoder, on the same client ciphertexts and keys (tiny GQA model with biases, 2Quad,
N = 16384). Their defaults run on CUDA in tests/fhe/test_gpu_backend_packed.py. Then the projections' kept
diagonals (``PLAIN_CACHE_BYTES``, session 23): a chunk whose public shape (map, first position, rows, level) was
seen before takes its projections' encoded diagonals from the layer's :class:`fhe.packed.PlainCache` instead of
building and encoding them, every output ciphertext still SEAL's; a chunk of another row count (other positions,
other RoPE) must not take them.

Three tokens (five until session 22, ~2x the torch-CPU reference's time): position 0 and a batch of two rows
(u and z of each), so a group of rows is still stacked; what is compared (every output ciphertext, byte for
byte) does not depend on how many positions there are.

One packed prefill serves both tests (session 24; until then each module ran its own, ~24 s): the first chunk runs
with the cache on, which takes the same path as with it off (the same diagonals built, encoded and multiplied per
band shift; the cache only keeps the plaintexts afterwards: ``fhe.packed._maps``), so its ciphertexts are the
cache-off ones that the first test compares with SEAL's, and the second test's later sessions find them kept.
The cache's budget and ``plain_block``: tests/fhe/test_gpu_backend_packed_cache.py.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from fhe import packed
from fhe.attention import EncryptedAttentionLayer
from fhe.backends.gpu import GpuEvaluator
from fhe.backends.gpu.batched import BatchedEvaluator
from fhe.backends.seal import hazmat as seal
from tests.fhe.test_gpu_backend_packed import PackedCase, packed_case


class FirstChunk(NamedTuple):
    """The shared first packed prefill on the torch-CPU reference and what it needs to go on."""

    case: PackedCase
    ev: GpuEvaluator
    gpu: EncryptedAttentionLayer
    keys: object
    device_encoder: bool       # the evaluator has the device-side ``encode_many`` (before it is counted)
    stacked: list[int]         # ciphertexts per ``BatchedEvaluator.stack`` call in the first chunk
    rows: list[int]            # rows through ``encode_many``: cleared per run by ``_run``
    got: list                  # the first chunk's output ciphertexts
    first_rows: int            # rows the first chunk encoded


def _run(first: FirstChunk, cts: list, count: int, expected: list) -> int:
    """A packed prefill of ``cts`` in a new cache on the shared layer; every output must be SEAL's (``expected``),
    byte for byte. Returns the rows it encoded."""
    ev, gpu = first.ev, first.gpu
    got = gpu.prefill_packed(gpu.new_cache(), [ev.deserialize(seal.to_bytes(c)) for c in cts], 0, count, first.keys)
    assert len(got) == len(expected) == count
    for ours, theirs in zip(got, expected, strict=True):
        assert ev.serialize(ours) == ev.serialize(ev.deserialize(seal.to_bytes(theirs)))
    done = sum(first.rows)
    first.rows.clear()
    return done


@pytest.fixture(scope="module")
def first_chunk():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(packed, "SHIFT_GROUP", 3)                  # groups that do not divide the head dim
        mp.setattr(packed, "BATCH_ROWS", True)                # the rows' output maps as one batch
        mp.setattr(packed, "PLAIN_CACHE_BYTES", 1 << 40)      # keep every projection's diagonals
        stacked: list[int] = []
        stack = BatchedEvaluator.stack
        mp.setattr(BatchedEvaluator, "stack", lambda self, cts: stacked.append(len(cts)) or stack(self, cts))
        case = packed_case((3, 14, 15))
        ev = GpuEvaluator(case.params, device="cpu", encoder="seal")
        gpu = EncryptedAttentionLayer(case.model.layers[1], case.model.rotary, case.plan, case.model.config,
                                      case.params, max_tokens=64, evaluator=ev)
        device_encoder = gpu.ev.encode_many is not None
        rows: list[int] = []
        many = ev.encode_many
        mp.setattr(ev, "encode_many", lambda values, level, scale: rows.append(len(values)) or many(values, level,
                                                                                                    scale))
        keys = ev.keys_from_server(case.client.server_keys())
        got = gpu.prefill_packed(gpu.new_cache(), [ev.deserialize(seal.to_bytes(c)) for c in case.chunks], 0,
                                 len(case.x), keys)
        first_rows = sum(rows)
        rows.clear()
        yield FirstChunk(case, ev, gpu, keys, device_encoder, list(stacked), rows, got, first_rows)


def test_packed_prefill_on_the_cpu_reference_is_seals(first_chunk):
    case, ev, got = first_chunk.case, first_chunk.ev, first_chunk.got
    assert first_chunk.device_encoder                         # the device-side diagonals path
    assert len(got) == len(case.want) == len(case.x)
    assert first_chunk.stacked == [len(case.x) - 1] * 2       # u and z of every row but position 0
    for ours, theirs in zip(got, case.want, strict=True):
        assert ev.serialize(ours) == ev.serialize(ev.deserialize(seal.to_bytes(theirs)))


def test_kept_diagonals_give_seals_ciphertexts(first_chunk):
    case, gpu = first_chunk.case, first_chunk.gpu
    model, plan, params, x, client, bc = case.model, case.plan, case.params, case.x, case.client, case.bc
    store = gpu.packed_plaintexts                               # filled with q, k, v by the first chunk
    assert (len(store), store.hits, store.misses) == (3, 0, 3) and store.nbytes > 0
    cpu = EncryptedAttentionLayer(model.layers[1], model.rotary, plan, model.config, params, max_tokens=64)
    two = bc.encrypt_packed(x[1:])                               # another prompt: 2 rows at positions 0, 1
    want_two = cpu.prefill_packed(cpu.new_cache(), two, 0, 2, client.server_keys())
    lay = gpu.geo.layout
    kmap = packed.PackedMap(gpu.geo, torch.zeros(1, lay.num_heads * lay.head_dim, lay.hidden))
    projections = 3 * lay.head_dim * len(kmap._babies_in_use())
    again = _run(first_chunk, case.chunks, 3, case.want)         # a second session, the same chunk shape: all kept
    assert (store.hits, store.misses) == (3, 3)
    assert again == first_chunk.first_rows - projections         # none of the projections' diagonals encoded
    other = _run(first_chunk, two, 2, want_two)                  # 2 rows: other positions in each row, own entries
    assert (len(store), store.hits, store.misses) == (6, 3, 6) and other >= projections
