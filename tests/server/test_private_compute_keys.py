"""Key registration in one worker (``PrivateCompute.inspect_key`` then ``load_screened_key``): the keys the
inspector parsed are kept for the registry's record of exactly their canonical bytes (one SEAL parse per
registration, and the stored bytes are not sent back), and nothing else is: another digest, another key-set
fingerprint, a second load, a load after another inspection or after ``load_key`` answer False (the service
then sends the stored bytes to ``load_key``, which parses them as before).

The tiny model with an offload plan of linear steps only (small MLP key sets: cheap to make and parse).
"""

from __future__ import annotations

import hashlib

import pytest

from server.keys import Verdict
from tests.server.app_helpers import tiny_model_dir  # noqa: F401 - fixture
from tests.server.test_private_batched import plan_path  # noqa: F401 - fixture


@pytest.fixture
def worker(tiny_model_dir, plan_path):  # noqa: F811
    from server.private.compute import PrivateCompute

    return PrivateCompute(str(tiny_model_dir), None, 16, "cpu", 1, plan_path)


@pytest.fixture(scope="module")
def upload(tiny_model_dir, plan_path):  # noqa: F811
    from fhe.backends.seal import wire
    from fhe.backends.seal.keys import CKKSClient
    from fhe.envelope import pack_key_upload
    from server.private.compute import PrivateCompute

    probe = PrivateCompute(str(tiny_model_dir), None, 16, "cpu", 1, plan_path)
    client = CKKSClient(probe.linear.params, probe.linear.steps)
    return client, pack_key_upload(wire.dump_public_keys(client))


def _digest(verdict) -> str:
    return hashlib.sha256(verdict.canonical).hexdigest()


def test_the_registered_bytes_load_as_the_screened_keys(worker, upload):
    from fhe.backends.seal import wire
    from fhe.envelope import parse_key_upload

    client, data = upload
    verdict = worker.inspect_key(data)
    assert verdict.verdict is Verdict.PUBLIC and verdict.key_set == client.fingerprint
    screened = worker._screened[1]
    assert worker.load_screened_key("fp", _digest(verdict), verdict.key_set) is True
    assert worker.linear.keys["fp"] is screened and screened.fingerprint == client.fingerprint
    assert worker.load_screened_key("again", _digest(verdict), verdict.key_set) is False   # consumed
    assert "again" not in worker.linear.keys
    # the canonical bytes (one copy of the payloads now) still parse to the same key set, blob for blob
    blobs = parse_key_upload(verdict.canonical, len(verdict.canonical))
    parsed = wire.parse_server_keys(blobs, worker.linear.params, worker.linear.steps, fingerprint=verdict.key_set)
    assert parsed.canonical == dict(blobs)


@pytest.mark.parametrize("case", ["other digest", "other key set", "inspected since", "bytes loaded since"])
def test_anything_but_the_screened_record_is_refused(worker, upload, case):
    _, data = upload
    verdict = worker.inspect_key(data)
    digest, key_set = _digest(verdict), verdict.key_set
    if case == "other digest":
        digest = hashlib.sha256(data).hexdigest()
    elif case == "other key set":
        key_set = "0" * 64
    elif case == "inspected since":   # a refused upload in between: nothing screened is kept
        assert worker.inspect_key(b"CLMK" + bytes(100)).verdict is Verdict.MALFORMED
    else:                             # load_key parses its bytes and drops what was screened
        worker.load_key("other", verdict.canonical, verdict.key_set)
        assert worker.linear.keys["other"].fingerprint == verdict.key_set
    assert worker.load_screened_key("fp", digest, key_set) is False
    assert worker._screened is None and "fp" not in worker.linear.keys
