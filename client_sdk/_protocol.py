"""The private-session protocol without I/O: manifest, calls, envelopes, session and replay state.

Nothing here opens a socket. The runtime (:mod:`client_sdk._runtime`) asks for HTTP exchanges as
:class:`Call` values and hands the answers back as :class:`Reply` values; two thin drivers perform the
calls — the blocking :class:`~client_sdk.Client` and the asyncio :class:`~client_sdk.AsyncClient`, each
with its own httpx client (httpx's own split between its models and its transports). So retry, replay
and timeout rules are written once and tested without a server.

Timeouts follow from the plan, not from the plaintext defaults: a step's read timeout is what
:meth:`Manifest.step_read_timeout` allows for that many positions of one encrypted layer at the plan's
ring size, and a key upload's (or a session opening's, which loads the key into a worker) scales with
the key's size. The client's :class:`~client_sdk.Timeout` stays the floor.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

from client_sdk._exceptions import APIStatusError, PrivateModeError

OCTET = {"Content-Type": "application/octet-stream"}
#: codes of an answer after which the session is gone for good: open a new one and replay
SESSION_LOST_CODES = frozenset({"session_lost", "session_closed", "session_not_found", "worker_lost"})

# Time budget of one encrypted layer per position, at N = 32768 on a small CPU: 6-26 s measured
# (docs/benchmarks.md: decode 13-26 s per layer on a loaded box, 6 s after the output-stage work), times a margin
# for a busy worker. Work grows about as N log N, so other ring sizes scale from it.
SECONDS_PER_LAYER_TOKEN_N32K = 15.0
STEP_TIMEOUT_MARGIN = 10.0
STEP_TIMEOUT_FLOOR_S = 120.0
# key material: the server screens it in a worker (deserialize + check) and stores it; opening a session
# loads it into a worker. Budget 0.5 s per MB (7 min for the 829 MB of the shipped plan) plus a minute.
KEY_SECONDS_PER_MB = 0.5
KEY_TIMEOUT_FLOOR_S = 60.0


@dataclasses.dataclass(frozen=True)
class Call:
    """One HTTP exchange the runtime needs.

    Attributes:
        method, path: what to call (path under the client's base URL).
        json: a JSON body, or None.
        content: a binary body (sent as ``application/octet-stream``), or None.
        read_timeout: seconds to wait for the answer (None: the client's ``Timeout.read``).
        progress: a label under which the driver reports bytes sent or received (None: silent).
    """

    method: str
    path: str
    json: Any = None
    content: bytes | None = None
    read_timeout: float | None = None
    progress: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return dict(OCTET) if self.content is not None else {}


@dataclasses.dataclass(frozen=True)
class Reply:
    """A successful answer (drivers raise the SDK's errors for error statuses)."""

    content: bytes

    def json(self) -> Any:
        """The body as JSON (``PrivateModeError`` when it is not)."""
        try:
            return json.loads(self.content)
        except ValueError as exc:
            raise PrivateModeError("the server's answer is not JSON") from exc


#: what a driver gives the runtime: perform one call, return its reply or raise an SDK error
Exchange = Callable[[Call], Reply]


@dataclasses.dataclass(frozen=True)
class Progress:
    """A progress report: ``stage`` ("bundle download", "key generation", "key upload", ...),
    ``done`` out of ``total`` (bytes, or steps; ``total`` None when unknown), ``unit`` ("B" or "")."""

    stage: str
    done: int
    total: int | None
    unit: str = "B"

    @property
    def finished(self) -> bool:
        return self.total is not None and self.done >= self.total


ProgressCallback = Callable[[Progress], None]


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What ``GET /v1/private/manifest`` promises, checked (a malformed one is ``PrivateModeError``)."""

    model: str
    plan_hash: str
    ckks: dict[str, Any]
    encrypted_layers: tuple[int, ...]
    approx: dict[int, tuple[str, int]]   # layer -> (softmax approximation kind, squarings)
    bundle_sha256: str
    bundle_size: int
    max_session_tokens: int
    max_step_tokens: int
    max_key_bytes: int
    #: Tokens per packed prefill ciphertext (``limits.packed_chunk``; 0 or absent: older server, one
    #: ciphertext per token).
    packed_chunk: int = 0
    #: The server takes ``verify`` steps and ``rollback`` messages (speculative decoding; absent: an
    #: older server, the SDK decodes one token per step).
    verify_steps: bool = False
    #: A session runs on an attention key set (``ckks``) besides any offload key; False (manifest
    #: ``offload.attention_key``) for an offload plan whose server layers are all linear steps: the SDK
    #: makes and registers only the offload key set and opens sessions on it alone.
    attention_key: bool = True
    #: How attention steps' ciphertexts travel (manifest ``upload``): "seeded" (SEAL's seeded form; absent: a
    #: SEAL-backed or older server) or "full" (unseeded: the server's GPU workers read them straight into
    #: device tensors, without SEAL's load).
    upload: str = "seeded"

    @classmethod
    def from_json(cls, d: Any) -> Manifest:
        """Parse the manifest's JSON."""
        try:
            offload = d.get("offload")
            attention_key = not (isinstance(offload, Mapping) and offload.get("attention_key") is False)
            approx = ({int(lp["index"]): (str(lp["approx"]["kind"]), int(lp["approx"]["squarings"]))
                       for lp in d["plan"]["layers"]} if attention_key else {})
            limits = d["limits"]
            man = cls(str(d["model"]), str(d["plan_hash"]), dict(d["ckks"]),
                      tuple(int(i) for i in d["layers"]["encrypted_attention"]), approx,
                      str(d["bundle"]["sha256"]), int(d["bundle"]["size"]), int(limits["max_session_tokens"]),
                      int(limits["max_step_tokens"]), int(limits.get("max_key_bytes") or 1 << 30),
                      max(0, int(limits.get("packed_chunk") or 0)), limits.get("verify_steps") is True,
                      attention_key, str(d.get("upload", "seeded")))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PrivateModeError(f"the server's private manifest is malformed ({exc!r})") from exc
        if man.upload not in ("seeded", "full"):
            raise PrivateModeError(f"the server asks for uploads as {man.upload[:32]!r}, this SDK sends 'seeded' "
                                   "or 'full': update the SDK")
        return man

    @property
    def ring_degree(self) -> int:
        return int(self.ckks["poly_modulus_degree"])

    def step_read_timeout(self, positions: int, floor: float) -> float:
        """Seconds to wait for one encrypted layer's answer over ``positions`` positions."""
        scale = (self.ring_degree / 32768) * (1 + 0.07 * (self.ring_degree.bit_length() - 16))
        budget = STEP_TIMEOUT_MARGIN * SECONDS_PER_LAYER_TOKEN_N32K * scale * max(1, positions)
        return max(floor, STEP_TIMEOUT_FLOOR_S, budget)

    def key_read_timeout(self, key_bytes: int, floor: float) -> float:
        """Seconds to wait for the server to screen/store (or load) ``key_bytes`` of key material."""
        return max(floor, KEY_TIMEOUT_FLOOR_S + KEY_SECONDS_PER_MB * key_bytes / 1e6)


# --- calls ---------------------------------------------------------------------------------------------

MANIFEST = Call("GET", "/v1/private/manifest")
KEYS = Call("GET", "/v1/private/keys")
TENANT = Call("GET", "/v1/tenant")


def bundle_call() -> Call:
    return Call("GET", "/v1/private/bundle", progress="bundle download")


def key_upload_call(man: Manifest, key_id: str, upload: bytes, floor: float) -> Call:
    return Call("POST", f"/v1/private/keys/{key_id}", content=upload, progress="key upload",
                read_timeout=man.key_read_timeout(len(upload), floor))


def key_is_registered(listed: Any, fingerprint: str) -> bool:
    """True when ``GET /v1/private/keys`` lists ``fingerprint`` as active (nothing to upload)."""
    data = listed.get("data") if isinstance(listed, Mapping) else None
    return any(isinstance(k, Mapping) and k.get("fingerprint") == fingerprint and k.get("state") == "active"
               for k in data or [])


def check_registered(record: Any, fingerprint: str) -> None:
    """The upload's answer must name the fingerprint of the bytes sent."""
    if not isinstance(record, Mapping) or record.get("fingerprint") != fingerprint:
        raise PrivateModeError("server registered another fingerprint than the one uploaded")


class Session:
    """One encrypted session's protocol state: its id, the steps' envelopes and the replay rule.

    Args:
        manifest: the server's manifest.
        key_id, fingerprint: the registered key the session runs on.
        key_bytes: size of the key material (opening a session may load it into a worker).
        read_floor: the client's own read timeout (never waited less than this).
    """

    def __init__(self, manifest: Manifest, key_id: str, fingerprint: str, key_bytes: int,
                 read_floor: float) -> None:
        self.manifest, self.key_id, self.fingerprint = manifest, key_id, fingerprint
        self.key_bytes, self.read_floor = key_bytes, read_floor
        self.id: str | None = None

    def open_call(self) -> Call:
        body = {"plan_hash": self.manifest.plan_hash}
        if self.manifest.attention_key:   # else the offload session names its one key set (mlp_key_id)
            body["key_id"] = self.key_id
        return Call("POST", "/v1/private/sessions", json=body,
                    read_timeout=self.manifest.key_read_timeout(self.key_bytes, self.read_floor))

    def opened(self, reply: Reply) -> str:
        """Record the new session's id from the open call's answer."""
        body = reply.json()
        if not isinstance(body, Mapping) or not isinstance(body.get("session_id"), str):
            raise PrivateModeError("the server's session answer has no session_id")
        self.id = body["session_id"]
        return self.id

    def close_call(self) -> Call | None:
        """The call that frees the server's session (None when none is open); the session is closed here."""
        if self.id is None:
            return None
        sid, self.id = self.id, None
        return Call("DELETE", f"/v1/private/sessions/{sid}")

    def step_call(self, layer: int, start: int, blobs: tuple[bytes, ...], count: int | None = None, *,
                  verify: bool = False) -> Call:
        """The step of ``layer`` for positions ``start .. start + count``: one ciphertext per position, or,
        with ``count`` given, a packed prefill (``ceil(count / packed_chunk)`` ciphertexts); ``verify``: a
        speculative verify step (one ciphertext per position; the server can roll it back)."""
        from fhe.envelope import Envelope

        if self.id is None:
            raise PrivateModeError("no open session")
        if count is not None:
            kind = "packed"
        else:
            count = len(blobs)
            kind = "verify" if verify else "decode" if count == 1 and start > 0 else "prefill"
        body = Envelope(self.id, self.fingerprint, layer, kind, (start, count), blobs).to_bytes()
        return Call("POST", f"/v1/private/sessions/{self.id}/steps", content=body,
                    read_timeout=self.manifest.step_read_timeout(count, self.read_floor))

    def step_result(self, reply: Reply, layer: int, start: int, count: int) -> tuple[bytes, ...]:
        """The result envelope's ciphertexts; ``PrivateModeError`` if it answers another step."""
        from fhe.envelope import MAX_BLOBS, parse
        from fhe.errors import FHEError

        try:
            env = parse(reply.content, 1 << 30, 1 << 34, max_blobs=max(count, MAX_BLOBS))
        except FHEError as exc:
            raise PrivateModeError(f"layer {layer}: malformed result envelope ({exc})") from exc
        if env.positions != (start, count) or env.layer != layer or len(env.blobs) != count:
            raise PrivateModeError("server answered another step")
        return env.blobs

    def rollback_call(self, layer: int, keep: int, dropped: int) -> Call:
        """``layer``'s cache back to ``keep`` positions, dropping the ``dropped`` newest (of a verify step)."""
        from fhe.envelope import Envelope

        if self.id is None:
            raise PrivateModeError("no open session")
        body = Envelope(self.id, self.fingerprint, layer, "rollback", (keep, dropped), ()).to_bytes()
        return Call("POST", f"/v1/private/sessions/{self.id}/steps", content=body,
                    read_timeout=self.manifest.step_read_timeout(1, self.read_floor))

    def rollback_done(self, reply: Reply, layer: int, keep: int, dropped: int) -> None:
        """``PrivateModeError`` unless the answer confirms this rollback."""
        from fhe.envelope import EnvelopeError, parse

        try:
            env = parse(reply.content, 1 << 20, 1 << 20)
        except EnvelopeError as exc:
            raise PrivateModeError(f"layer {layer}: malformed rollback answer ({exc})") from exc
        if (env.kind, env.layer, env.positions, env.blobs) != ("result", layer, (keep, dropped), ()):
            raise PrivateModeError("server answered another rollback")

    @staticmethod
    def lost(exc: BaseException) -> bool:
        """True when ``exc`` means the session is gone (open a new one and replay the positions)."""
        return isinstance(exc, APIStatusError) and (exc.code in SESSION_LOST_CODES
                                                    or (exc.status_code == 410 and exc.code is None))
