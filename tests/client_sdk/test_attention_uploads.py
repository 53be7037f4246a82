"""How the SDK uploads an attention step's ciphertexts: the manifest's ``upload`` ("full" from a server whose
workers run the gpu backend, which reads them without SEAL's load; absent or "seeded": SEAL's seeded form)."""

from __future__ import annotations

import pytest
import torch

from client_sdk import PrivateModeError
from client_sdk import _protocol as proto
from client_sdk._runtime import PrivateRuntime, StepStats
from tests.client_sdk.test_protocol import N16K, manifest_json


def manifest(upload: str | None) -> proto.Manifest:
    d = manifest_json(N16K)
    if upload is not None:
        d["upload"] = upload
    return proto.Manifest.from_json(d)


def test_the_manifest_names_the_upload_form_and_an_older_server_takes_seeded():
    assert manifest("full").upload == "full"
    assert manifest("seeded").upload == "seeded"
    assert manifest(None).upload == "seeded"
    with pytest.raises(PrivateModeError, match="update the SDK"):
        manifest("compressed-differently")


class _Sent(Exception):
    pass


class _Runtime:
    """``PrivateRuntime.encrypted_attention`` on a bare object: its encryptions are recorded, its call stops
    before any I/O."""

    encrypted_attention = PrivateRuntime.encrypted_attention
    _packs = PrivateRuntime._packs
    _chunk = PrivateRuntime._chunk

    class _Block:
        def layout_input(self, row):
            return row.numpy()

    class _Session:
        def step_call(self, *args, **kwargs):
            return None

    def __init__(self, man: proto.Manifest) -> None:
        self.manifest, self.verifying, self.ckks = man, False, object()
        self.blocks, self.session = {2: self._Block()}, self._Session()

    def exchange(self, call):
        raise _Sent


@pytest.mark.parametrize(("upload", "seeded"), [("full", False), ("seeded", True), (None, True)])
def test_attention_steps_are_encrypted_in_the_form_the_manifest_asks(monkeypatch, upload, seeded):
    from fhe import wire

    sent = []
    monkeypatch.setattr(wire, "encrypt_to_wire", lambda ckks, vec, *, seeded=True: sent.append(seeded) or b"x")
    with pytest.raises(_Sent):
        _Runtime(manifest(upload)).encrypted_attention(2, 5, torch.zeros(1, 8), StepStats())
    assert sent == [seeded]
