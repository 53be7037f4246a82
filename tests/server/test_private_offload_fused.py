"""A fused offload plan end to end on the tiny model (fhe.offload_fused): both layers' attention and MLP on
the server as ``attn_qkv``, ``o_up``, ``down_qkv``, ``o_up``, ``mlp_down`` — five round trips per token where
the four-step protocol takes eight. The real app with a worker process, the real SDK, real SEAL ciphertexts
(and the gpu backend's CPU reference as the worker); the greedy tokens are the plaintext model's (every
non-linearity is exact on the client, the fused maps are exact algebra). Mismatches between an SDK and a
server that do not speak the same steps are typed errors.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.server.app_helpers import tiny_model_dir  # noqa: F401 - fixture
from tests.server.private_app import greedy_with_gap, headers, serve_offload_plan

# Three tokens (five, "The capital of France is", until session 22): each prompt token is a position through
# every encrypted step of the plan in each generation here, and nothing checked depends on the prompt's length
# (the prefill still has several positions; the greedy tokens' gap is asserted where they are compared).
PROMPT = "Once upon a"
MAX_TOKENS = 3
PER_TOKEN = {"attn_qkv": 1, "o_up": 2, "down_qkv": 1, "mlp_down": 1}


def _serve(model_dir, tmp_path_factory, fused: bool = True, **private):
    from fhe.offload import offload_plan

    return serve_offload_plan(model_dir, tmp_path_factory,
                              lambda cfg: offload_plan(cfg, "tiny", 0, softmax="client", fused=fused),
                              "tiny-fused", **private)


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):  # noqa: F811
    yield from _serve(tiny_model_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def generated(setup):
    return setup["client"].completions.create(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body={"ignore_eos": True})


def _plain_greedy(setup, ids: list[int]) -> tuple[list[int], float]:
    from fhe.offload_sim import OffloadSimulator

    return greedy_with_gap(OffloadSimulator(setup["model"], setup["off"]), ids, MAX_TOKENS)


def test_fused_steps_give_the_plaintext_models_tokens_in_five_round_trips_per_token(setup, generated):
    rt = setup["client"]._private
    man = setup["http"].get("/v1/private/manifest", headers=headers("enc-a")).json()
    assert man["offload"]["fused"] is True and man["offload"]["round_trips_per_token"] == 5
    assert man["plan_hash"] == setup["off"].content_hash and man["offload"]["plan"]["fused"] is True
    assert man["offload"]["mlp"]["outputs_per_position"]["o_up"] >= 1
    assert set(man["offload"]["mlp"]["chunk_layout"]["parts"]) >= {"o_up", "down_qkv"}
    assert rt.offload.info.fused and rt.offload.fused is not None
    ids = rt.tokenizer.encode(PROMPT)
    want, gap = _plain_greedy(setup, ids)
    assert gap > 1e-3, "the plaintext model's greedy choice is a near-tie: pick another prompt"
    assert generated.choices[0].text == rt.tokenizer.decode(want)
    last = rt.current_stats               # the last decode token's steps, by part
    assert {p: row[3] for p, row in last.parts.items()} == PER_TOKEN and last.steps == 5
    assert not rt.offload.pending         # every kept half was taken by the seam after it


def test_speculation_on_a_fused_plan_keeps_the_output(setup, generated, monkeypatch):
    """Verify steps of a fused plan are multi-position fused steps in the chunk layout: greedy output with
    accepted and with rejected drafts equals the plain run's."""
    from client_sdk._private import runtime_of
    from engine.spec_decode import NgramProposer

    client = setup["client"]
    for draft in (lambda ids: ids[-1], lambda ids: ids[-1] + 1):
        monkeypatch.setattr(NgramProposer, "propose", lambda self, ids, k, d=draft: [d(ids)] * k)
        res = client.completions.create(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"num_speculative_tokens": 2, "ignore_eos": True})
        assert res.choices[0].text == generated.choices[0].text
        assert runtime_of(client).last_speculation.decoder.num_draft_tokens > 0


def test_steps_of_the_other_protocol_are_a_400_and_an_sdk_that_differs_is_refused(setup, generated):
    """An unfused part (attn_o, mlp_up) on a fused server, or a fused part on a layer without it, is 400
    ``bad_layer`` naming the plan's kind; an SDK whose steps differ from the manifest's refuses the server
    before any step (``PrivateModeError``), never sends steps the server cannot run."""
    from client_sdk._exceptions import PrivateModeError
    from client_sdk._offload import OffloadClient
    from fhe.envelope import Envelope

    rt, http, url = setup["client"]._private, setup["http"], "/v1/private/sessions"
    opened = http.post(url, json={"plan_hash": rt.manifest.plan_hash, "mlp_key_id": rt.offload.key_id},
                       headers=headers("enc-a"))
    assert opened.status_code == 201, opened.text
    sid = opened.json()["session_id"]
    for layer, part in ((0, "attn_o"), (0, "mlp_up"), (1, "down_qkv"), (1, "attn_qkv")):
        body = Envelope(sid, rt.offload.fingerprint, layer, "prefill", (0, 1), (b"\0" * 64,), "seal",
                        "", part).to_bytes()
        r = http.post(f"{url}/{sid}/steps", content=body,
                      headers={**headers("enc-a"), "Content-Type": "application/octet-stream"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_layer", (part, r.text)
        assert "fused" in r.json()["error"]["message"]
    assert http.delete(f"{url}/{sid}", headers=headers("enc-a")).status_code == 204
    info = rt.offload.info
    with pytest.raises(PrivateModeError, match="update the SDK|do not match"):
        OffloadClient(rt, dataclasses.replace(info, fused=False))      # an SDK that does not fuse


def test_an_unfused_servers_manifest_is_what_it_was(tiny_model_dir, tmp_path_factory, setup):  # noqa: F811
    """The four-step protocol is still served where the plan is not fused: no ``fused`` key anywhere (older
    SDKs read the manifest unchanged), a fused step is 400 ``bad_layer``."""
    from fhe.envelope import Envelope

    served = _serve(tiny_model_dir, tmp_path_factory, fused=False)
    plain = next(served)
    try:
        man = plain["http"].get("/v1/private/manifest", headers=headers("enc-a")).json()
        assert "fused" not in man["offload"] and "fused" not in man["offload"]["plan"]
        assert man["offload"]["round_trips_per_token"] == 8
        assert "o_up" not in man["offload"]["mlp"]["chunk_layout"]["parts"]
        out = plain["client"].completions.create(prompt=PROMPT, max_tokens=1, temperature=0,
                                                 extra_body={"ignore_eos": True})
        rt = plain["client"]._private
        assert out.usage.completion_tokens == 1 and not rt.offload.info.fused
        url = "/v1/private/sessions"
        sid = plain["http"].post(url, json={"plan_hash": rt.manifest.plan_hash, "mlp_key_id": rt.offload.key_id},
                                 headers=headers("enc-a")).json()["session_id"]
        body = Envelope(sid, rt.offload.fingerprint, 0, "prefill", (0, 1), (b"\0" * 64,), "seal", "",
                        "o_up").to_bytes()
        r = plain["http"].post(f"{url}/{sid}/steps", content=body,
                               headers={**headers("enc-a"), "Content-Type": "application/octet-stream"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_layer", r.text
    finally:
        next(served, None)


@pytest.fixture(scope="module")
def gpu_reference(tiny_model_dir, tmp_path_factory):  # noqa: F811
    yield from _serve(tiny_model_dir, tmp_path_factory, device="cpu-reference")


def test_a_fused_plan_on_the_gpu_reference_worker_gives_the_same_tokens(gpu_reference, generated):
    """The gpu backend's worker path (its torch-CPU reference): one-position fused steps as batches and the
    prefill's fused steps in the chunk layout as chunk rows, full uploads; the tokens are the SEAL worker's."""
    client = gpu_reference["client"]
    out = client.completions.create(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})
    rt = client._private
    assert rt.offload.seeded is False and rt.offload.info.fused
    assert out.choices[0].text == generated.choices[0].text
