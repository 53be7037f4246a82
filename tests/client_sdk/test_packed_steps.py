"""The SDK's packed prefill steps (issue 15): the manifest's ``limits.packed_chunk``, the ``packed``
envelope, and when the runtime sends one."""

from __future__ import annotations

import json

import torch

from client_sdk import _protocol as proto
from client_sdk._runtime import PrivateRuntime
from fhe.envelope import Envelope, parse
from tests.client_sdk.test_protocol import N16K, manifest_json


def manifest(chunk: int | None, step: int = 64) -> proto.Manifest:
    d = manifest_json(N16K)
    d["limits"]["max_step_tokens"] = step
    if chunk is not None:
        d["limits"]["packed_chunk"] = chunk
    return proto.Manifest.from_json(d)


def test_the_manifest_names_the_chunk_and_an_older_server_has_none():
    assert manifest(14).packed_chunk == 14
    assert manifest(None).packed_chunk == 0                       # older server: one ciphertext per token
    assert manifest(-3).packed_chunk == 0


def test_a_packed_step_names_its_positions_not_its_ciphertexts():
    s = proto.Session(manifest(14), "k1", "12" * 32, 500_000_000, 120.0)
    s.opened(proto.Reply(json.dumps({"session_id": "ps_1"}).encode()))
    env = parse(s.step_call(2, 14, (b"a", b"b"), count=20).content, 1 << 20, 1 << 20)
    assert (env.kind, env.positions, len(env.blobs)) == ("packed", (14, 20), 2)
    # the per-token kinds are unchanged
    assert parse(s.step_call(2, 20, (b"a",)).content, 1 << 20, 1 << 20).kind == "decode"
    assert parse(s.step_call(2, 0, (b"a", b"b")).content, 1 << 20, 1 << 20).kind == "prefill"
    # the answer of a packed step has one ciphertext per position
    answer = proto.Reply(Envelope("ps_1", "12" * 32, 2, "result", (14, 20), (b"r",) * 20).to_bytes())
    assert len(s.step_result(answer, 2, 14, 20)) == 20


class _Runtime:
    """The two PrivateRuntime methods under test, on a bare object (no server, no keys)."""

    _packs = PrivateRuntime._packs
    _chunk = PrivateRuntime._chunk
    _steps = PrivateRuntime._steps

    def __init__(self, man: proto.Manifest) -> None:
        self.manifest = man


def test_the_runtime_packs_prefills_that_start_on_a_block_boundary():
    rt = _Runtime(manifest(14))
    assert rt._packs(0, 32) and rt._packs(28, 7)
    assert not rt._packs(0, 1)                                    # a single token is a decode step
    assert not rt._packs(28, 6)                                   # under half a chunk: one per token
    assert not rt._packs(5, 9)                                    # off the boundary: one per token
    assert not _Runtime(manifest(None))._packs(0, 32)             # the server takes no packed steps


def test_prefill_steps_are_whole_chunks():
    """max_step_tokens 64 with chunks of 14: steps of 56 positions, so each starts on a boundary, and a
    tail of under half a chunk is a per-token step."""
    starts = []

    class Model:
        def __call__(self, chunk, pos, backend):
            starts.append((int(pos[0]), len(chunk)))
            return torch.zeros(len(chunk), 1)

        def logits(self, h):
            return h

    class Cache:
        def advance(self):
            pass

    rt = _Runtime(manifest(14, step=64))
    rt.model = Model()
    backend = type("B", (), {"cache": Cache()})()
    PrivateRuntime.forward(rt, backend, list(range(130)), 0)
    assert starts == [(0, 56), (56, 56), (112, 14), (126, 4)]     # the short tail on its own
    assert rt._steps(0, 32) == [(0, 28), (28, 4)] and rt._steps(0, 35) == [(0, 35)]
    assert rt._steps(3, 20) == [(0, 20)]                          # off the boundary: plain steps
    rt.packed_prefill = False
    assert rt._steps(0, 130) == [(0, 64), (64, 64), (128, 2)]     # as before packed chunks
