"""The SDK's side of speculative decoding under encryption (no server, no keys): the manifest's
``limits.verify_steps``, the ``verify`` and ``rollback`` envelopes, and when a request speculates."""

from __future__ import annotations

import json

import pytest

from client_sdk import PrivateModeError
from client_sdk import _protocol as proto
from client_sdk._speculate import Speculation
from engine.sampling_params import SamplingParams
from fhe.envelope import Envelope, parse
from tests.client_sdk.test_protocol import N16K, manifest_json


def manifest(verify: bool | None, step: int = 8) -> proto.Manifest:
    d = manifest_json(N16K)
    d["limits"]["max_step_tokens"] = step
    if verify is not None:
        d["limits"]["verify_steps"] = verify
    return proto.Manifest.from_json(d)


def session(man: proto.Manifest) -> proto.Session:
    s = proto.Session(man, "k1", "12" * 32, 500_000_000, 120.0)
    s.opened(proto.Reply(json.dumps({"session_id": "ps_1"}).encode()))
    return s


def test_the_manifest_says_whether_the_server_takes_verify_steps():
    assert manifest(True).verify_steps
    assert not manifest(None).verify_steps                        # an older server
    assert not manifest("yes").verify_steps                       # only a JSON true counts


def test_verify_and_rollback_envelopes():
    s = session(manifest(True))
    env = parse(s.step_call(2, 30, (b"a", b"b", b"c"), verify=True).content, 1 << 20, 1 << 20)
    assert (env.kind, env.positions, len(env.blobs)) == ("verify", (30, 3), 3)
    env = parse(s.rollback_call(2, 31, 2).content, 1 << 20, 1 << 20)
    assert (env.kind, env.layer, env.positions, env.blobs) == ("rollback", 2, (31, 2), ())
    ok = proto.Reply(Envelope("ps_1", "12" * 32, 2, "result", (31, 2), ()).to_bytes())
    s.rollback_done(ok, 2, 31, 2)
    other = proto.Reply(Envelope("ps_1", "12" * 32, 2, "result", (30, 3), ()).to_bytes())
    with pytest.raises(PrivateModeError, match="another rollback"):
        s.rollback_done(other, 2, 31, 2)
    with pytest.raises(PrivateModeError, match="malformed"):
        s.rollback_done(proto.Reply(b"garbage"), 2, 31, 2)


class _Runtime:
    def __init__(self, man: proto.Manifest, default: int = 0) -> None:
        self.manifest, self.num_speculative_tokens = man, default

    def max_len(self) -> int:
        return 256


@pytest.mark.parametrize("asked,default,verify,step,want", [
    (None, 0, True, 8, None),        # off unless asked: the per-request field or the client's default
    (0, 4, True, 8, None),           # the request switches the client's default off
    (4, 0, True, 8, 4),
    (None, 3, True, 8, 3),
    (12, 0, True, 8, 7),             # a verify step is one server step: k <= max_step_tokens - 1
    (4, 0, False, 8, None),          # an older server: plain decoding (same output)
    (4, 0, True, 1, None),           # no room for a draft in a step
])
def test_when_a_request_speculates(asked, default, verify, step, want):
    spec = Speculation.for_request(_Runtime(manifest(verify, step), default),
                                   SamplingParams(max_tokens=8, num_speculative_tokens=asked))
    assert (spec.k if spec else None) == want
