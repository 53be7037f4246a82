"""Speculative verify steps and the encrypted KV cache's rollback (``fhe.speculative``, ``fhe.kv_cache``),
on the symbolic evaluator (exact values, every level/scale/size checked): a verify step, a rollback to
the accepted length, then decoding on is the same computation as never having sent the rejected drafts."""

from __future__ import annotations

import pytest

from fhe.errors import RollbackError, ShapeError
from fhe.kv_cache import EncryptedKVCache
from fhe.simulator import finish
from fhe.speculative import verify_step
from tests.fhe.test_symbolic import symbolic_setup


@pytest.fixture(scope="module")
def setup():
    return symbolic_setup("2quad", 26)     # 21 rows per cache block for this model at N = 16384


def _decode(block, cache, cts, start, keys):
    return [block.forward(cache, c, start + i, keys) for i, c in enumerate(cts)]


def test_rolled_back_drafts_leave_no_trace(setup):
    """A prompt that ends 2 rows before a cache block's end, a verify step of 5 (crossing into a new
    block), 2 kept, then decoding on: the kept and later outputs equal plain decoding's (float rounding)."""
    model, x, plan, block, bc, keys = setup
    B = block.geo.layout.block_tokens
    p = B - 2
    cts = bc.encrypt_input(x)
    plain = block.new_cache()
    want = bc.decrypt_output(_decode(block, plain, cts, 0, keys))

    cache = block.new_cache()
    _decode(block, cache, cts[:p], 0, keys)
    drafts = bc.encrypt_input(x[p:p + 5] * 0.5 + 0.1)     # positions p+2.. : rejected drafts (other values)
    verified = verify_step(block, cache, cts[p:p + 2] + drafts[2:], p, keys)
    assert cache.length == p + 5 and len(cache.k_blocks) == 2
    assert cache.rollback(p + 2) == 3 and cache.length == B and len(cache.k_blocks) == 1
    later = _decode(block, cache, cts[p + 2:], p + 2, keys)
    got = bc.decrypt_output(verified[:2] + later)
    err = (finish(*got) - finish(want[0][p:], want[1][p:])).abs().max().item()
    assert err < 1e-6, err


def test_a_rollback_goes_only_inside_the_last_verify_step(setup):
    model, x, plan, block, bc, keys = setup
    cts = bc.encrypt_input(x[:6])
    cache = block.new_cache()
    _decode(block, cache, cts[:3], 0, keys)
    with pytest.raises(RollbackError, match="committed"):
        cache.rollback(2)                                 # no verify step yet: everything is committed
    verify_step(block, cache, cts[3:6], 3, keys)
    with pytest.raises(RollbackError, match="holds 6"):
        cache.rollback(7)                                 # beyond the cache
    with pytest.raises(RollbackError, match="before 3 are committed"):
        cache.rollback(2)                                 # into positions before the verify step
    assert cache.rollback(6) == 0                         # nothing to drop: the step is committed
    with pytest.raises(RollbackError):
        cache.rollback(4)                                 # ... and cannot be rolled back any more
    assert isinstance(RollbackError("x"), ShapeError)     # the worker's and the service's typed refusal


def test_commit_frees_the_marks():
    cache = EncryptedKVCache(14, 64)
    cache.begin_speculation()
    assert cache.marks
    cache.commit()
    assert not cache.marks and cache.rollback(0) == 0
