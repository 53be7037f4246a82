"""An offload plan end to end at the smallest real configuration: the real app and worker process, the
real SDK, real ciphertexts.

The tiny random model (2 layers, hidden 64) with an offload plan that runs every part but layer 0's MLP
on the server, one of each kind: layer 0's attention as linear steps (``softmax = client``: attn_qkv,
the client's exact softmax on its clear cache, attn_o; N = 8192), layer 1's attention calibrated (2Quad,
N = 16384, the tiny attention plan of ``tests/server/private_app.py``) and layer 1's MLP (N = 8192,
client-aided SiLU, the same small key set as layer 0's linear steps). The SDK's greedy tokens must be
the plan's simulator's; the linear steps' checks answer 4xx with OpenAI-style bodies; the bundle holds no
server tensor; no secret key byte, no decrypted intermediate and no prompt reaches the server's files or
logs.
"""

from __future__ import annotations

import logging

import pytest
import torch

from client_sdk import Client
from tests.leaks import found
from tests.server.app_helpers import tiny_model_dir  # noqa: F401 - fixture
from tests.server.private_app import KEYS, greedy_with_gap, private_settings, tiny_plan

# Three tokens (five, "The capital of France is", until session 22): each prompt token is a position through
# every encrypted step of the plan in each generation here, and nothing checked depends on the prompt's length
# (the prefill still has several positions; the greedy tokens' gap is asserted where they are compared).
PROMPT = "Once upon a"
MAX_TOKENS = 3
OCTET = {"Content-Type": "application/octet-stream"}


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):  # noqa: F811
    from fastapi.testclient import TestClient

    from engine.loader import load_model
    from fhe.offload import CLIENT, SERVER, LayerPlacement, OffloadPlan
    from fhe.plan import Plan
    from server.app import create_app

    model = load_model(tiny_model_dir)
    folder = tmp_path_factory.mktemp("plans")
    att_path = tiny_plan(model, folder)
    att = Plan.load(att_path)
    assert att.layer_indices == (1,)
    layers = (LayerPlacement(0, SERVER, CLIENT, "client"), LayerPlacement(1, SERVER, SERVER, "approx", "client"))
    off = OffloadPlan("tiny", model.config.to_hf_dict(), layers, att.content_hash)
    off_path = off.save(folder / "tiny.offload.json")
    state = tmp_path_factory.mktemp("state")
    settings = private_settings(tiny_model_dir, att_path, state, offload_plan=str(off_path), max_step_tokens=8)
    app = create_app(settings)
    with TestClient(app, base_url="http://testserver") as http:
        client = Client(api_key=KEYS["enc-a"], base_url="http://testserver", http_client=http,
                        privacy="encrypted", max_retries=0)
        from client_sdk._private import runtime_of

        runtime_of(client).cache_dir = tmp_path_factory.mktemp("client-cache")
        yield {"http": http, "client": client, "model": model, "att": att, "off": off, "state": state}
        if client._private is not None:
            client._private.close_session()


@pytest.fixture(scope="module")
def generated(setup):
    """The SDK's greedy tokens for PROMPT (with the server's log records of that run, and the k vectors
    the client decrypted from layer 0's attn_qkv steps: intermediates only the client may see)."""
    from fhe.offload_attention import AttentionLinearClient

    handler, seen = _Records(), []
    root, split = logging.getLogger(), AttentionLinearClient.split_qkv
    root.addHandler(handler)
    old = root.level
    root.setLevel(logging.DEBUG)

    def spy(self, values):
        q, k, v = split(self, values)
        seen.append(k)
        return q, k, v

    AttentionLinearClient.split_qkv = spy
    try:
        out = setup["client"].completions.create(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                                 extra_body={"logprobs": 1, "ignore_eos": True})
    finally:
        AttentionLinearClient.split_qkv = split
        root.removeHandler(handler)
        root.setLevel(old)
    setup["decrypted_k"] = seen
    return out, handler.messages


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _simulated_greedy(setup, ids: list[int], n: int = MAX_TOKENS) -> tuple[list[int], float]:
    """The plan's simulator's ``n`` greedy tokens, and the smallest top-1 / top-2 logit gap on the way."""
    from fhe.offload_sim import OffloadSimulator

    sim = OffloadSimulator(setup["model"], setup["off"], setup["att"])
    return greedy_with_gap(sim, ids, n)


def test_the_sdk_runs_the_offload_plan_and_matches_its_simulator(setup, generated):
    out, _ = generated
    rt = setup["client"]._private
    ids = rt.tokenizer.encode(PROMPT)
    want, gap = _simulated_greedy(setup, ids)
    assert gap > 1e-3, "the simulator's greedy choice is a near-tie: pick another prompt"
    got = rt.tokenizer.encode(out.choices[0].text)
    assert out.usage.completion_tokens == MAX_TOKENS
    assert rt.tokenizer.decode(want) == out.choices[0].text, (want, got)


def test_each_token_runs_every_part_once(setup, generated):
    from fhe.offload_steps import offload_rotation_steps

    man = setup["http"].get("/v1/private/manifest", headers=_auth()).json()
    assert man["offload"]["server_mlp"] == [1] and man["offload"]["server_attention"] == [0, 1]
    assert man["offload"]["server_attention_linear"] == [0] and man["layers"]["encrypted_attention"] == [1]
    assert man["offload"]["plan_hash"] == setup["off"].content_hash
    assert man["offload"]["mlp"]["ckks"]["poly_modulus_degree"] == 8192
    # one small key set for both kinds of linear step: the union of their Galois steps
    assert man["offload"]["mlp"]["rotation_steps"] == list(offload_rotation_steps(setup["model"].config))
    rt = setup["client"]._private
    stats = rt.current_stats        # the last token's: one decode step of each part
    assert all(stats.parts[p][3] == 1 for p in ("attn_qkv", "attn_o", "mlp_up", "mlp_down"))
    assert stats.steps == 5         # attn_qkv(0) -> attn_o(0) -> attention(1) -> mlp_up(1) -> mlp_down(1)


def test_the_bundle_holds_no_server_tensor(setup, generated):
    from safetensors import safe_open

    from fhe.bundle import offload_withheld_names

    rt = setup["client"]._private
    path = rt.cache_dir / "bundles" / f"{rt.manifest.bundle_sha256}.safetensors"
    with safe_open(str(path), framework="pt") as fh:
        names = set(fh.keys())
    withheld = set(offload_withheld_names(setup["model"].config, setup["off"]))
    assert withheld and not names & withheld
    assert not [n for n in names if n.startswith(("model.layers.0.self_attn", "model.layers.1.self_attn",
                                                  "model.layers.1.mlp"))]
    assert "model.layers.0.mlp.down_proj.weight" in names       # the client's own part is there


def test_no_secret_and_no_prompt_reaches_the_server(setup, generated):
    """The server holds only public keys and ciphertexts; neither secret key, nor an intermediate the client
    decrypted (layer 0's k vectors: its clear cache), nor the prompt or the generated text, is in any file
    it wrote (registry, key material, audit log, bundles) or its logs."""
    out, messages = generated
    rt = setup["client"]._private
    secrets = [rt.ckks.unsafe_export_secret(), rt.offload.ckks.unsafe_export_secret()]
    needles = [s[len(s) // 2:len(s) // 2 + 64] for s in secrets]
    ks = setup["decrypted_k"]
    assert ks, "no attn_qkv step was decrypted: the check would be empty"
    needles += [k.flatten()[:4].to(dt).numpy().tobytes() for k in ks for dt in (torch.float32, torch.float64)]
    texts = [PROMPT.encode(), out.choices[0].text.encode()]
    files = [p for p in setup["state"].rglob("*") if p.is_file()]
    assert files
    for p in files:
        data = p.read_bytes()
        assert not found(dict(enumerate(needles)), data), p
        if p.suffix != ".safetensors":   # the bundle holds the tokenizer, whose vocabulary has every word
            assert not any(t in data for t in texts if len(t) > 8), p
    assert messages, "the run logged nothing: the check would be empty"
    shown = [PROMPT] + ([out.choices[0].text] if len(out.choices[0].text) >= 8 else [])
    shown += [f"{float(ks[0].flatten()[0]):.6f}"]               # nor a decrypted value, printed
    assert not [m for m in messages if any(t in m for t in shown)]


# -- the MLP steps' checks: 4xx, OpenAI-style bodies ----------------------------------------------------


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS['enc-a']}"}


@pytest.fixture()
def session(setup, generated):
    rt = setup["client"]._private
    sid = rt.open_session()
    yield rt, sid
    rt.close_session()


def _mlp_body(rt, sid, *, layer=1, part="mlp_up", start=0, fingerprint=None, blobs=None, params=None,
              count=None) -> bytes:
    from fhe.backends.seal import wire
    from fhe.envelope import Envelope
    from fhe.fingerprint import params_hash
    from fhe.linalg import replicate_input

    off = rt.offload
    if blobs is None:
        lay = off.layout
        vec = replicate_input(torch.randn(lay.hidden).double().numpy(), lay.slots, lay.up_periods[0])
        blobs = (wire.encrypt_to_wire(off.ckks, vec),)
    return Envelope(sid, fingerprint or off.fingerprint, layer, "prefill", (start, count or len(blobs)), blobs, "seal",
                    params if params is not None else params_hash(off.params), part).to_bytes()


def _post(setup, sid, body):
    return setup["http"].post(f"/v1/private/sessions/{sid}/steps", content=body, headers={**_auth(), **OCTET})


def _error(resp, status: int, code: str) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == code and err["message"] and "type" in err


def test_an_mlp_step_of_a_client_layer_is_bad_layer(setup, session):
    rt, sid = session
    _error(_post(setup, sid, _mlp_body(rt, sid, layer=0)), 400, "bad_layer")


def test_an_mlp_step_under_the_attention_key_is_wrong_key_set(setup, session):
    rt, sid = session
    _error(_post(setup, sid, _mlp_body(rt, sid, fingerprint=rt.fingerprint)), 400, "wrong_key_set")
    _error(_post(setup, sid, _mlp_body(rt, sid, fingerprint="ab" * 32)), 403, "key_mismatch")


def test_an_mlp_step_for_other_parameters_is_backend_mismatch(setup, session):
    rt, sid = session
    _error(_post(setup, sid, _mlp_body(rt, sid, params="cd" * 32)), 400, "backend_mismatch")


def test_an_oversized_mlp_blob_is_413_before_any_worker(setup, session):
    from fhe.offload_steps import fresh_blob_limit

    rt, sid = session
    blob = b"\0" * (fresh_blob_limit(rt.offload.params) + 1)
    _error(_post(setup, sid, _mlp_body(rt, sid, blobs=(blob,))), 413, "step_too_large")


def test_garbage_of_the_right_size_is_bad_ciphertext(setup, session):
    rt, sid = session
    _error(_post(setup, sid, _mlp_body(rt, sid, blobs=(b"\1" * 1000,))), 400, "bad_ciphertext")


def test_an_mlp_step_is_retry_safe(setup, session):
    rt, sid = session
    body = _mlp_body(rt, sid, start=0)
    first = _post(setup, sid, body)
    assert first.status_code == 200
    assert _post(setup, sid, body).content == first.content       # the stored answer, not a recomputation
    _error(_post(setup, sid, _mlp_body(rt, sid, start=0)), 409, "step_mismatch")


def test_an_unknown_part_is_bad_envelope(setup, session):
    import rfc8785

    from fhe import envelope

    rt, sid = session
    body = _mlp_body(rt, sid)
    prefix = envelope._PREFIX.size
    head_len = envelope._PREFIX.unpack_from(body)[2]
    head = {**__import__("json").loads(body[prefix:prefix + head_len]), "part": "mlp_sideways"}
    raw = rfc8785.dumps(head)
    bad = envelope._PREFIX.pack(envelope.MAGIC, envelope.ENVELOPE_VERSION, len(raw)) + raw + body[prefix + head_len:]
    _error(_post(setup, sid, bad), 400, "bad_envelope")


def test_attention_linear_steps_are_checked_like_mlp_steps(setup, session):
    """attn_qkv / attn_o: only on a layer whose attention runs as linear steps, under the offload key set,
    one fresh ciphertext per position of at most the blob limit (all 4xx before or in the worker)."""
    from fhe.offload_steps import fresh_blob_limit

    rt, sid = session
    lay = rt.offload.att_layout

    def body(**kw):
        from fhe.backends.seal import wire
        from fhe.linalg import replicate_input

        vec = replicate_input(torch.randn(lay.hidden).double().numpy(), lay.slots, lay.qkv_period)
        return _mlp_body(rt, sid, **{"layer": 0, "part": "attn_qkv",
                                     "blobs": (wire.encrypt_to_wire(rt.offload.ckks, vec),), **kw})

    _error(_post(setup, sid, body(layer=1)), 400, "bad_layer")           # layer 1's attention is calibrated
    _error(_post(setup, sid, body(part="attn_o", layer=1)), 400, "bad_layer")
    _error(_post(setup, sid, body(fingerprint=rt.fingerprint)), 400, "wrong_key_set")
    _error(_post(setup, sid, body(part="attn_o", blobs=(b"\1" * 1000,))), 400, "bad_ciphertext")
    _error(_post(setup, sid, body(blobs=(b"\0" * (fresh_blob_limit(rt.offload.params) + 1),))), 413,
           "step_too_large")
    ok = _post(setup, sid, body(start=1))
    assert ok.status_code == 200, ok.text
    # a step of several positions runs the chunk layout (manifest: offload.mlp.chunk_layout): per chunk of m
    # positions T ciphertexts in, G out; any other count of ciphertexts is a 400 before any worker runs
    from fhe.offload_steps import chunk_layout_manifest

    sh = rt.offload.chunks["attn_qkv"]
    man = setup["http"].get("/v1/private/manifest", headers=_auth()).json()["offload"]["mlp"]
    assert man["chunk_layout"] == chunk_layout_manifest(rt.offload.chunks) and man["chunk_layout"]["version"] == 1
    blobs = tuple(wire_encrypt(rt, r) for r in sh.pack(torch.randn(2, lay.hidden).double().numpy()))
    _error(_post(setup, sid, body(start=2, count=2, blobs=blobs * 2)), 400, "bad_step")   # a chunk is T blobs
    one = wire_encrypt(rt, sh.pack(torch.randn(1, lay.hidden).numpy())[0])
    too_many = (one,) * (rt.offload.chunks["mlp_up"].tiles + 1)
    _error(_post(setup, sid, _mlp_body(rt, sid, start=2, count=2, blobs=too_many)), 400, "bad_step")
    chunked = _post(setup, sid, body(start=2, count=2, blobs=blobs))      # one chunk of two positions: runs
    assert chunked.status_code == 200, chunked.text
    from fhe.envelope import parse

    assert len(parse(chunked.content, 1 << 30, 1 << 34).blobs) == sh.groups


def wire_encrypt(rt, values):
    from fhe.backends.seal import wire

    return wire.encrypt_to_wire(rt.offload.ckks, values)


def test_a_session_needs_an_mlp_key_of_the_mlp_parameters(setup, generated):
    rt = setup["client"]._private
    url, plan = "/v1/private/sessions", rt.manifest.plan_hash
    _error(setup["http"].post(url, json={"key_id": rt.key_id, "plan_hash": plan}, headers=_auth()),
           400, "mlp_key_required")
    _error(setup["http"].post(url, json={"key_id": rt.key_id, "plan_hash": plan, "mlp_key_id": rt.key_id},
                              headers=_auth()), 400, "wrong_key_set")
    _error(setup["http"].post(url, json={"key_id": rt.key_id, "plan_hash": plan, "mlp_key_id": "nope"},
                              headers=_auth()), 404, "key_not_found")


def test_speculative_output_on_the_offload_plan_is_the_plain_output(setup, generated, monkeypatch):
    """A verify step of k + 1 positions runs layer 0's attention linear steps packed (m positions per
    ciphertext) and every MLP step one per position; greedy output equals the plain run's, with drafts
    accepted and, with wrong drafts, rejected (the client's clear cache and layer 1's server cache roll back)."""
    from client_sdk._private import runtime_of
    from engine.spec_decode import NgramProposer

    client, rt = setup["client"], setup["client"]._private
    if not rt.manifest.verify_steps:
        pytest.skip("this server takes no verify steps")
    out, _ = generated

    def greedy(k: int = 2, n: int = MAX_TOKENS) -> str:
        res = client.completions.create(prompt=PROMPT, max_tokens=n, temperature=0,
                                        extra_body={"num_speculative_tokens": k, "ignore_eos": True})
        return res.choices[0].text

    monkeypatch.setattr(NgramProposer, "propose", lambda self, ids, k: [ids[-1]] * k)
    assert greedy() == out.choices[0].text
    s = runtime_of(client).last_speculation.decoder
    assert s.num_drafts > 0 and s.num_draft_tokens > 0
    # wrong drafts: every verify step rejects, so 4 tokens take two verify steps in one session (drafts are
    # capped by the tokens left: 2, then 1, then none); the second one's linear steps must name its own positions
    # (a stale start repeats the first one's positions with other ciphertexts: 409 step_mismatch, what this caught
    # before verify_forward set it). Four tokens (five until session 23: three verify steps, one more encrypted
    # position through every part for no other check). The reference is the simulator's 4 tokens, which the
    # SDK's plain decoding equals (the first test, 3 tokens): an encrypted k = 0 run here would cost ~15 s more.
    want, gap = _simulated_greedy(setup, rt.tokenizer.encode(PROMPT), 4)
    assert gap > 1e-3, "the simulator's greedy choice is a near-tie: pick another prompt"
    monkeypatch.setattr(NgramProposer, "propose", lambda self, ids, k: [ids[-1] + 1] * k)
    assert greedy(n=4) == rt.tokenizer.decode(want)
    s = runtime_of(client).last_speculation.decoder
    assert s.num_drafts >= 2 and s.num_accepted_tokens < s.num_draft_tokens    # verify steps, drafts rejected
