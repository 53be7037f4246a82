"""The encrypted-session service behind ``/v1/private``: keys, sessions, steps.

The server process never parses key or ciphertext bytes: it bound-checks the envelope
(:mod:`fhe.envelope`), checks the session, the key fingerprint, the layer and the positions, and hands
the opaque blobs to the worker that holds the session (:mod:`server.private.workers`). Key uploads are
inspected in a worker too (the verdict is data, :class:`server.keys.Inspection`), then registered in the
key registry on that verdict (the registry audits every transition and parses nothing).

Worker failures arrive as codes of one table (:class:`server.private.codes.WorkerCode`) and become HTTP
errors in one place, :func:`task_error`: only a refusal of the client's own bytes is a 4xx; anything
else a worker raises is a 500 naming the request id.

Key sets in workers are shared by fingerprint but owned per registration (tenant, key id, version):
revoking one tenant's copy of a byte-identical upload drops the worker's key set only when no other
registration still owns it there.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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
    KeyLease,
    KeyNotFoundError,
    KeyNotUsableError,
    KeyRecord,
    KeyRegistry,
    KeyStateError,
    SecretKeyUploadError,
    UploadRefusedError,
)
from server.private.backend import WorkerBackend
from server.private.codes import WorkerCode
from server.private.config import PrivateSettings
from server.private.sessions import Session, SessionState, SessionTable, StepRecord
from server.private.workers import TaskError, WorkerError

log = logging.getLogger("cipherlm.private")

#: Envelope kinds that carry ciphertexts to compute on (``rollback`` carries none: :meth:`_rollback`).
STEP_KINDS = ("prefill", "decode", "packed", "verify")
SOURCE = "server.private"
Owner = tuple[str, str, int]  # (tenant, key id, version): one registration of a key
Slot = tuple[int, str]        # (worker, fingerprint): one key set loaded in one worker


@dataclass
class StepTimes:
    """One step's stage times on the server (``server.metrics.PRIVATE_STEP_STAGES``), filled by the router
    (``body_read``), the service and the worker pool; ``kind`` is set once the step ran (a retry answered
    from the stored answer ran nothing and is not recorded). Times only: never a byte of the body."""

    started: float = field(default_factory=time.monotonic)
    stages: dict[str, float] = field(default_factory=dict)
    kind: str | None = None

    def since(self, stage: str, t0: float) -> float:
        """Note ``stage`` as the time since ``t0`` (``time.monotonic()``); returns now."""
        now = time.monotonic()
        self.stages[stage] = self.stages.get(stage, 0.0) + now - t0
        return now

    def ran(self, count: int) -> None:
        self.kind = "decode" if count == 1 else "prefill"


#: the stages of a worker call that the pool measures (the rest of the call is ``pool_rest``)
_POOL_STAGES = ("queue_wait", "to_worker", "worker_parse", "worker_compute", "worker_serialize", "worker_rest",
                "from_worker")


def new_request_id() -> str:
    """A request id for requests that came without ``X-Request-Id``."""
    return "req_" + secrets.token_hex(12)


def task_error(exc: TaskError, request_id: str) -> APIError:
    """The one translation of a worker failure code to an HTTP error (table in ``docs/protocol.md``)."""
    code = exc.code
    if code is WorkerCode.BAD_CIPHERTEXT:
        return InvalidRequestError(f"ciphertext rejected: {exc}", code="bad_ciphertext")
    if code in (WorkerCode.SESSION_UNKNOWN, WorkerCode.SESSION_DESYNC):
        return GoneError("the worker no longer holds this session's state: open a new session and replay",
                         code="session_lost")
    if code is WorkerCode.KEY_NOT_LOADED:
        return ServiceUnavailableError("the worker lost the session's key; retry", retry_after=1,
                                       code="worker_lost")
    # a bug on the server: the class name is logged, never the message (it may quote data)
    log.error("encrypted worker task failed (%s), request %s", exc.exc_type or code.value, request_id)
    return APIError(f"internal error in an encrypted worker (request id {request_id})", code="internal_error",
                    headers={"X-Request-Id": request_id})


def _lost_worker(message: str, code: str) -> APIError:
    """A worker died or timed out (task failures go through :func:`task_error`), or the pool closed: not
    the client's fault, retry."""
    return ServiceUnavailableError(message, retry_after=1, code=code)


class PrivateService:
    """Keys, sessions and steps of encrypted tenants (one per app; runs on the app's event loop)."""

    #: The evaluator backend and CKKS parameters the workers run (set by ``feature.start``); a step that
    #: names others is a 400 ``backend_mismatch`` before any worker sees it.
    backend_name: str = "seal"
    backend_params: Any = None
    #: Tokens per packed prefill ciphertext (``fhe.geometry.packed_chunk_for``; set by ``feature.start``);
    #: 0 refuses packed steps.
    packed_chunk: int = 0
    #: The offload plan's MLP steps (``server.private.offload.OffloadSteps``; set by ``feature.start`` when
    #: ``[private] offload_plan`` is set); None: attention steps only (the partial plan).
    offload: Any = None
    #: Told ``(kind, stages)`` for every step that ran (``server.metrics.ServerMetrics.record_private_stages``;
    #: set by ``feature.start``); None: not recorded.
    observe_stages: Callable[[str, dict[str, float]], None] | None = None

    def __init__(self, cfg: PrivateSettings, plan_hash: str, encrypted_layers: tuple[int, ...],
                 pool: WorkerBackend, registry: KeyRegistry, audit: Any,
                 clock: Callable[[], float] | None = None) -> None:
        import time

        self.cfg, self.plan_hash, self.layers = cfg, plan_hash, tuple(encrypted_layers)
        self.pool, self.registry, self.audit = pool, registry, audit
        self.sessions = SessionTable(cfg.session_ttl_s, clock or time.monotonic)
        self._loaded: dict[Slot, set[Owner]] = {}  # key sets in workers and the registrations owning them
        self._key_used: dict[Slot, float] = {}  # last session opened with it there
        pool.on_restart = self._worker_lost
        registry.add_cancel_hook(self._key_left_active)

    # -- keys ------------------------------------------------------------------------------------
    async def register_key(self, tenant: str, key_id: str, data: bytes, *, actor: str,
                           request_id: str | None = None) -> KeyRecord:
        """Inspect (in a worker), register on that verdict and activate; a second upload of a key id
        rotates it."""
        if len(data) > self.cfg.max_key_bytes:
            self._refuse_upload(tenant, key_id, data, actor, request_id, "too_large")
            raise RequestTooLargeError(f"key upload over {self.cfg.max_key_bytes} bytes", code="key_too_large")
        inspection = await self._inspect(tenant, data, request_id or new_request_id())
        try:
            return self._register(tenant, key_id, data, inspection, actor, request_id)
        except SecretKeyUploadError as exc:
            raise PermissionDeniedError(
                "refused: the upload contains a secret key. Upload only public evaluation keys (the SDK "
                "does this); the refusal was recorded", code="secret_key_refused") from exc
        except UploadRefusedError as exc:
            raise InvalidRequestError(f"key upload refused: {exc}", code="malformed_key") from exc

    async def _inspect(self, tenant: str, data: bytes, request_id: str) -> Inspection:
        """The production inspector's verdict, reached in a worker (bad bytes are a verdict, not an error)."""
        try:
            inspection = await self.pool.submit(self.pool.least_loaded(), tenant, "inspect_key", data)
        except TaskError as exc:
            raise task_error(exc, request_id) from exc
        except WorkerError as exc:  # e.g. out of memory while parsing: not the client's fault
            raise _lost_worker("the worker inspecting the key upload was lost; retry", "worker_lost") from exc
        if not isinstance(inspection, Inspection):
            raise TypeError(f"inspect_key returned {type(inspection).__name__}")
        return inspection

    def _register(self, tenant, key_id, data, inspection, actor, request_id) -> KeyRecord:
        expires = None if self.cfg.key_lifetime_s is None else self.registry.now() + self.cfg.key_lifetime_s
        try:
            self.registry.get(tenant, key_id)
        except KeyNotFoundError:
            rec = self.registry.register(tenant, key_id, data, inspection, actor=actor, request_id=request_id)
            return self.registry.activate(tenant, key_id, rec.version, actor=actor, request_id=request_id,
                                          expires_at=expires)
        return self.registry.rotate(tenant, key_id, data, inspection, actor=actor, request_id=request_id,
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
    @property
    def attention_key(self) -> bool:
        """Whether a session needs an attention key set: some layer runs a calibrated attention block (an
        offload plan whose server layers are all linear steps runs on its offload key set alone)."""
        return bool(self.layers)

    async def open_session(self, tenant: str, key_id: str | None, plan_hash: str, *, actor: str,
                           request_id: str | None = None, mlp_key_id: str | None = None) -> Session:
        """A new session on the tenant's ACTIVE key ``key_id`` for this server's plan (and, with an offload
        plan, its offload key set ``mlp_key_id``; with linear steps only, on that key set alone)."""
        if self.offload is not None:
            self.offload.check_open(mlp_key_id)
        self._check_key_ids(key_id)
        if plan_hash != self.plan_hash:
            raise ConflictError(f"plan {plan_hash[:16]}... is not this server's plan {self.plan_hash[:16]}...; "
                                "fetch /v1/private/manifest again", code="plan_mismatch")
        if self.sessions.count(tenant) >= self.cfg.max_sessions_per_tenant:
            raise RateLimitError("too many open sessions for this tenant; close one first",
                                 retry_after=5, code="too_many_sessions")
        s = (self._attention_session(tenant, key_id, actor, request_id) if self.attention_key else
             self._linear_session(tenant, mlp_key_id, actor, request_id))
        try:
            await self._bring_up(s, mlp_key_id, actor, request_id)
        except (RateLimitError, InvalidRequestError, NotFoundError, PermissionDeniedError):
            self._release(s)
            raise
        except TaskError as exc:
            self._release(s)
            if exc.code is WorkerCode.KEY_NOT_LOADED:  # the worker lost it: load it again next time
                self._unload((s.worker, s.fingerprint or s.mlp_fingerprint))
            raise task_error(exc, request_id or new_request_id()) from exc
        except WorkerError as exc:
            self._release(s)
            raise _lost_worker("encrypted worker unavailable", "worker_lost") from exc
        if s.mlp_lease is not None:
            s.mlp_lease.on_cancel(lambda reason, sid=s.id: self._mark_closed(sid, f"offload key {reason}"))
        if s.lease is not None:
            s.lease.on_cancel(lambda reason, sid=s.id: self._mark_closed(sid, f"key {reason}"))
        self.sessions.add(s)
        self._audit_session(Event.SESSION_OPENED, s, actor, request_id)
        return s

    def _check_key_ids(self, key_id: str | None) -> None:
        """400 unless the request names an attention key exactly when this server's plan uses one."""
        if self.attention_key and key_id is None:
            raise InvalidRequestError("open the session with key_id, a key registered for the manifest's ckks",
                                      code="key_required")
        if not self.attention_key and key_id is not None:
            raise InvalidRequestError("this server's plan runs every server layer as linear steps: open the "
                                      "session with mlp_key_id alone (manifest: offload.attention_key is false)",
                                      code="attention_key_unused")

    def _attention_session(self, tenant: str, key_id: str, actor, request_id) -> Session:
        """A session on an attention key (its MLP key, if any, is attached by :meth:`_bring_up`)."""
        lease = self._lease(tenant, key_id, actor, request_id)
        rec, now = lease.record, self.sessions.now()
        worker = self._pick_worker(rec.fingerprint, need=2 if self.offload is not None else 1)
        return Session(self.sessions.new_id(), tenant, key_id, rec.version, rec.fingerprint, worker, now, now, lease)

    def _linear_session(self, tenant: str, mlp_key_id: str, actor, request_id) -> Session:
        """A session of linear steps only: its one key set is the offload key (no attention key, no state in
        a worker: linear steps are stateless, so the worker is only where its key set is loaded first)."""
        lease = self._offload_lease(tenant, mlp_key_id, actor, request_id)
        rec, now = lease.record, self.sessions.now()
        worker = self._pick_worker(rec.fingerprint)
        return Session(self.sessions.new_id(), tenant, None, rec.version, None, worker, now, now, None,
                       mlp_fingerprint=rec.fingerprint, mlp_lease=lease, mlp_key_id=mlp_key_id)

    async def _bring_up(self, s: Session, mlp_key_id: str | None, actor, request_id) -> None:
        """Load the session's key sets into its worker and open its worker state (attention sessions only)."""
        if s.lease is None:
            await self._ensure_key(s.worker, s.tenant, s.mlp_lease)
            return
        await self._ensure_key(s.worker, s.tenant, s.lease)
        if self.offload is not None:
            await self._attach_mlp_key(s, mlp_key_id, actor, request_id)
        await self.pool.submit(s.worker, s.tenant, "open_session", s.id, s.fingerprint)

    def _offload_lease(self, tenant: str, mlp_key_id: str, actor, request_id) -> KeyLease:
        """A lease on the key named as the offload key set (it must be one made for the offload parameters)."""
        lease = self._lease(tenant, mlp_key_id, actor, request_id)
        try:
            self.offload.check_mlp_key(lease.record)   # 400 wrong_key_set, before any worker sees it
        except InvalidRequestError:
            lease.release()
            raise
        return lease

    async def _attach_mlp_key(self, s: Session, mlp_key_id: str, actor, request_id) -> None:
        """Lease the session's offload key set and load it into the session's worker beside its attention key
        (other workers load it when they run the session's linear steps)."""
        lease = self._offload_lease(s.tenant, mlp_key_id, actor, request_id)
        s.mlp_lease, s.mlp_fingerprint, s.mlp_key_id = lease, lease.record.fingerprint, mlp_key_id
        await self._ensure_key(s.worker, s.tenant, lease, keep=s.fingerprint)

    def _release(self, s: Session) -> None:
        """Give back the leases of a session that did not open."""
        if s.lease is not None:
            s.lease.release()
        self._release_mlp(s)

    @staticmethod
    def _release_mlp(s: Session) -> None:
        if s.mlp_lease is not None:
            s.mlp_lease.release()
            s.mlp_lease = None

    def _lease(self, tenant, key_id, actor, request_id):
        try:
            return self.registry.use(tenant, key_id, actor=actor, request_id=request_id)
        except KeyNotFoundError as exc:
            raise NotFoundError(f"no key {key_id!r} registered for this tenant", code="key_not_found") from exc
        except KeyNotUsableError as exc:
            raise PermissionDeniedError(f"key not usable: {exc}", code="key_not_active") from exc

    async def _ensure_key(self, worker: int, tenant: str, lease: KeyLease, keep: str | None = None) -> None:
        """Load the lease's key set into ``worker`` unless it is there (making room under
        ``max_keys_per_worker``, never by dropping ``keep``), and record the lease's registration as one of
        its owners there."""
        rec = lease.record
        slot = (worker, rec.fingerprint)
        self._key_used[slot] = self.sessions.now()
        if slot not in self._loaded:
            await self._make_room(worker, tenant, keep)
            await self._load(worker, tenant, lease)
            self._loaded.setdefault(slot, set())
        if lease.cancelled:  # revoked while it loaded: this registration owns nothing
            self._disown(_owner(rec), rec.fingerprint)
            raise PermissionDeniedError(f"key not usable: {lease.reason}", code="key_not_active")
        self._loaded[slot].add(_owner(rec))

    async def _load(self, worker: int, tenant: str, lease: KeyLease) -> None:
        """Load the lease's key set into ``worker``: the keys it parsed when it screened the upload, if it
        still holds them (their canonical bytes hash to the record's ``stored_sha256``), else the stored
        bytes (read, decrypted and integrity-checked by the registry) parsed there."""
        rec = lease.record
        lease.check()
        if rec.stored_sha256 and rec.key_set and await self.pool.submit(
                worker, tenant, "load_screened_key", rec.fingerprint, rec.stored_sha256, rec.key_set):
            return
        material = self.registry.load_material(lease)
        await self.pool.submit(worker, tenant, "load_key", rec.fingerprint, material, rec.key_set)

    def _pick_worker(self, fp: str, need: int = 1) -> int:
        """A worker that already holds the key and has fewer than ``spill_sessions`` open sessions, else
        one with room for it (a second copy of a busy key: ``bench/placement_sim.py`` shows one holder
        per hot key queueing for minutes), else any holder, else one holding a key no open session uses
        (it will be dropped), else the least loaded (which will answer 429). ``need``: key sets the session
        loads there (2: an attention key and an offload key)."""
        holders = [w for w, f in self._loaded if f == fp]
        spill = self.cfg.spill_sessions
        uncrowded = [w for w in holders if spill is None or len(self.sessions.on_worker(w)) < spill]
        workers = range(self.pool.size)
        room = [w for w in workers if len(self._keys_in(w)) + need <= self.cfg.max_keys_per_worker]
        evictable = [w for w in workers if self._idle_keys(w)]
        return self._least_busy(uncrowded or room or holders or evictable)

    def _least_busy(self, among: list[int]) -> int:
        """The fewest open sessions, then the fewest pending tasks: a worker's pending count is 0 while its
        sessions' clients are between steps, so it alone undercounts (``bench/placement_sim.py``)."""
        if not among:
            return self.pool.least_loaded()
        open_n = {w: len(self.sessions.on_worker(w)) for w in among}
        fewest = min(open_n.values())
        return self.pool.least_loaded([w for w in among if open_n[w] == fewest])

    def _keys_in(self, worker: int) -> list[str]:
        """Key sets loaded in ``worker``, attention and offload alike (each counts toward
        ``max_keys_per_worker``: on a GPU worker an offload key set is expanded on the device too)."""
        return [fp for w, fp in self._loaded if w == worker]

    def _idle_keys(self, worker: int) -> list[str]:
        """Keys loaded in ``worker`` that no open session there uses (the ones a new key may replace)."""
        sessions = self.sessions.on_worker(worker)
        busy = {s.fingerprint for s in sessions} | {s.mlp_fingerprint for s in sessions if s.mlp_fingerprint}
        return [fp for fp in self._keys_in(worker) if fp not in busy]

    async def _make_room(self, worker: int, tenant: str, keep: str | None = None) -> None:
        """Keep at most ``max_keys_per_worker`` keys in a worker: drop the least recently used key that
        no open session there uses (never ``keep``: the other key set of the session being opened), or
        refuse with 429 when every loaded key is in use."""
        if len(self._keys_in(worker)) < self.cfg.max_keys_per_worker:
            return
        idle = [fp for fp in self._idle_keys(worker) if fp != keep]
        if not idle:
            raise RateLimitError("every encrypted worker holds its maximum of keys in use; retry later",
                                 retry_after=5, code="worker_keys_full")
        victim = min(idle, key=lambda fp: self._key_used.get((worker, fp), 0.0))
        await self.pool.submit(worker, tenant, "drop_key", victim)
        self._unload((worker, victim))

    def _unload(self, slot: Slot) -> None:
        """Forget that a worker holds a key set (it was dropped there, or the worker lost it)."""
        self._loaded.pop(slot, None)
        self._key_used.pop(slot, None)

    def _disown(self, owner: Owner, fp: str) -> list[int]:
        """``owner``'s registration no longer owns key set ``fp`` anywhere; returns the workers where it
        now has no owner left (the caller drops it there)."""
        emptied = []
        for slot in [slot for slot in self._loaded if slot[1] == fp]:
            self._loaded[slot].discard(owner)
            if not self._loaded[slot]:
                self._unload(slot)
                emptied.append(slot[0])
        return emptied

    def session_for(self, tenant: str, sid: str) -> Session:
        """The tenant's session (404 for unknown ids and for other tenants' ids alike)."""
        s = self.sessions.get(sid)
        if s is None:  # swept already: a recent end still answers 410, so the SDK knows to replay
            tenant_of, state, reason = self.sessions.gone(sid) or (None, None, "")
            if tenant_of == tenant and state is SessionState.LOST:
                raise GoneError("session lost (worker restarted): open a new session and replay",
                                code="session_lost")
            if tenant_of == tenant:
                raise GoneError(f"session closed: {reason}", code="session_closed")
        if s is None or s.tenant != tenant:
            raise NotFoundError("no such session", code="session_not_found")
        if s.state is SessionState.LOST:
            raise GoneError("session lost (worker restarted): open a new session and replay", code="session_lost")
        if s.state is SessionState.CLOSED:
            raise GoneError(f"session closed: {s.reason}", code="session_closed")
        return s

    async def step(self, tenant: str, sid: str, body: bytes, *, request_id: str | None = None,
                   times: StepTimes | None = None, digest: str | None = None) -> bytes:
        """Run one step (a layer over ``count`` positions) and return the result envelope.

        Retry-safe: the same request again (same layer, positions and body bytes) gets the stored answer,
        or waits for the running one; the same positions with another body are a 409 ``step_mismatch``.
        A step, once running, runs to completion even if its client goes away (its answer is kept for
        the retry, and the worker's cache never gets ahead of the service's count). ``times``: filled with
        the step's stage times (:meth:`record_times` observes them). ``digest``: the SHA-256 hex digest of
        ``body`` where the caller computed it while reading it (the router does), else computed here.
        """
        times = times or StepTimes()
        t0 = time.monotonic()
        s = self.session_for(tenant, sid)
        env = self._parse(body)
        if env.part != envelope.ATTENTION:
            return await self._mlp_step(s, env, body, request_id or new_request_id(), times, t0, digest)
        if s.lease is None:
            raise InvalidRequestError("this server's plan runs no attention block on ciphertexts (every server "
                                      "layer is a linear step)", code="bad_layer")
        if env.kind == "rollback":
            return await self._rollback(s, env, hashlib.sha256(body).hexdigest(), request_id or new_request_id())
        self._check_step(s, env)
        t0 = times.since("envelope", t0)
        digest = digest or hashlib.sha256(body).hexdigest()
        times.since("digest", t0)
        prev = s.last_step.get(env.layer)
        # a rollback's positions are [keep, dropped], not a step's [start, count]: never "the same request"
        same = None if prev is None or prev.kind == "rollback" else prev.same_request(env.positions, digest)
        if same is False:
            raise ConflictError(f"layer {env.layer} positions {env.positions[0]}..{sum(env.positions) - 1} were "
                                "already sent with other ciphertexts; repeat the same request, or continue at "
                                f"position {s.expected(env.layer)}", code="step_mismatch")
        if same:
            return prev.answer if isinstance(prev.answer, bytes) else await asyncio.shield(prev.answer)
        self._check_next(s, env)
        task = asyncio.ensure_future(self._advance(s, env, request_id or new_request_id(), times))
        s.last_step[env.layer] = StepRecord(env.positions, digest, task, env.kind)
        task.add_done_callback(lambda t, rec=s.last_step[env.layer]: self._step_done(s, env.layer, rec, prev, t))
        return await asyncio.shield(task)

    def record_times(self, times: StepTimes) -> None:
        """Hand a step's stage times to :attr:`observe_stages` (with ``total``: since ``times.started``), if it ran."""
        if times.kind is None or self.observe_stages is None:
            return
        times.stages["total"] = time.monotonic() - times.started
        self.observe_stages(times.kind, times.stages)

    async def _mlp_step(self, s: Session, env: envelope.Envelope, body: bytes, request_id: str,
                        times: StepTimes, t0: float, digest: str | None = None) -> bytes:
        """An offload plan's MLP half: checked here (part, layer, key set, sizes: all 4xx), run stateless
        on a worker holding the MLP key set, retry-safe like an attention step (the answer is stored per
        (layer, part), and the same positions with another body are a 409)."""
        if self.offload is None:
            raise InvalidRequestError("this server's plan runs no linear offload step", code="bad_part")
        self.offload.check_step(s, env, self.cfg)
        t0 = times.since("envelope", t0)
        digest, slot = digest or hashlib.sha256(body).hexdigest(), (env.layer, env.part)
        times.since("digest", t0)
        prev = s.last_step.get(slot)
        same = None if prev is None else prev.same_request(env.positions, digest)
        if same is False:
            raise ConflictError(f"layer {env.layer} {env.part} positions {env.positions[0]}.. were already sent "
                                "with other ciphertexts; repeat the same request", code="step_mismatch")
        if same:
            return prev.answer if isinstance(prev.answer, bytes) else await asyncio.shield(prev.answer)
        try:
            s.mlp_lease.check()
        except KeyCancelledError as exc:
            raise PermissionDeniedError(f"MLP key no longer usable: {exc}", code="key_not_active") from exc
        task = asyncio.ensure_future(self._run_mlp(s, env, request_id, times))
        s.last_step[slot] = StepRecord(env.positions, digest, task)
        task.add_done_callback(lambda t, rec=s.last_step[slot]: self._step_done(s, slot, rec, prev, t))
        return await asyncio.shield(task)

    async def _run_mlp(self, s: Session, env: envelope.Envelope, request_id: str,
                       times: StepTimes | None = None) -> bytes:
        """Any worker holding the MLP key set (the session's always does) runs the step; on the gpu backend,
        batched with the other sessions' steps of the same (layer, part) queued there (``batch_steps``)."""
        from server.private.offload import OffloadSteps

        times = times or StepTimes()
        holders = [w for w, fp in self._loaded if fp == s.mlp_fingerprint] or [s.worker]
        worker = self.pool.least_loaded(holders)
        packed = OffloadSteps.packed(env, self.cfg.offload_chunk_layout)   # from the checked envelope and settings
        batch = (("mlp_step", env.layer, env.part, packed) if self.cfg.gpu_backend and self.cfg.batch_steps > 1
                 else None)
        try:
            blobs = await self._timed(times, self.pool.submit(
                worker, s.tenant, "mlp_step", s.mlp_fingerprint, env.layer, env.part, list(env.blobs), packed,
                batch=batch, stages=times.stages))
        except TaskError as exc:
            if exc.code is WorkerCode.KEY_NOT_LOADED:
                self._unload((worker, s.mlp_fingerprint))
            raise task_error(exc, request_id) from exc
        except WorkerError as exc:
            raise _lost_worker("the worker running this MLP step was lost; retry", "worker_lost") from exc
        self.sessions.touch(s)
        t0 = time.monotonic()
        out = envelope.Envelope(s.id, s.mlp_fingerprint, env.layer, "result", env.positions, tuple(blobs),
                                env.backend, env.params, env.part).to_bytes()
        times.since("result", t0)
        times.ran(env.positions[1])
        return out

    @staticmethod
    async def _timed(times: StepTimes, call: Any) -> Any:
        """Await a worker call, noting as ``pool_rest`` its time outside the stages the pool measured."""
        t0 = time.monotonic()
        out = await call
        measured = sum(times.stages.get(k, 0.0) for k in _POOL_STAGES)
        times.stages["pool_rest"] = max(0.0, time.monotonic() - t0 - measured)
        return out

    def _check_next(self, s: Session, env: envelope.Envelope) -> None:
        """A new step must continue the layer and run on a usable key."""
        start = env.positions[0]
        if start != s.expected(env.layer):
            raise ConflictError(f"layer {env.layer} expects position {s.expected(env.layer)}, got {start}",
                                code="position_mismatch")
        try:
            s.lease.check()
        except KeyCancelledError as exc:
            raise PermissionDeniedError(f"key no longer usable: {exc}", code="key_not_active") from exc

    async def _advance(self, s: Session, env: envelope.Envelope, request_id: str, times: StepTimes) -> bytes:
        """Run the step in the session's worker and move the layer on."""
        start, count = env.positions
        blobs, nbytes = await self._timed(times, self._run_step(s, env, request_id, times.stages))
        s.next_position[env.layer] = start + count
        s.nbytes = nbytes
        self.sessions.touch(s)
        t0 = time.monotonic()
        out = envelope.Envelope(s.id, s.fingerprint, env.layer, "result", (start, count), tuple(blobs),
                                env.backend, env.params).to_bytes()
        times.since("result", t0)
        times.ran(count)
        return out

    @staticmethod
    def _step_done(s: Session, layer: Any, rec: StepRecord, prev: StepRecord | None, task: asyncio.Future) -> None:
        """Keep a finished step's answer for retries; a failed one leaves the layer as it was."""
        if s.last_step.get(layer) is not rec:
            return
        if task.cancelled() or task.exception() is not None:  # exception() also marks it retrieved
            if prev is None:
                s.last_step.pop(layer, None)
            else:
                s.last_step[layer] = prev
            return
        s.last_step[layer] = StepRecord(rec.positions, rec.digest, task.result(), rec.kind)

    def max_step_blobs(self) -> int:
        """Ciphertexts the largest legal step carries: ``max_step_tokens`` (an attention prefill), or an
        offload step's chunk tiles (a 64-position ``attn_qkv`` step of SmolLM2 carries 72), at least the
        envelope's default bound."""
        n = self.cfg.max_step_tokens
        if self.offload is not None:
            n = max(n, self.offload.max_inputs(n))
        return max(n, envelope.MAX_BLOBS)

    def _parse(self, body: bytes) -> envelope.Envelope:
        try:
            return envelope.parse(body, self.cfg.max_blob_bytes, self.cfg.max_step_bytes, views=True,
                                  max_blobs=self.max_step_blobs())
        except envelope.EnvelopeError as exc:
            if exc.too_large:
                raise RequestTooLargeError(str(exc), code="step_too_large") from exc
            raise InvalidRequestError(f"bad envelope: {exc}", code="bad_envelope") from exc

    def _check_step(self, s: Session, env: envelope.Envelope) -> None:
        start, count = env.positions
        self._check_route(s, env)
        if env.kind not in STEP_KINDS or not 1 <= count <= self.cfg.max_step_tokens:
            raise InvalidRequestError(f"a step carries 1..{self.cfg.max_step_tokens} tokens", code="bad_step")
        if env.kind == "packed":
            self._check_packed(start, count, len(env.blobs))
        elif len(env.blobs) != count:
            raise InvalidRequestError(f"{count} positions but {len(env.blobs)} ciphertexts", code="bad_step")
        if start + count > self.cfg.max_session_tokens:
            raise RequestTooLargeError(f"session limit of {self.cfg.max_session_tokens} positions",
                                       code="session_full")

    def _check_route(self, s: Session, env: envelope.Envelope) -> None:
        """The envelope names this session, its key, the server's backend and an encrypted layer."""
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

    def _check_packed(self, start: int, count: int, blobs: int) -> None:
        """A packed prefill step: ceil(count / chunk) ciphertexts of ``packed_chunk`` tokens, starting
        at a cache block boundary (the SDK sends per-token steps elsewhere)."""
        chunk = self.packed_chunk
        if not chunk:
            raise InvalidRequestError("this server's plan has no packed prefill", code="bad_step")
        if start % chunk:
            raise InvalidRequestError(f"a packed step starts at a multiple of {chunk}", code="bad_step")
        if blobs != -(-count // chunk):
            raise InvalidRequestError(f"{count} positions come in {-(-count // chunk)} packed ciphertexts "
                                      f"of {chunk}, got {blobs}", code="bad_step")

    async def _run_step(self, s: Session, env: envelope.Envelope, request_id: str, stages: dict | None = None):
        start, count = env.positions
        blobs = list(env.blobs)
        if env.kind == "verify":
            return await self._session_task(s, request_id, "step_verify", env.layer, start, blobs, stages=stages)
        if env.kind == "packed":
            return await self._session_task(s, request_id, "step_packed", env.layer, start, count, blobs,
                                            stages=stages)
        return await self._session_task(s, request_id, "step", env.layer, start, blobs, stages=stages)

    async def _session_task(self, s: Session, request_id: str, method: str, *args, stages: dict | None = None):
        """``method(s.id, s.fingerprint, *args)`` on the worker holding ``s``: a session the worker no
        longer knows is marked lost; a lost worker is 503 ``session_lost``."""
        try:
            return await self.pool.submit(s.worker, s.tenant, method, s.id, s.fingerprint, *args, stages=stages)
        except TaskError as exc:
            if exc.code in (WorkerCode.SESSION_UNKNOWN, WorkerCode.SESSION_DESYNC):
                s.state, s.reason = SessionState.LOST, "worker_lost"
            raise task_error(exc, request_id) from exc
        except WorkerError as exc:
            raise _lost_worker("the worker holding this session was lost; open a new session and replay",
                               "session_lost") from exc

    # --- speculative decoding: rollback after a verify step --------------------------------------
    async def _rollback(self, s: Session, env: envelope.Envelope, digest: str, request_id: str) -> bytes:
        """``rollback`` (positions ``[keep, dropped]``, no blobs): the layer's cache back to ``keep``.

        Only inside the layer's last step, and only if that was a ``verify`` step; ``keep + dropped`` must
        be where the layer stands. Retry-safe: the same request again gets the same answer."""
        self._check_route(s, env)
        prev = s.last_step.get(env.layer)
        if prev is not None and prev.kind == "rollback" and prev.same_request(env.positions, digest):
            return prev.answer
        if prev is not None and prev.kind == "verify" and not isinstance(prev.answer, bytes):
            await asyncio.shield(prev.answer)    # the verify step still runs: the rollback comes after it
            prev = s.last_step.get(env.layer)
        keep, dropped = env.positions
        self._check_rollback(s, env.layer, keep, dropped, prev)
        try:
            s.lease.check()
        except KeyCancelledError as exc:
            raise PermissionDeniedError(f"key no longer usable: {exc}", code="key_not_active") from exc
        _, s.nbytes = await asyncio.shield(self._session_task(s, request_id, "rollback", env.layer, keep))
        s.next_position[env.layer] = keep
        self.sessions.touch(s)
        answer = envelope.Envelope(s.id, s.fingerprint, env.layer, "result", (keep, dropped), (),
                                   env.backend, env.params).to_bytes()
        s.last_step[env.layer] = StepRecord(env.positions, digest, answer, "rollback")
        return answer

    def _check_rollback(self, s: Session, layer: int, keep: int, dropped: int, prev: StepRecord | None) -> None:
        """400 ``bad_rollback`` for a rollback that does not describe the layer's cache (beyond it, or not
        ending where the layer stands); 409 ``rollback_refused`` for one into committed positions."""
        at = s.expected(layer)
        if keep + dropped != at:
            raise InvalidRequestError(f"rollback of layer {layer} to {keep} dropping {dropped}: the layer holds "
                                      f"{at} positions (keep + dropped must equal it)", code="bad_rollback")
        if prev is None or prev.kind != "verify" or keep < prev.positions[0]:
            first = prev.positions[0] if prev is not None and prev.kind == "verify" else at
            raise ConflictError(f"rollback of layer {layer} to {keep}: positions before {first} are committed "
                                "(a rollback may only drop positions of the layer's last verify step)",
                                code="rollback_refused")

    async def close_session(self, tenant: str, sid: str, *, actor: str, reason: str = "client",
                            request_id: str | None = None) -> None:
        s = self.sessions.get(sid)
        if s is None or s.tenant != tenant:
            raise NotFoundError("no such session", code="session_not_found")
        await self._close(s, reason, actor, request_id)

    async def _close(self, s: Session, reason: str, actor: str | None, request_id: str | None = None) -> None:
        self.sessions.remove(s.id)
        if s.state is not SessionState.LOST and s.lease is not None:  # its cache may still sit in the worker
            try:
                await self.pool.submit(s.worker, s.tenant, "close_session", s.id)
            except WorkerError:
                pass  # the worker is gone, and the session with it
        if s.lease is not None:
            s.lease.release()
        self._release_mlp(s)
        s.reason = s.reason or reason
        self.sessions.bury(s)  # LOST stays LOST for the tombstone: the SDK replays on session_lost
        s.state = SessionState.CLOSED
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
        for slot in [slot for slot in self._loaded if slot[0] == worker]:
            self._unload(slot)
        for s in self.sessions.on_worker(worker):
            s.state, s.reason = SessionState.LOST, "worker_lost"

    def _mark_closed(self, sid: str, reason: str) -> None:
        s = self.sessions.get(sid)
        if s is not None and s.state is SessionState.OPEN:
            s.state, s.reason = SessionState.CLOSED, reason

    def _key_left_active(self, rec: KeyRecord, reason: str) -> None:
        """Revocation/expiry of one registration: drop its key set from the workers where no other
        registration owns it (its own sessions were closed through their leases)."""
        emptied = self._disown(_owner(rec), rec.fingerprint)
        if emptied:
            try:
                asyncio.get_running_loop().create_task(self._drop_key(emptied, rec.fingerprint))
            except RuntimeError:
                pass  # no loop (offline tooling): nothing is loaded in workers then

    async def _drop_key(self, workers: list[int], fp: str) -> None:
        for worker in workers:
            if (worker, fp) in self._loaded:  # loaded again for a new owner meanwhile
                continue
            try:
                await self.pool.submit(worker, "_pool", "drop_key", fp)
            except WorkerError:
                pass  # a lost worker lost the key with it

    def _audit_session(self, event: str, s: Session, actor, request_id, detail: dict | None = None) -> None:
        """The session's attention key, or, for a session of linear steps only, its offload key."""
        key_id, fp = (s.key_id, s.fingerprint) if s.lease is not None else (s.mlp_key_id, s.mlp_fingerprint)
        self.audit.append(event, source=SOURCE, outcome=Outcome.SUCCESS, tenant=s.tenant, actor=actor,
                          key_id=key_id, key_version=s.key_version, key_fingerprint=fp,
                          request_id=request_id, detail={"session": s.id, **(detail or {})})



def _owner(rec: KeyRecord) -> Owner:
    return rec.tenant, rec.key_id, rec.version
