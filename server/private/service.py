"""The encrypted-session service behind ``/v1/private``: keys, sessions, steps.

The server process never parses key or ciphertext bytes: it bound-checks the envelope
(:mod:`fhe.envelope`), checks the session, the key fingerprint, the layer and the positions, and hands
the opaque blobs to the worker that holds the session (:mod:`server.private.workers`). Key uploads are
screened in a worker too, then registered in the key registry (which audits every transition).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from typing import Any

from fhe import envelope
from fhe.backends import check_backend
from fhe.errors import BackendMismatchError
from server.audit import Event, Outcome
from server.errors import (
    APIError,
    ConflictError,
    GoneError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    RequestTooLargeError,
    ServiceUnavailableError,
)
from server.keys import (
    Inspection,
    KeyCancelledError,
    KeyNotFoundError,
    KeyNotUsableError,
    KeyRecord,
    KeyRegistry,
    KeyStateError,
    MalformedKeyError,
    SecretKeyUploadError,
    UploadRefusedError,
)
from server.private.config import PrivateSettings
from server.private.sessions import Session, SessionState, SessionTable
from server.private.workers import TaskError, WorkerCrashedError, WorkerError, WorkerPool, WorkerTimeoutError

log = logging.getLogger("cipherlm.private")
SOURCE = "server.private"
#: worker exception names that mean "the client sent bad ciphertext/key bytes" (-> 400)
CLIENT_FAULTS = {"WireError", "SizeLimitError", "SecretKeyRefusedError", "PlanMismatchError", "ShapeError",
                 "LevelError", "KeyMismatchError", "ParameterError", "FHEError", "MalformedKeyError",
                 "EnvelopeError", "ValueError", "BackendMismatchError"}


class PrivateService:
    """Keys, sessions and steps of encrypted tenants (one per app; runs on the app's event loop)."""

    #: The evaluator backend and CKKS parameters the workers run (set by ``feature.start``); a step that
    #: names others is a 400 ``backend_mismatch`` before any worker sees it.
    backend_name: str = "seal"
    backend_params: Any = None

    def __init__(self, cfg: PrivateSettings, plan_hash: str, encrypted_layers: tuple[int, ...],
                 pool: WorkerPool, registry: KeyRegistry, audit: Any, clock: Callable[[], float] | None = None) -> None:
        import time

        self.cfg, self.plan_hash, self.layers = cfg, plan_hash, tuple(encrypted_layers)
        self.pool, self.registry, self.audit = pool, registry, audit
        self.sessions = SessionTable(cfg.session_ttl_s, clock or time.monotonic)
        self._screened: dict[str, Inspection] = {}
        self._loaded: set[tuple[int, str]] = set()  # (worker, fingerprint) holding the key
        self._key_used: dict[tuple[int, str], float] = {}  # last session opened with it there
        pool.on_restart = self._worker_lost
        registry.add_cancel_hook(self._key_left_active)

    # -- keys ------------------------------------------------------------------------------------
    def screened_inspect(self, data: bytes) -> Inspection:
        """The registry's ``inspect`` hook: the verdict a worker reached on exactly these bytes."""
        verdict = self._screened.get(hashlib.sha256(data).hexdigest())
        if verdict is None or verdict is _MALFORMED:
            raise MalformedKeyError("not a cipherlm public-key upload")
        if verdict.params_hash.startswith("mismatch:") and not verdict.has_secret_key:
            raise MalformedKeyError(f"key does not fit the plan: {verdict.params_hash[9:]}")
        return verdict

    async def register_key(self, tenant: str, key_id: str, data: bytes, *, actor: str,
                           request_id: str | None = None) -> KeyRecord:
        """Screen (in a worker), register and activate; a second upload of a key id rotates it."""
        if len(data) > self.cfg.max_key_bytes:
            self._refuse_upload(tenant, key_id, data, actor, request_id, "too_large")
            raise RequestTooLargeError(f"key upload over {self.cfg.max_key_bytes} bytes", code="key_too_large")
        digest = hashlib.sha256(data).hexdigest()
        self._screened[digest] = await self._inspect(tenant, data)
        try:
            return self._register(tenant, key_id, data, actor, request_id)
        except SecretKeyUploadError as exc:
            raise PermissionDeniedError(
                "refused: the upload contains a secret key. Upload only public evaluation keys (the SDK "
                "does this); the refusal was recorded", code="secret_key_refused") from exc
        except UploadRefusedError as exc:
            raise InvalidRequestError(f"key upload refused: {exc}", code="malformed_key") from exc
        finally:
            self._screened.pop(digest, None)

    async def _inspect(self, tenant: str, data: bytes) -> Inspection:
        try:
            has_secret, params_hash, problem = await self.pool.submit(
                self.pool.least_loaded(), tenant, "inspect_key", data)
        except TaskError as exc:
            log.info("key upload of tenant %s failed to parse in a worker: %s", tenant, exc.kind)
            return _MALFORMED
        except (WorkerCrashedError, WorkerTimeoutError) as exc:  # e.g. out of memory: not the client's fault
            raise ServiceUnavailableError("the worker screening the key upload was lost; retry",
                                          retry_after=5, code="worker_lost") from exc
        if problem:
            return Inspection(has_secret, "mismatch:" + problem)
        return Inspection(has_secret, params_hash)

    def _register(self, tenant, key_id, data, actor, request_id) -> KeyRecord:
        expires = None if self.cfg.key_lifetime_s is None else self.registry.now() + self.cfg.key_lifetime_s
        try:
            self.registry.get(tenant, key_id)
        except KeyNotFoundError:
            rec = self.registry.register(tenant, key_id, data, actor=actor, request_id=request_id)
            return self.registry.activate(tenant, key_id, rec.version, actor=actor, request_id=request_id,
                                          expires_at=expires)
        return self.registry.rotate(tenant, key_id, data, actor=actor, request_id=request_id,
                                    grace_s=min(3600.0, self.registry.config.max_grace_s), expires_at=expires)

    def _refuse_upload(self, tenant, key_id, data, actor, request_id, reason: str) -> None:
        self.audit.append(Event.KEY_UPLOAD_REFUSED, source=SOURCE, outcome=Outcome.REFUSED, tenant=tenant,
                          actor=actor, key_id=key_id, request_id=request_id,
                          detail={"reason": reason, "size": len(data)})

    def list_keys(self, tenant: str) -> list[KeyRecord]:
        return self.registry.list(tenant)

    def revoke_key(self, tenant: str, key_id: str, version: int | None, *, actor: str,
                   compromised: bool = False, request_id: str | None = None) -> KeyRecord:
        """Revoke now: the key's sessions close and in-flight steps are refused."""
        try:
            rec = self.registry.get(tenant, key_id, version)
            return self.registry.revoke(tenant, key_id, rec.version, actor=actor, compromised=compromised,
                                        request_id=request_id)
        except KeyNotFoundError as exc:
            raise NotFoundError(f"no key {key_id!r}", code="key_not_found") from exc
        except KeyStateError as exc:
            raise ConflictError(str(exc), code="key_state") from exc

    # -- sessions ----------------------------------------------------------------------------------
    async def open_session(self, tenant: str, key_id: str, plan_hash: str, *, actor: str,
                           request_id: str | None = None) -> Session:
        """A new session on the tenant's ACTIVE key ``key_id`` for this server's plan."""
        if plan_hash != self.plan_hash:
            raise ConflictError(f"plan {plan_hash[:16]}... is not this server's plan {self.plan_hash[:16]}...; "
                                "fetch /v1/private/manifest again", code="plan_mismatch")
        if self.sessions.count(tenant) >= self.cfg.max_sessions_per_tenant:
            raise RateLimitError("too many open sessions for this tenant; close one first",
                                 retry_after=5, code="too_many_sessions")
        lease = self._lease(tenant, key_id, actor, request_id)
        rec = lease.record
        worker = self._pick_worker(rec.fingerprint)
        s = Session(self.sessions.new_id(), tenant, key_id, rec.version, rec.fingerprint, worker,
                    self.sessions.now(), self.sessions.now(), lease)
        try:
            await self._ensure_key(worker, tenant, lease)
            await self.pool.submit(worker, tenant, "open_session", s.id, rec.fingerprint)
        except RateLimitError:
            lease.release()
            raise
        except WorkerError as exc:
            lease.release()
            raise ServiceUnavailableError("encrypted worker unavailable", retry_after=1, code="worker_lost") from exc
        lease.on_cancel(lambda reason, sid=s.id: self._mark_closed(sid, f"key {reason}"))
        self.sessions.add(s)
        self._audit_session(Event.SESSION_OPENED, s, actor, request_id)
        return s

    def _lease(self, tenant, key_id, actor, request_id):
        try:
            return self.registry.use(tenant, key_id, actor=actor, request_id=request_id)
        except KeyNotFoundError as exc:
            raise NotFoundError(f"no key {key_id!r} registered for this tenant", code="key_not_found") from exc
        except KeyNotUsableError as exc:
            raise PermissionDeniedError(f"key not usable: {exc}", code="key_not_active") from exc

    async def _ensure_key(self, worker: int, tenant: str, lease) -> None:
        fp = lease.record.fingerprint
        self._key_used[(worker, fp)] = self.sessions.now()
        if (worker, fp) not in self._loaded:
            await self._make_room(worker, tenant)
            material = self.registry.load_material(lease)
            await self.pool.submit(worker, tenant, "load_key", fp, material)
            self._loaded.add((worker, fp))

    def _pick_worker(self, fp: str) -> int:
        """A worker that already holds the key, else one with room for it, else one holding a key no open
        session uses (it will be dropped), else the least loaded (which will answer 429)."""
        holders = [w for w, f in self._loaded if f == fp]
        workers = range(self.pool.size)
        room = [w for w in workers if len(self._keys_in(w)) < self.cfg.max_keys_per_worker]
        evictable = [w for w in workers if self._idle_keys(w)]
        return self.pool.least_loaded(holders or room or evictable)

    def _keys_in(self, worker: int) -> list[str]:
        return [fp for w, fp in self._loaded if w == worker]

    def _idle_keys(self, worker: int) -> list[str]:
        """Keys loaded in ``worker`` that no open session there uses (the ones a new key may replace)."""
        busy = {s.fingerprint for s in self.sessions.on_worker(worker)}
        return [fp for fp in self._keys_in(worker) if fp not in busy]

    async def _make_room(self, worker: int, tenant: str) -> None:
        """Keep at most ``max_keys_per_worker`` keys in a worker: drop the least recently used key that
        no open session there uses, or refuse with 429 when every loaded key is in use."""
        if len(self._keys_in(worker)) < self.cfg.max_keys_per_worker:
            return
        idle = self._idle_keys(worker)
        if not idle:
            raise RateLimitError("every encrypted worker holds its maximum of keys in use; retry later",
                                 retry_after=5, code="worker_keys_full")
        victim = min(idle, key=lambda fp: self._key_used.get((worker, fp), 0.0))
        await self.pool.submit(worker, tenant, "drop_key", victim)
        self._loaded.discard((worker, victim))
        self._key_used.pop((worker, victim), None)

    def session_for(self, tenant: str, sid: str) -> Session:
        """The tenant's session (404 for unknown ids and for other tenants' ids alike)."""
        s = self.sessions.get(sid)
        if s is None or s.tenant != tenant:
            raise NotFoundError("no such session", code="session_not_found")
        if s.state is SessionState.LOST:
            raise GoneError("session lost (worker restarted): open a new session and replay", code="session_lost")
        if s.state is SessionState.CLOSED:
            raise GoneError(f"session closed: {s.reason}", code="session_closed")
        return s

    async def step(self, tenant: str, sid: str, body: bytes) -> bytes:
        """Run one step (a layer over ``count`` positions) and return the result envelope."""
        s = self.session_for(tenant, sid)
        env = self._parse(body)
        self._check_step(s, env)
        start, count = env.positions
        cached = s.last_step.get(env.layer)
        if cached and cached[0] == (start, count):
            return cached[1]  # a retried step: same answer, no recomputation
        if start != s.expected(env.layer):
            raise ConflictError(f"layer {env.layer} expects position {s.expected(env.layer)}, got {start}",
                                code="position_mismatch")
        try:
            s.lease.check()
        except KeyCancelledError as exc:
            raise PermissionDeniedError(f"key no longer usable: {exc}", code="key_not_active") from exc
        blobs, nbytes = await self._run_step(s, env)
        s.next_position[env.layer] = start + count
        s.nbytes = nbytes
        self.sessions.touch(s)
        out = envelope.Envelope(s.id, s.fingerprint, env.layer, "result", (start, count), tuple(blobs),
                                env.backend, env.params).to_bytes()
        s.last_step[env.layer] = ((start, count), out)
        return out

    def _parse(self, body: bytes) -> envelope.Envelope:
        try:
            return envelope.parse(body, self.cfg.max_blob_bytes, self.cfg.max_step_bytes)
        except envelope.EnvelopeError as exc:
            if exc.too_large:
                raise RequestTooLargeError(str(exc), code="step_too_large") from exc
            raise InvalidRequestError(f"bad envelope: {exc}", code="bad_envelope") from exc

    def _check_step(self, s: Session, env: envelope.Envelope) -> None:
        start, count = env.positions
        if env.session != s.id:
            raise InvalidRequestError("envelope names another session", code="session_mismatch")
        if env.key_fingerprint != s.fingerprint:
            raise PermissionDeniedError("key fingerprint does not match the session's key", code="key_mismatch")
        if self.backend_params is not None:
            try:
                check_backend(env.backend, env.params, name=self.backend_name, params=self.backend_params)
            except BackendMismatchError as exc:
                raise InvalidRequestError(str(exc), code="backend_mismatch") from exc
        if env.layer not in self.layers:
            raise InvalidRequestError(f"layer {env.layer} is not encrypted in this plan {self.layers}",
                                      code="bad_layer")
        if env.kind not in ("prefill", "decode") or not 1 <= count <= self.cfg.max_step_tokens:
            raise InvalidRequestError(f"a step carries 1..{self.cfg.max_step_tokens} tokens", code="bad_step")
        if len(env.blobs) != count:
            raise InvalidRequestError(f"{count} positions but {len(env.blobs)} ciphertexts", code="bad_step")
        if start + count > self.cfg.max_session_tokens:
            raise RequestTooLargeError(f"session limit of {self.cfg.max_session_tokens} positions",
                                       code="session_full")

    async def _run_step(self, s: Session, env: envelope.Envelope):
        start, count = env.positions
        try:
            return await self.pool.submit(s.worker, s.tenant, "step", s.id, s.fingerprint, env.layer, start,
                                          list(env.blobs))
        except TaskError as exc:
            if exc.kind in CLIENT_FAULTS:
                raise InvalidRequestError(f"ciphertext rejected: {exc}", code="bad_ciphertext") from exc
            log.error("step failed in worker: %s", exc.kind)
            raise APIError("encrypted step failed", code="step_failed") from exc
        except (WorkerCrashedError, WorkerTimeoutError) as exc:
            raise ServiceUnavailableError("the worker holding this session was lost; open a new session and "
                                          "replay", retry_after=1, code="session_lost") from exc

    async def close_session(self, tenant: str, sid: str, *, actor: str, reason: str = "client",
                            request_id: str | None = None) -> None:
        s = self.sessions.get(sid)
        if s is None or s.tenant != tenant:
            raise NotFoundError("no such session", code="session_not_found")
        await self._close(s, reason, actor, request_id)

    async def _close(self, s: Session, reason: str, actor: str | None, request_id: str | None = None) -> None:
        self.sessions.remove(s.id)
        if s.state is SessionState.OPEN:
            try:
                await self.pool.submit(s.worker, s.tenant, "close_session", s.id)
            except WorkerError:
                pass  # the worker is gone, and the session with it
        if s.lease is not None:
            s.lease.release()
        s.state, s.reason = SessionState.CLOSED, s.reason or reason
        self._audit_session(Event.SESSION_CLOSED, s, actor, request_id, {"reason": s.reason})

    async def sweep(self) -> int:
        """Close idle sessions and expire due keys; returns sessions closed."""
        self.registry.expire_due()
        idle = self.sessions.expired()
        for s in idle:
            await self._close(s, "ttl", "system")
        for s in [s for s in list(self.sessions._sessions.values()) if s.state is not SessionState.OPEN]:
            await self._close(s, s.reason or s.state.value, "system")
        return len(idle)

    async def close(self) -> None:
        for s in list(self.sessions._sessions.values()):
            await self._close(s, "shutdown", "system")

    # -- events from the pool and the registry ----------------------------------------------------------
    def _worker_lost(self, worker: int) -> None:
        self._loaded = {(w, fp) for w, fp in self._loaded if w != worker}
        for s in self.sessions.on_worker(worker):
            s.state, s.reason = SessionState.LOST, "worker_lost"

    def _mark_closed(self, sid: str, reason: str) -> None:
        s = self.sessions.get(sid)
        if s is not None and s.state is SessionState.OPEN:
            s.state, s.reason = SessionState.CLOSED, reason

    def _key_left_active(self, rec: KeyRecord, reason: str) -> None:
        """Revocation/expiry: drop the key from every worker now (sessions were closed via their leases)."""
        fp = rec.fingerprint
        if any(f == fp for _, f in self._loaded):
            self._loaded = {(w, f) for w, f in self._loaded if f != fp}
            try:
                asyncio.get_running_loop().create_task(self._drop_key(fp))
            except RuntimeError:
                pass  # no loop (offline tooling): nothing is loaded in workers then

    async def _drop_key(self, fp: str) -> None:
        try:
            await self.pool.broadcast("drop_key", fp)
        except WorkerError:
            pass

    def _audit_session(self, event: str, s: Session, actor, request_id, detail: dict | None = None) -> None:
        self.audit.append(event, source=SOURCE, outcome=Outcome.SUCCESS, tenant=s.tenant, actor=actor,
                          key_id=s.key_id, key_version=s.key_version, key_fingerprint=s.fingerprint,
                          request_id=request_id, detail={"session": s.id, **(detail or {})})


_MALFORMED = Inspection(False, "malformed")
