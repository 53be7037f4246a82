"""The session table's tombstones: a swept session still answers 410 (lost: replay; closed: reopen)."""

from __future__ import annotations

import pytest

from server.errors import GoneError, NotFoundError
from server.private.sessions import Session, SessionState, SessionTable


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _session(table: SessionTable, tenant: str = "a", state: SessionState = SessionState.OPEN) -> Session:
    s = Session(table.new_id(), tenant, "k", 1, "fp", 0, table.now(), table.now(), state=state)
    table.add(s)
    return s


def test_tombstones_keep_the_end_for_ttl_then_forget():
    clock = Clock()
    table = SessionTable(ttl_s=60, clock=clock)
    lost = _session(table, state=SessionState.LOST)
    lost.reason = "worker_lost"
    table.remove(lost.id)
    table.bury(lost)
    assert table.gone(lost.id) == ("a", SessionState.LOST, "worker_lost")
    clock.t += 61
    assert table.gone(lost.id) is None


def test_tombstones_are_bounded(monkeypatch):
    monkeypatch.setattr(SessionTable, "MAX_TOMBSTONES", 3)
    table = SessionTable(ttl_s=60, clock=Clock())
    ids = []
    for _ in range(5):
        s = _session(table)
        table.remove(s.id)
        table.bury(s)
        ids.append(s.id)
    assert [table.gone(i) is not None for i in ids] == [False, False, True, True, True]


def test_swept_sessions_answer_410_to_their_tenant_and_404_to_others():
    from server.private.service import PrivateService

    clock = Clock()
    svc = PrivateService.__new__(PrivateService)      # session_for reads only the table
    svc.sessions = SessionTable(ttl_s=60, clock=clock)
    lost, closed = _session(svc.sessions, state=SessionState.LOST), _session(svc.sessions)
    for s in (lost, closed):
        svc.sessions.remove(s.id)
        svc.sessions.bury(s)
    with pytest.raises(GoneError) as exc:
        svc.session_for("a", lost.id)
    assert exc.value.code == "session_lost"
    with pytest.raises(GoneError) as exc:
        svc.session_for("a", closed.id)
    assert exc.value.code == "session_closed"
    with pytest.raises(NotFoundError):
        svc.session_for("b", lost.id)
    clock.t += 61
    with pytest.raises(NotFoundError):
        svc.session_for("a", lost.id)
