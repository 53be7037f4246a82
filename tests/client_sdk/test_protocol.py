"""The private-session protocol without I/O (client_sdk._protocol) and the two drivers that perform its
calls (``Client._exchange``, ``AsyncClient._aexchange``) over httpx mock transports."""

from __future__ import annotations

import ast
import asyncio
import io
import json
from pathlib import Path

import httpx
import pytest

from client_sdk import APIStatusError, AsyncClient, Client, PrivateModeError, Progress, ProgressPrinter
from client_sdk import _protocol as proto

N32K = {"poly_modulus_degree": 32768, "coeff_mod_bit_sizes": [60] + [50] * 11 + [60], "scale_bits": 50}
N16K = {"poly_modulus_degree": 16384, "coeff_mod_bit_sizes": [48] + [30] * 11 + [60], "scale_bits": 30}


def manifest_json(ckks=N32K, layers=(2, 3, 4, 5)) -> dict:
    """The shape server/private/feature.py:build_manifest publishes."""
    return {"format": "cipherlm-private-manifest", "version": 1, "model": "SmolLM2-135M-Instruct",
            "model_sha256": "ab" * 32, "plan_hash": "cd" * 32, "ckks": ckks,
            "plan": {"layers": [{"index": i, "approx": {"kind": "sqexp", "squarings": 6}} for i in layers]},
            "layers": {"total": 30, "encrypted_attention": list(layers), "client": list(range(30))},
            "bundle": {"sha256": "ef" * 32, "size": 528_000_000, "withheld": [], "path": "/v1/private/bundle"},
            "limits": {"max_session_tokens": 512, "max_step_tokens": 64, "max_blob_bytes": 1 << 24,
                       "max_step_bytes": 1 << 28, "max_key_bytes": 1 << 30, "session_ttl_s": 900.0}}


def test_manifest_parses_and_refuses_malformed():
    man = proto.Manifest.from_json(manifest_json())
    assert man.encrypted_layers == (2, 3, 4, 5) and man.approx[3] == ("sqexp", 6)
    assert man.ring_degree == 32768 and man.max_step_tokens == 64
    broken = manifest_json()
    del broken["limits"]
    with pytest.raises(PrivateModeError, match="malformed"):
        proto.Manifest.from_json(broken)
    with pytest.raises(PrivateModeError):
        proto.Manifest.from_json(["not", "a", "manifest"])


def test_step_timeouts_follow_the_plan_not_the_plaintext_default():
    big, small = proto.Manifest.from_json(manifest_json(N32K)), proto.Manifest.from_json(manifest_json(N16K))
    floor = 120.0  # the SDK's plaintext default read timeout
    # a decode step at the shipped N = 32768 gets more than the plaintext default, a prefill chunk far more
    assert big.step_read_timeout(1, floor) > floor
    assert big.step_read_timeout(64, floor) >= 64 * big.step_read_timeout(1, floor) / 1.01
    assert small.step_read_timeout(8, floor) < big.step_read_timeout(8, floor)
    assert small.step_read_timeout(1, 900.0) == 900.0  # a user's larger Timeout.read is kept
    # 829 MB of keys (the shipped plan): minutes to screen/load, not the 120 s default
    assert big.key_read_timeout(829_000_000, floor) > 400


def test_session_calls_and_replay_rule():
    from fhe.envelope import parse

    man = proto.Manifest.from_json(manifest_json(N16K))
    s = proto.Session(man, "k1", "12" * 32, 500_000_000, 120.0)
    with pytest.raises(PrivateModeError):
        s.step_call(2, 0, (b"x",))                      # no session yet
    assert s.open_call().json == {"key_id": "k1", "plan_hash": man.plan_hash}
    assert s.open_call().read_timeout > 120
    assert s.opened(proto.Reply(json.dumps({"session_id": "ps_1"}).encode())) == "ps_1"
    call = s.step_call(3, 5, (b"a" * 10,))
    assert call.path == "/v1/private/sessions/ps_1/steps" and call.headers["Content-Type"].endswith("octet-stream")
    env = parse(call.content, 1 << 20, 1 << 20)
    assert (env.session, env.key_fingerprint, env.layer, env.kind, env.positions) == ("ps_1", "12" * 32, 3,
                                                                                     "decode", (5, 1))
    assert parse(s.step_call(3, 0, (b"a", b"b")).content, 1 << 20, 1 << 20).kind == "prefill"
    with pytest.raises(PrivateModeError, match="another step"):
        s.step_result(proto.Reply(call.content), 3, 6, 1)    # an answer for other positions
    assert s.close_call().method == "DELETE" and s.close_call() is None
    lost = APIStatusError("gone", status_code=410, code="session_lost")
    assert proto.Session.lost(lost) and proto.Session.lost(APIStatusError("x", status_code=503, code="worker_lost"))
    assert not proto.Session.lost(APIStatusError("bad", status_code=400, code="bad_ciphertext"))
    assert not proto.Session.lost(ValueError("x"))


def test_key_registration_checks():
    listed = {"data": [{"fingerprint": "aa", "state": "revoked"}, {"fingerprint": "bb", "state": "active"}]}
    assert proto.key_is_registered(listed, "bb") and not proto.key_is_registered(listed, "aa")
    assert not proto.key_is_registered({"data": None}, "bb")
    with pytest.raises(PrivateModeError, match="another fingerprint"):
        proto.check_registered({"fingerprint": "cc"}, "bb")


def test_no_import_cycle_between_client_and_runtime():
    root = Path(__file__).resolve().parents[2] / "client_sdk"
    for name in ("_private.py", "_runtime.py", "_protocol.py"):
        tree = ast.parse((root / name).read_text())
        mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "client_sdk._client" not in mods, name


# --- drivers ----------------------------------------------------------------------------------------


class Server:
    """A mock transport handler: records requests, answers uploads and downloads."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []
        self.bodies: list[bytes] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        self.bodies.append(request.read())
        if request.method == "GET":
            return httpx.Response(200, content=b"B" * 3_000_000)
        if request.url.path.endswith("/gone"):
            return httpx.Response(410, json={"error": {"message": "lost", "type": "x", "code": "session_lost"}})
        return httpx.Response(201, json={"fingerprint": "ff"})


def sync_client(server: Server, **kw) -> Client:
    http = httpx.Client(transport=httpx.MockTransport(server))
    return Client(api_key="clm-x", base_url="http://t", http_client=http, max_retries=0, **kw)


def test_sync_driver_timeouts_and_progress():
    server, seen = Server(), []
    client = sync_client(server, progress=seen.append)
    up = proto.Call("POST", "/v1/private/keys/k", content=b"K" * 2_500_000, read_timeout=777.0, progress="key upload")
    assert client._exchange(up).json() == {"fingerprint": "ff"}
    assert server.bodies[-1] == b"K" * 2_500_000
    assert server.requests[-1].headers["content-length"] == "2500000"
    assert server.requests[-1].extensions["timeout"]["read"] == 777.0
    ups = [p for p in seen if p.stage == "key upload"]
    assert [p.done for p in ups] == [1 << 20, 2 << 20, 2_500_000] and ups[-1].finished
    down = client._exchange(proto.Call("GET", "/v1/private/bundle", progress="bundle download"))
    assert down.content == b"B" * 3_000_000
    downs = [p for p in seen if p.stage == "bundle download"]
    assert downs[-1].done == downs[-1].total == 3_000_000
    client._exchange(proto.MANIFEST)
    assert server.requests[-1].extensions["timeout"]["read"] == client.timeout.read   # plaintext default
    with pytest.raises(APIStatusError) as info:
        client._exchange(proto.Call("POST", "/gone", content=b"x"))
    assert proto.Session.lost(info.value)


def test_progress_is_off_by_default():
    server = Server()
    client = sync_client(server)
    client._exchange(proto.Call("POST", "/v1/private/keys/k", content=b"K" * 10, progress="key upload"))
    assert server.bodies[-1] == b"K" * 10 and client.progress is None


def test_async_driver_sends_itself_with_timeouts_and_progress():
    server, seen = Server(), []

    async def run():
        http = httpx.AsyncClient(transport=httpx.MockTransport(server))
        async with AsyncClient(api_key="clm-x", base_url="http://t", http_client=http, max_retries=0,
                               progress=seen.append) as client:
            reply = await client._aexchange(proto.Call("POST", "/v1/private/keys/k", content=b"K" * 1_500_000,
                                                       read_timeout=555.0, progress="key upload"))
            down = await client._aexchange(proto.Call("GET", "/v1/private/bundle", progress="bundle download"))
            return reply, down

    reply, down = asyncio.run(run())
    assert reply.json() == {"fingerprint": "ff"} and len(down.content) == 3_000_000
    assert server.bodies[0] == b"K" * 1_500_000 and server.requests[0].extensions["timeout"]["read"] == 555.0
    assert {p.stage for p in seen} == {"key upload", "bundle download"}


def test_progress_printer_lines():
    out, now = io.StringIO(), [0.0]
    printer = ProgressPrinter(out, every_s=0.5, clock=lambda: now[0])
    printer(Progress("key generation", 0, 21, ""))
    now[0] = 42.0
    printer(Progress("key generation", 21, 21, ""))
    printer(Progress("key upload", 1_000_000, 4_000_000))
    now[0] = 44.0
    printer(Progress("key upload", 4_000_000, 4_000_000))
    text = out.getvalue()
    assert "key generation: done  42 s" in text
    assert "key upload: 4.0 / 4.0 MB 100.0%  2.0 MB/s  2 s" in text
