"""A real encrypted-session setup small enough for fast tests: a one-layer 2Quad plan fitted (by hash) to
the tiny server-test model, private settings around it, and the tiny model's CKKS key upload.

No part is faked: the server loads the plan, checks it against the model, builds the client bundle and
(when a session needs one) starts real worker processes that build the encrypted layer.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from server.private.config import PrivateSettings

TINY_HEADS = 4  # tests/server/app_helpers.build_tiny_model_dir
APPROX = ("2quad", 6)


def tiny_plan(model_dir: Path, out: Path) -> Path:
    """A plan encrypting layer 1 of the tiny model with 2Quad (N = 16384), saved as ``out``."""
    from engine.loader import load_model
    from fhe.approx import ScoreApprox
    from fhe.params import ckks_params_for
    from fhe.plan import LayerPlan, Plan, model_fingerprint

    kind, squarings = APPROX
    approx = ScoreApprox(kind, (1.0,) * TINY_HEADS, (5.0,) * TINY_HEADS, squarings, 12.0)
    plan = Plan("tiny", model_fingerprint(load_model(model_dir)), (LayerPlan(1, approx, (-2.0, 9.0)),),
                ckks_params_for(kind, squarings).to_dict(), "cipherlm server tests")
    return plan.save(out)


def private_settings(plan: Path, state_dir: Path, **overrides) -> PrivateSettings:
    """The ``[private]`` table of the tests: the tiny plan, small limits, one worker started on demand."""
    fields = dict(enabled=True, plan=str(plan), state_dir=str(state_dir), workers=1, max_session_tokens=16,
                  max_step_tokens=4, max_step_bytes=64 << 10, max_key_bytes=512 << 20, max_keys_per_worker=1)
    return PrivateSettings(**{**fields, **overrides})


@contextlib.contextmanager
def encrypted_client(model_dir: Path, tmp_path_factory, key: str, **private) -> Iterator[tuple[Any, Any]]:
    """(an encrypted-mode SDK ``Client`` of tenant "enc", the app's ``TestClient``) over the tiny plan, the app's
    lifespan and worker running inside the block; ``private`` overrides :func:`private_settings`."""
    from fastapi.testclient import TestClient

    from client_sdk import Client
    from client_sdk._private import runtime_of
    from server.app import create_app
    from server.settings import Settings, TenantSettings
    from server.tenants import hash_api_key

    plan = tiny_plan(model_dir, tmp_path_factory.mktemp("plan") / "tiny.plan.json")
    tenants = [TenantSettings(id="enc", api_key_hashes=[hash_api_key(key)], privacy_mode="encrypted")]
    settings = Settings(model=str(model_dir), served_model_name="tiny", server_secret="s", tenants=tenants,
                        private=private_settings(plan, tmp_path_factory.mktemp("state"), **private),
                        engine={"device": "cpu", "num_kv_blocks": 16},
                        engine_process=False)   # the engine in a thread: tests/server/app_helpers.make_settings
    with TestClient(create_app(settings), base_url="http://testserver") as http:
        client = Client(api_key=key, base_url="http://testserver", http_client=http, privacy="encrypted",
                        max_retries=0)
        runtime_of(client).cache_dir = tmp_path_factory.mktemp("client-cache")
        yield client, http
        client._private.close_session()


def tiny_key_upload(model_dir: Path, fresh: bool = False) -> bytes:
    """The public-key upload a client of the tiny plan sends (real SEAL keys, secret kept here): the process's
    :func:`tiny_key_set`, or with ``fresh`` a key set of its own (a key no other test holds)."""
    from engine.config import ModelConfig

    config = ModelConfig.from_file(model_dir / "config.json")
    return (make_tiny_key_set(config) if fresh else tiny_key_set(config))[1]


@functools.cache
def tiny_key_set(config) -> tuple[Any, bytes]:
    """(CKKSClient, its public-key upload) for the tiny plans' parameters on a model of ``config``, made once per
    test process.

    Both tiny plans (this module's and :mod:`tests.server.private_app`'s) have the same CKKS parameters, so the
    private-service modules of a run share one key set instead of each generating its own (~3 s of SEAL key
    generation and serialization on 2 cores; ~0.35 GB kept for the run). Each module still runs its own app,
    state directory and worker, so each uploads, screens and loads the key itself."""
    return make_tiny_key_set(config)


def make_tiny_key_set(config) -> tuple[Any, bytes]:
    """A new (CKKSClient, upload) at the tiny plans' parameters (2Quad depth 6: N = 16384) with the level-aware
    keys the SDK makes."""
    from fhe.attention import required_key_levels
    from fhe.backends.seal import wire
    from fhe.backends.seal.keys import CKKSClient
    from fhe.envelope import pack_key_upload
    from fhe.params import ckks_params_for

    kind, squarings = APPROX
    params = ckks_params_for(kind, squarings)
    levels = required_key_levels(config, params, kind, squarings)
    client = CKKSClient(params, levels.steps, levels=levels)
    return client, pack_key_upload(wire.dump_public_keys(client))
