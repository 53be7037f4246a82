"""Key registration in one worker (``PrivateCompute.inspect_key`` then ``load_key``): the keys the inspector
parsed are kept for the load of exactly their canonical bytes (one SEAL parse per registration, not two),
and anything else — other bytes, another key-set fingerprint, a load after another inspection — is parsed
from the bytes given, as before.

The tiny model with an offload plan of linear steps only (small MLP key sets: cheap to make and parse).
"""

from __future__ import annotations

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


def test_the_load_after_the_inspection_keeps_the_parsed_keys(worker, upload):
    client, data = upload
    verdict = worker.inspect_key(data)
    assert verdict.verdict is Verdict.PUBLIC and verdict.key_set == client.fingerprint
    screened = worker._screened[1]
    worker.load_key("fp", verdict.canonical, verdict.key_set)
    assert worker.linear.keys["fp"] is screened
    assert screened.fingerprint == client.fingerprint and worker._screened is None
    worker.load_key("again", verdict.canonical, verdict.key_set)   # consumed: parsed from the bytes
    assert worker.linear.keys["again"] is not screened
    assert worker.linear.keys["again"].fingerprint == client.fingerprint


@pytest.mark.parametrize("case", ["other bytes", "other key set", "no key set", "inspected since"])
def test_anything_but_the_screened_bytes_is_parsed(worker, upload, case):
    client, data = upload
    verdict = worker.inspect_key(data)
    screened = worker._screened[1]
    body, key_set = verdict.canonical, verdict.key_set
    if case == "other bytes":      # the upload itself: the same keys, not the bytes the worker wrote
        body = data
    elif case == "other key set":
        key_set = "0" * 64
    elif case == "no key set":     # the fingerprint then comes from the bytes loaded, not the upload
        key_set = None
    else:                          # a refused upload in between: nothing screened is kept
        assert worker.inspect_key(b"CLMK" + bytes(100)).verdict is Verdict.MALFORMED
        assert worker._screened is None
    worker.load_key("fp", body, key_set)
    keys = worker.linear.keys["fp"]
    assert keys is not screened
    if case == "no key set":
        assert keys.fingerprint != client.fingerprint
    else:
        assert keys.fingerprint == key_set
