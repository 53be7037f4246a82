"""A short offload plan on the real default model, end to end: the real app (plaintext engine and the
encrypted service with a worker process), the real SDK, real ciphertexts.

Server layers 2, 3 and 29, attention and MLP (MLP: N = 8192, client-aided SiLU). Layer 2's attention is
the shipped sqexp score map at the CI ring N = 16384 (the old calibrated block, still a choice); layers 3
and 29 run attention as linear steps (``softmax = client``: attn_qkv and attn_o at N = 8192 under the
MLP's key set, RoPE and the exact softmax on the client), the form every layer 2-29 of the shipped
offload plan takes. The client runs the embedding, layers 0-1 and 4-28, every RMSNorm and the head. The
SDK's greedy tokens must equal the plan's simulator's (the same approximation without CKKS noise) and
the plaintext tenant's (SmolLM2 on the same server).

Run it under ``flock /tmp/cipherlm-heavy.lock`` (minutes of CKKS on 2 cores).
"""

from __future__ import annotations

import pytest
import torch

from client_sdk import Client

pytestmark = [pytest.mark.slow, pytest.mark.model]

KEYS = {"plain": "clm-offl-plain-000000000000", "enc": "clm-offl-enc-1111111111111"}
# Three tokens (each prompt token is a position through the three server layers, ~14 s here; the tokens'
# equality does not depend on the prompt's length): greedy " time, the", equal to the plaintext model's in
# the offload simulator with logit gaps >= 0.33. Until session 22: "The capital of France is" (five tokens).
PROMPT = "Once upon a"
MAX_TOKENS = 3
SERVER_LAYERS = (2, 3, 29)
APPROX_LAYERS = (2,)            # the others: attention as linear steps


@pytest.fixture(scope="module")
def plans(tmp_path_factory, default_model_dir):
    from engine.config import ModelConfig
    from fhe.offload import CLIENT, SERVER, LayerPlacement, OffloadPlan
    from fhe.params import CKKSParams
    from fhe.plan import Plan
    from server.private.feature import default_plan_path

    full = Plan.load(default_plan_path())
    ckks = CKKSParams(16384, (48,) + (30,) * 11 + (60,), 30).to_dict()   # as the parity and e2e tests
    att = Plan(full.model_id, full.weights_sha256, tuple(lp for lp in full.layers if lp.index in APPROX_LAYERS),
               ckks, "cipherlm offload e2e test", full.calibration)
    folder = tmp_path_factory.mktemp("plans")
    att_path = att.save(folder / "two-layer.plan.json")
    cfg = ModelConfig.from_file(default_model_dir / "config.json")
    layers = tuple(LayerPlacement(i, SERVER, SERVER, "approx" if i in APPROX_LAYERS else "client", "client")
                   if i in SERVER_LAYERS else LayerPlacement(i, CLIENT, CLIENT) for i in range(cfg.num_hidden_layers))
    off = OffloadPlan(full.model_id, cfg.to_hf_dict(), layers, att.content_hash)
    return att, att_path, off, off.save(folder / "two-layer.offload.json")


@pytest.fixture(scope="module")
def app_client(tmp_path_factory, plans, default_model_dir):
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.private.config import PrivateSettings
    from server.settings import Settings, TenantSettings
    from server.tenants import hash_api_key

    _, att_path, _, off_path = plans
    tenants = [TenantSettings(id="plain", api_key_hashes=[hash_api_key(KEYS["plain"])]),
               TenantSettings(id="enc", api_key_hashes=[hash_api_key(KEYS["enc"])], privacy_mode="encrypted")]
    private = PrivateSettings(enabled=True, workers=1, plan=str(att_path), offload_plan=str(off_path),
                              max_session_tokens=32, max_step_tokens=16, max_keys_per_worker=2,
                              state_dir=str(tmp_path_factory.mktemp("state")))
    settings = Settings(model=str(default_model_dir), server_secret="offload-secret", tenants=tenants,
                        private=private, engine={"device": "cpu", "num_kv_blocks": 64},
                        engine_process=False)   # the engine in a thread, as tests/client_sdk/test_private_parity.py
    with TestClient(create_app(settings), base_url="http://testserver") as http:
        yield http


def test_offload_plan_tokens_equal_the_simulator_and_the_plaintext_model(app_client, plans, tmp_path,
                                                                          default_model_dir, smollm2_key_store):
    from client_sdk._private import runtime_of
    from engine.loader import load_model
    from fhe.offload_sim import OffloadSimulator

    plain = Client(api_key=KEYS["plain"], base_url="http://testserver", http_client=app_client, max_retries=0)
    enc = Client(api_key=KEYS["enc"], base_url="http://testserver", http_client=app_client, privacy="encrypted",
                 max_retries=0, key_store=smollm2_key_store)   # layer 2's attention key: the run's SmolLM2 key
    runtime_of(enc).cache_dir = tmp_path / "client"
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}
    want = plain.completions.create(**body).choices[0].text
    got = enc.completions.create(**body).choices[0].text
    rt = enc._private
    ids = rt.tokenizer.encode(PROMPT)
    att, _, off, _ = plans
    sim = OffloadSimulator(load_model(default_model_dir), off, att)
    sim_ids = list(ids)
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            sim_ids.append(int(sim.logits(sim_ids)[-1].argmax()))
    assert got == rt.tokenizer.decode(sim_ids[len(ids):])
    assert got == want
    stats = rt.current_stats           # the last decode token: (attention | attn_qkv, attn_o), mlp_up, mlp_down
    linear = len(SERVER_LAYERS) - len(APPROX_LAYERS)
    assert stats.steps == 3 * len(APPROX_LAYERS) + 4 * linear
    assert stats.parts["mlp_up"][3] == stats.parts["mlp_down"][3] == len(SERVER_LAYERS)
    assert stats.parts["attn_qkv"][3] == stats.parts["attn_o"][3] == linear
