"""Encrypted sessions as the server process tracks them (the ciphertext state lives in a worker).

State machine per session (``docs/protocol.md``)::

    OPEN --step(layer, [start, count])--> OPEN        positions must continue each layer's cache
      |  (a step repeated with the same layer, positions and body bytes gets the stored answer, or waits
      |   for the running one: retry-safe; the same positions with another body are refused, 409)
      |  (after a ``verify`` step, ``rollback(layer, keep)`` moves the layer back to any position inside it)
      +--close / TTL / key revoked--> CLOSED
      +--worker lost--> LOST (410: open a new session and replay)
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import secrets
import time
from collections.abc import Callable


class SessionState(str, enum.Enum):
    OPEN = "open"
    CLOSED = "closed"
    LOST = "lost"


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One layer's latest step: its positions, the SHA-256 of the request body, and its answer (a task
    while it runs, the result envelope once done)."""

    positions: tuple[int, int]
    digest: str
    answer: asyncio.Future | bytes
    #: the envelope kind (a rollback may follow only a ``verify`` step)
    kind: str = ""

    def same_request(self, positions: tuple[int, int], digest: str) -> bool | None:
        """None: another step; True: the same request again; False: these positions with another body."""
        if positions != self.positions:
            return None
        return digest == self.digest


@dataclasses.dataclass
class Session:
    """One tenant's encrypted session, pinned to one worker.

    A session of an offload plan whose server layers are all linear steps has no attention key:
    ``key_id``, ``fingerprint`` and ``lease`` are None, ``key_version`` is its offload key's, and the worker
    is where its offload key set was loaded first (linear steps keep no state in a worker)."""

    id: str
    tenant: str
    key_id: str | None
    key_version: int
    fingerprint: str | None
    worker: int
    created: float
    last_used: float
    lease: object | None = None
    state: SessionState = SessionState.OPEN
    next_position: dict[int, int] = dataclasses.field(default_factory=dict)
    last_step: dict[int, StepRecord] = dataclasses.field(default_factory=dict)
    nbytes: int = 0
    reason: str = ""
    #: an offload plan's session: the offload key set (fingerprint, lease, key id) its linear steps run on
    mlp_fingerprint: str | None = None
    mlp_lease: object | None = None
    mlp_key_id: str | None = None

    def expected(self, layer: int) -> int:
        return self.next_position.get(layer, 0)


class SessionTable:
    """Sessions by id with per-tenant counts and TTL; time is injected."""

    #: closed or lost sessions remembered (for ``ttl_s``) so their ids answer 410 with the reason, not 404
    MAX_TOMBSTONES = 10_000

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self._clock = ttl_s, clock
        self._sessions: dict[str, Session] = {}
        self._gone: dict[str, tuple[str, SessionState, str, float]] = {}  # id -> (tenant, state, reason, when)

    def new_id(self) -> str:
        return "ps_" + secrets.token_urlsafe(18)

    def add(self, s: Session) -> None:
        self._sessions[s.id] = s

    def get(self, sid: str) -> Session | None:
        return self._sessions.get(sid)

    def remove(self, sid: str) -> Session | None:
        return self._sessions.pop(sid, None)

    def bury(self, s: Session) -> None:
        """Remember a removed session's end (``LOST`` or ``CLOSED`` and why), oldest forgotten first."""
        now = self._clock()
        self._gone[s.id] = (s.tenant, s.state, s.reason, now)
        while self._gone and (len(self._gone) > self.MAX_TOMBSTONES
                              or now - next(iter(self._gone.values()))[3] > self.ttl_s):
            del self._gone[next(iter(self._gone))]

    def gone(self, sid: str) -> tuple[str, SessionState, str] | None:
        """(tenant, state, reason) of a session that was removed within ``ttl_s``, else None."""
        entry = self._gone.get(sid)
        return None if entry is None or self._clock() - entry[3] > self.ttl_s else entry[:3]

    def count(self, tenant: str) -> int:
        return sum(1 for s in self._sessions.values() if s.tenant == tenant and s.state is SessionState.OPEN)

    def touch(self, s: Session) -> None:
        s.last_used = self._clock()

    def now(self) -> float:
        return self._clock()

    def expired(self) -> list[Session]:
        now = self._clock()
        return [s for s in self._sessions.values() if now - s.last_used > self.ttl_s]

    def on_worker(self, worker: int) -> list[Session]:
        return [s for s in self._sessions.values() if s.worker == worker and s.state is SessionState.OPEN]

    def with_key(self, tenant: str, key_id: str, version: int) -> list[Session]:
        return [s for s in self._sessions.values()
                if (s.tenant, s.key_id, s.key_version) == (tenant, key_id, version)]

    def __len__(self) -> int:
        return len(self._sessions)
