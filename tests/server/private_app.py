"""An in-process app with the encrypted-session service at the smallest real configuration.

The tiny random model of :mod:`tests.server.app_helpers` (hidden 64, 4 heads of 16, 2 KV heads), a plan
that encrypts its layer 1 with the 2Quad score map (depth 6: N = 16384, the smallest ring the code
accepts, 22 Galois keys, a 158 MB key upload), the real worker pool running the real
:class:`server.private.compute.PrivateCompute`, reached through ``httpx.ASGITransport``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import torch

from engine.model import DenseKVCache
from fhe.approx import ScoreApprox
from fhe.plan import LayerPlan, Plan, model_fingerprint
from server.settings import Settings, TenantSettings
from server.tenants import hash_api_key

LAYER = 1
KEYS = {"enc-a": "clm-privsvc-a-000000000000", "enc-b": "clm-privsvc-b-111111111111"}


def tiny_plan(model, folder: Path) -> Path:
    """A 2Quad plan for ``model``'s layer 1 (shift 5 per head, bound from the scores of a short text)."""
    from fhe.params import ckks_params_for

    hq = model.config.num_attention_heads
    approx = ScoreApprox("2quad", (1.0,) * hq, (5.0,) * hq, 6, 40.0)
    plan = Plan("tiny-random", model_fingerprint(model), (LayerPlan(LAYER, approx, (-35.0, 35.0)),),
                ckks_params_for("2quad", 6).to_dict(), "privsvc in-process tests")
    return plan.save(folder / "tiny-2quad.plan.json")


def private_settings(model_dir: Path, plan: Path, state_dir: Path, **private) -> Settings:
    """Two encrypted tenants, one worker, the tiny plan."""
    from server.private.config import PrivateSettings

    tenants = [TenantSettings(id=t, api_key_hashes=[hash_api_key(k)], privacy_mode="encrypted")
               for t, k in KEYS.items()]
    cfg = dict(enabled=True, workers=1, plan=str(plan), state_dir=str(state_dir), max_session_tokens=16,
               max_step_tokens=4, max_keys_per_worker=2)
    # engine_process=False: the plaintext engine in a thread, as tests/server/app_helpers.make_settings keeps it
    # (a core process per app is ~6 s of imports and tokenizer set-up on 2 cores that these tests never use)
    return Settings(model=str(model_dir), served_model_name="tiny", server_secret="privsvc-secret",
                    tenants=tenants, private=PrivateSettings(**{**cfg, **private}),
                    engine={"device": "cpu", "num_kv_blocks": 32}, engine_process=False)


class TinyClient:
    """The client half for the tiny plan: keys, the upload, step envelopes, decryption."""

    def __init__(self, model, plan_path: Path) -> None:
        from fhe.attention import BlockClient
        from fhe.params import CKKSParams
        from tests.server.private_helpers import tiny_key_set

        self.model, self.plan = model, Plan.load(plan_path)
        # the process's tiny key set (level-aware, as the SDK makes; shared with the other private modules)
        self.ckks, self.upload = tiny_key_set(model.config)
        assert self.ckks.params == CKKSParams.from_dict(self.plan.ckks)
        self.block = BlockClient.for_model(self.ckks, model.config, "2quad", 6)
        self.fingerprint = hashlib.sha256(self.upload).hexdigest()

    def layer_input(self, ids: list[int]) -> torch.Tensor:
        """What the client sends for ``ids``: the RMS-normalized residual entering the encrypted layer."""
        m = self.model
        with torch.no_grad():
            pos = torch.arange(len(ids))
            h = m.run_layers(m.embed(torch.tensor(ids)), pos, DenseKVCache(m.config, len(ids)), 0, LAYER)
            return m.layers[LAYER].input_layernorm.normalize(h)

    def step_body(self, sid: str, start: int, x: torch.Tensor, blobs: tuple[bytes, ...] | None = None) -> bytes:
        """A step envelope for positions ``start ..`` (``blobs`` overrides the ciphertexts)."""
        from fhe.backends import describe
        from fhe.backends.seal import wire
        from fhe.envelope import Envelope

        if blobs is None:
            blobs = tuple(wire.encrypt_to_wire(self.ckks, self.block.layout_input(row)) for row in x)
        kind = "decode" if len(blobs) == 1 and start > 0 else "prefill"
        backend = describe(self.ckks.params)
        return Envelope(sid, self.fingerprint, LAYER, kind, (start, len(blobs)), blobs,
                        backend["name"], backend["params_hash"]).to_bytes()

    def packed_body(self, sid: str, start: int, x: torch.Tensor, blobs: tuple[bytes, ...] | None = None,
                    count: int | None = None) -> bytes:
        """A ``packed`` prefill envelope for positions ``start ..`` (one ciphertext per chunk)."""
        from fhe.backends import describe
        from fhe.backends.seal import wire
        from fhe.envelope import Envelope

        if blobs is None:
            blobs = tuple(wire.encrypt_to_wire(self.ckks, v) for v in self.block.layout_packed(x))
        backend = describe(self.ckks.params)
        return Envelope(sid, self.fingerprint, LAYER, "packed", (start, len(x) if count is None else count),
                        blobs, backend["name"], backend["params_hash"]).to_bytes()

    def attention(self, result: bytes) -> torch.Tensor:
        """The decrypted block output [T, hidden] of a result envelope."""
        from fhe.backends.seal import wire
        from fhe.envelope import parse

        env = parse(result, 1 << 30, 1 << 34)
        cts = [wire.load_ciphertext(b, self.ckks.kit, self.ckks.fingerprint) for b in env.blobs]
        return self.block.finish(*self.block.decrypt_output(cts))


def headers(tenant: str, request_id: str | None = None) -> dict[str, str]:
    out = {"Authorization": f"Bearer {KEYS[tenant]}"}
    if request_id:
        out["X-Request-Id"] = request_id
    return out


def asgi_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver",
                             timeout=httpx.Timeout(600.0))


def greedy_with_gap(sim, ids: list[int], n: int) -> tuple[list[int], float]:
    """``n`` greedy tokens of an offload plan's simulator (``fhe.offload_sim.OffloadSimulator``) after ``ids``,
    and the smallest top-1 / top-2 logit gap on the way (how close a tie came)."""
    ids, out, gap = list(ids), [], float("inf")
    with torch.no_grad():
        for _ in range(n):
            logits = sim.logits(ids)[-1]
            top, tok = logits.topk(2).values, int(logits.argmax())
            gap = min(gap, float(top[0] - top[1]))
            out.append(tok)
            ids.append(tok)
    return out, gap


def serve_offload_plan(model_dir: Path, tmp_path_factory, make_plan, name: str, **private):
    """The app serving the offload plan ``make_plan(model.config)`` (linear steps only: no ``[private] plan``,
    no attention key) with an encrypted-mode SDK client on it, as a generator for a fixture: yields
    ``{"http", "client", "model", "off"}`` and closes the client's session after."""
    from fastapi.testclient import TestClient

    from client_sdk import Client
    from client_sdk._private import runtime_of
    from engine.loader import load_model
    from server.app import create_app

    model = load_model(model_dir)
    folder = tmp_path_factory.mktemp("plans")
    off = make_plan(model.config)
    off_path = off.save(folder / f"{name}.offload.json")
    settings = private_settings(model_dir, folder / "absent.plan.json", tmp_path_factory.mktemp("state"),
                                offload_plan=str(off_path), max_step_tokens=8, **private)
    settings.private.plan = None   # no [private] plan at all: no layer needs an attention key
    with TestClient(create_app(settings), base_url="http://testserver") as http:
        client = Client(api_key=KEYS["enc-a"], base_url="http://testserver", http_client=http,
                        privacy="encrypted", max_retries=0)
        runtime_of(client).cache_dir = tmp_path_factory.mktemp("client-cache")
        yield {"http": http, "client": client, "model": model, "off": off}
        if client._private is not None:
            client._private.close_session()
