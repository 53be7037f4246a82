"""An offload plan whose server layers are all linear steps, end to end on the tiny model: no ``[private]
plan``, no attention key.

Layer 0's attention (as ``attn_qkv`` / ``attn_o``) and MLP, and layer 1's attention, run on the server;
layer 1's MLP on the client. The manifest says ``offload.attention_key`` is false, the SDK registers only
the offload key set (N = 8192) and opens its session on it alone; the greedy tokens are the plaintext
model's (every non-linearity is exact on the client). A session request naming an attention key, or an
attention step, is a 400.
"""

from __future__ import annotations

import pytest

from tests.server.app_helpers import tiny_model_dir  # noqa: F401 - fixture
from tests.server.private_app import KEYS, greedy_with_gap, headers, serve_offload_plan

# Three tokens (five, "The capital of France is", until session 22): each prompt token is a position through
# every encrypted step of the plan in each generation here, and nothing checked depends on the prompt's length
# (the prefill still has several positions; the greedy tokens' gap is asserted where they are compared).
PROMPT = "Once upon a"
MAX_TOKENS = 3


def _serve(model_dir, tmp_path_factory, **private):
    """The app with the tiny all-linear offload plan, and an encrypted-mode SDK client on it."""
    from fhe.offload import CLIENT, SERVER, LayerPlacement, OffloadPlan

    layers = (LayerPlacement(0, SERVER, SERVER, "client", "client"), LayerPlacement(1, SERVER, CLIENT, "client"))
    return serve_offload_plan(model_dir, tmp_path_factory,
                              lambda cfg: OffloadPlan("tiny", cfg.to_hf_dict(), layers), "tiny-linear", **private)


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):  # noqa: F811
    yield from _serve(tiny_model_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def generated(setup):
    return setup["client"].completions.create(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body={"ignore_eos": True})


def _plain_greedy(setup, ids: list[int]) -> tuple[list[int], float]:
    """The plaintext model's greedy tokens (the plan's simulator without noise: with no approximated layer
    it runs the plaintext model's functions exactly), and the smallest top-1 / top-2 logit gap on the way."""
    from fhe.offload_sim import OffloadSimulator

    sim = OffloadSimulator(setup["model"], setup["off"])
    return greedy_with_gap(sim, ids, MAX_TOKENS)


def test_a_session_of_linear_steps_needs_no_attention_key_and_matches_the_plaintext_model(setup, generated):
    rt = setup["client"]._private
    man = setup["http"].get("/v1/private/manifest", headers=headers("enc-a")).json()
    assert man["offload"]["attention_key"] is False and man["layers"]["encrypted_attention"] == []
    assert man["plan_hash"] == setup["off"].content_hash and rt.manifest.attention_key is False
    keys = setup["http"].get("/v1/private/keys", headers=headers("enc-a")).json()["data"]
    assert [k["key_id"] for k in keys] == [rt.offload.key_id]          # the offload key set alone
    assert rt.fingerprint is None and rt.upload_bytes == 0 and rt.offload.upload_bytes < 16 << 20
    ids = rt.tokenizer.encode(PROMPT)
    want, gap = _plain_greedy(setup, ids)
    assert gap > 1e-3, "the plaintext model's greedy choice is a near-tie: pick another prompt"
    assert generated.usage.completion_tokens == MAX_TOKENS
    assert generated.choices[0].text == rt.tokenizer.decode(want)


def test_each_step_that_ran_is_timed_by_stage_under_bounded_labels_and_nothing_of_the_session(setup, generated):
    """``cipherlm:private_step_stage_seconds``: the prompt's multi-position steps as ``prefill``, the tokens' as
    ``decode``, every stage of the worker's split among them (SEAL: parse, compute, serialize), the labels
    ``stage`` and ``kind`` only, and no tenant, session, key id or fingerprint in any of its lines."""
    from server.metrics import PRIVATE_STEP_STAGES

    rt = setup["client"]._private
    text = setup["http"].get("/metrics").text
    lines = [ln for ln in text.splitlines() if ln.startswith("cipherlm:private_step_stage_seconds")]
    counts = {ln.split("{", 1)[1].split("}", 1)[0]: float(ln.rsplit(" ", 1)[1])
              for ln in lines if ln.startswith("cipherlm:private_step_stage_seconds_count")}
    stages = {lab.split('stage="', 1)[1].rstrip('"') for lab in counts}
    assert stages <= set(PRIVATE_STEP_STAGES)
    assert {"body_read", "envelope", "digest", "queue_wait", "to_worker", "worker_parse", "worker_compute",
            "worker_serialize", "from_worker", "result", "total"} <= stages
    assert counts['kind="prefill",stage="total"'] >= 4 and counts['kind="decode",stage="total"'] >= 4
    assert all(set(lab.replace('"', "").split(",")) <= {f"kind={k}" for k in ("prefill", "decode")} |
               {f"stage={st}" for st in PRIVATE_STEP_STAGES} | {f"le={le}" for le in _les(lines)}
               for lab in (ln.split("{", 1)[1].split("}", 1)[0] for ln in lines))
    session = rt.session.id if rt.session is not None else None
    secrets = [x for x in (KEYS["enc-a"], "enc-a", session, rt.offload.key_id, rt.offload.fingerprint) if x]
    assert not any(x in ln for x in secrets for ln in lines)


def _les(lines: list[str]) -> set[str]:
    return {ln.split('le="', 1)[1].split('"', 1)[0] for ln in lines if 'le="' in ln}


def test_naming_an_attention_key_or_sending_an_attention_step_is_a_400(setup, generated):
    from fhe.envelope import Envelope

    rt, http, url = setup["client"]._private, setup["http"], "/v1/private/sessions"
    plan = rt.manifest.plan_hash
    r = http.post(url, json={"key_id": rt.offload.key_id, "mlp_key_id": rt.offload.key_id, "plan_hash": plan},
                  headers=headers("enc-a"))
    assert r.status_code == 400 and r.json()["error"]["code"] == "attention_key_unused", r.text
    r = http.post(url, json={"plan_hash": plan}, headers=headers("enc-a"))
    assert r.status_code == 400 and r.json()["error"]["code"] == "mlp_key_required", r.text
    opened = http.post(url, json={"plan_hash": plan, "mlp_key_id": rt.offload.key_id}, headers=headers("enc-a"))
    assert opened.status_code == 201 and opened.json()["key_id"] is None, opened.text
    sid = opened.json()["session_id"]
    assert opened.json()["mlp_key_fingerprint"] == rt.offload.fingerprint
    body = Envelope(sid, rt.offload.fingerprint, 0, "prefill", (0, 1), (b"\0" * 64,)).to_bytes()
    r = http.post(f"{url}/{sid}/steps", content=body,
                  headers={**headers("enc-a"), "Content-Type": "application/octet-stream"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_layer", r.text
    assert http.delete(f"{url}/{sid}", headers=headers("enc-a")).status_code == 204


def test_the_manifest_takes_verify_steps_and_speculation_keeps_the_output(setup, generated, monkeypatch):
    """Linear steps are stateless and the client's clear cache is the only one to roll back, so an
    offload-only deployment advertises ``verify_steps`` and the SDK speculates there: greedy output with
    accepted drafts, and with rejected ones, equals the plain run's."""
    from client_sdk._private import runtime_of
    from engine.spec_decode import NgramProposer

    client, rt = setup["client"], setup["client"]._private
    man = setup["http"].get("/v1/private/manifest", headers=headers("enc-a")).json()
    assert man["limits"]["verify_steps"] is True and rt.manifest.verify_steps

    def greedy(k: int) -> str:
        res = client.completions.create(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"num_speculative_tokens": k, "ignore_eos": True})
        return res.choices[0].text

    for draft in (lambda ids: ids[-1], lambda ids: ids[-1] + 1):       # drafts kept / drafts rejected
        monkeypatch.setattr(NgramProposer, "propose", lambda self, ids, k, d=draft: [d(ids)] * k)
        assert greedy(2) == generated.choices[0].text
        assert runtime_of(client).last_speculation.decoder.num_draft_tokens > 0


def test_the_sdk_refuses_a_server_with_another_chunk_layout(setup, generated):
    """``offload.mlp.chunk_layout`` (version 1) is what the SDK computes from the shapes; a server without it
    (pack17's) or with another layout is refused before any step, never misread."""
    import dataclasses

    from client_sdk._exceptions import PrivateModeError
    from client_sdk._offload import OffloadClient

    rt = setup["client"]._private
    info = rt.offload.info
    assert info.chunk_layout["version"] == 1 and info.chunk_layout["positions"] == rt.offload.chunks["mlp_up"].positions
    for bad in ({}, {**info.chunk_layout, "positions": 4}):
        with pytest.raises(PrivateModeError, match="update the SDK"):
            OffloadClient(rt, dataclasses.replace(info, chunk_layout=bad))


def test_without_the_chunk_layout_steps_go_one_ciphertext_per_position(
        tiny_model_dir, tmp_path_factory, setup, generated, monkeypatch):  # noqa: F811 (the fixture's name)
    """``[private] offload_chunk_layout = false`` (workers short of memory: the layout holds 8x the plaintexts):
    the manifest says so, the key set has only the one-position steps, prefill chunks carry one ciphertext per
    position, and the tokens are the same."""
    from client_sdk._offload import OffloadClient
    from fhe.offload_steps import NO_CHUNK_LAYOUT

    def no_chunks(*args, **kwargs):
        raise AssertionError("a step in the chunk layout on a server without it")

    monkeypatch.setattr(OffloadClient, "_send_chunks", no_chunks)
    served = _serve(tiny_model_dir, tmp_path_factory, offload_chunk_layout=False)
    plain = next(served)
    try:
        rt_chunked = setup["client"]._private
        out = plain["client"].completions.create(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                                 extra_body={"ignore_eos": True})
        rt = plain["client"]._private
        assert rt.offload.info.chunk_layout == NO_CHUNK_LAYOUT and rt.offload.chunks is None
        assert set(rt.offload.info.rotation_steps) < set(rt_chunked.offload.info.rotation_steps)
        assert len(rt.tokenizer.encode(PROMPT)) > 1                   # its prefill had several positions
        assert out.choices[0].text == generated.choices[0].text
    finally:
        next(served, None)


@pytest.fixture(scope="module")
def gpu_reference(tiny_model_dir, tmp_path_factory):  # noqa: F811
    # without the chunk layout a prefill step carries one ciphertext per position (the tiny model's chunks
    # are one ciphertext each), so the pool has several to share
    yield from _serve(tiny_model_dir, tmp_path_factory, device="cpu-reference", offload_chunk_layout=False)


# One process (the serial path) is ``pytest -m heavy``: the pooled run here gives the plaintext model's tokens, and
# tests/client_sdk/test_crypto_pool.py checks in the default run that the pool's decryptions are the serial
# path's bit for bit and its encryptions (seeded and full) decrypt to their values.
@pytest.mark.parametrize("processes", [2, pytest.param(1, marks=pytest.mark.heavy)])
def test_a_gpu_worker_asks_for_full_uploads_and_pooled_client_crypto_keeps_the_tokens(gpu_reference, processes):
    """Workers on the gpu backend (its torch-CPU reference here) publish ``offload.mlp.upload = "full"``: the SDK
    uploads unseeded ciphertexts, which the worker reads without SEAL; with ``crypto_processes = 2`` the prefill's
    multi-ciphertext steps encrypt in a forked pool (the chunk layout's also decrypt there:
    ``tests/client_sdk/test_crypto_pool.py``). The greedy tokens are the plaintext model's
    either way (and those of one process, the serial path)."""
    man = gpu_reference["http"].get("/v1/private/manifest", headers=headers("enc-a")).json()
    assert man["offload"]["mlp"]["upload"] == "full"
    client = gpu_reference["client"]
    from client_sdk._private import runtime_of

    rt = runtime_of(client)
    rt.crypto_processes = processes
    if rt.offload is not None:
        rt.offload.close_pool()
    out = client.completions.create(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert rt.offload.seeded is False
    assert (rt.offload.pool is not None) == (processes > 1)
    want, _ = _plain_greedy(gpu_reference, rt.tokenizer.encode(PROMPT))
    assert out.choices[0].text == rt.tokenizer.decode(want)
    rt.offload.close_pool()
