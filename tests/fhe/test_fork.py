"""One step on two cores (fhe/fork.py, issue 15 item 4): a forked child runs part of a decode step or of a
packed prefill chunk; the results equal the one-process path's, and a failing child fails the step with a
typed error and leaves no process behind."""

from __future__ import annotations

import os

import pytest

from fhe.fork import Forked, ForkedStepError
from fhe.simulator import finish
from tests.fhe.test_symbolic import symbolic_setup


def _two(block):
    block.processes = 2
    return block


@pytest.mark.parametrize("kind", ["sqexp", "polyexp"])
def test_forked_packed_prefill_and_decode_equal_one_process(kind):
    """45 prompt tokens over two packed chunks (the second also attends to the first), then decode steps
    across a block boundary: two processes give the values of one, on the symbolic evaluator (levels,
    scales and sizes checked on both sides of each pipe)."""
    prompt, total = 45, 49
    model, x, plan, block, bc, keys = symbolic_setup(kind, total)
    one, two = block.new_cache(), block.new_cache()
    chunks = bc.encrypt_packed(x[:prompt])
    block.processes = 1
    out_1 = block.prefill_packed(one, chunks, 0, prompt, keys)
    out_2 = _two(block).prefill_packed(two, chunks, 0, prompt, keys)
    assert len(out_2) == prompt and two.length == prompt and len(two.k_blocks) == len(one.k_blocks)
    got_1, got_2 = finish(*bc.decrypt_output(out_1)), finish(*bc.decrypt_output(out_2))
    assert (got_1 - got_2).abs().max().item() < 1e-9
    for pos in range(prompt, total):
        ct = bc.encrypt_input(x[pos:pos + 1])[0]
        block.processes = 1
        d1 = block.forward(one, ct, pos, keys)
        d2 = _two(block).forward(two, ct, pos, keys)
        y1, y2 = finish(*bc.decrypt_output([d1])), finish(*bc.decrypt_output([d2]))
        assert (y1 - y2).abs().max().item() < 1e-9


def test_forked_decode_from_the_first_token():
    """Decode steps from position 0 (the single-token path, then a cache shorter than one block): the
    child's only share is the V path."""
    model, x, plan, block, bc, keys = symbolic_setup("2quad", 3)
    one, two = block.new_cache(), block.new_cache()
    for pos in range(3):
        ct = bc.encrypt_input(x[pos:pos + 1])[0]
        block.processes = 1
        d1 = block.forward(one, ct, pos, keys)
        d2 = _two(block).forward(two, ct, pos, keys)
        assert (finish(*bc.decrypt_output([d1])) - finish(*bc.decrypt_output([d2]))).abs().max().item() < 1e-9


def test_a_failing_child_fails_the_step_and_is_reaped():
    model, x, plan, block, bc, keys = symbolic_setup("2quad", 1)

    def child(ch):
        raise ValueError("boom")

    forked = Forked(block.ev, child)
    with pytest.raises(ForkedStepError, match="ValueError: boom"):
        with forked as ch:
            ch.recv()
    with pytest.raises(ChildProcessError):   # already reaped (not -1: other tests' workers may still run)
        os.waitpid(forked.pid, os.WNOHANG)


def test_a_child_that_dies_is_an_error_not_a_hang():
    model, x, plan, block, bc, keys = symbolic_setup("2quad", 1)
    with pytest.raises(ForkedStepError, match="ended before"):
        with Forked(block.ev, lambda ch: os._exit(3)) as ch:
            ch.recv()


def test_the_step_processes_setting_is_bounded():
    """[private] step_processes: 1 (default) or 2; anything else is refused when the settings load."""
    from pydantic import ValidationError

    from server.private.config import PrivateSettings

    assert PrivateSettings().step_processes == 1
    assert PrivateSettings(step_processes=2).step_processes == 2
    for bad in (0, 3):
        with pytest.raises(ValidationError):
            PrivateSettings(step_processes=bad)


def test_seal_ciphertexts_cross_the_fork_unchanged():
    """Real SEAL (N = 8192): a child forked after the keys are loaded rotates and multiplies with them; its
    ciphertexts, sent back through the pipe, are byte for byte the ones this process computes."""
    import numpy as np

    from fhe.backends import evaluator_for
    from fhe.backends.seal.keys import CKKSClient
    from fhe.evaluator import relin_rescale
    from fhe.params import CKKSParams

    params = CKKSParams(8192, (60, 40, 40, 60), 40)
    client = CKKSClient(params, (1,))
    ev, keys = evaluator_for(params, "seal"), client.server_keys()
    ct = ev.deserialize(client.encrypt_bytes(np.linspace(-1, 1, ev.slots)))

    def work(c):
        return [ev.rotate(c, 1, keys), relin_rescale(ev, ev.mul(c, c), keys)]

    def child(ch):
        (got,) = ch.recv()
        return work(got)

    with Forked(ev, child) as ch:
        ch.send([ct])
        theirs = ch.recv()
    assert [ev.serialize(c) for c in theirs] == [ev.serialize(c) for c in work(ct)]
