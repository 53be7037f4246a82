"""Stateful property test of the key lifecycle (Hypothesis ``RuleBasedStateMachine``).

Random sequences of register / activate / use / rotate / suspend / reinstate / revoke / destroy /
clock ticks / expiry sweeps / in-flight lease checks run against the real registry and a real audit
log, next to a small model of NIST SP 800-57. The registry parses no key bytes (an inspector's verdict
comes with each upload): here every upload comes with an explicit PUBLIC inspection, since what is
tested is the lifecycle (``test_keys_registry.py`` runs the production inspector). After every step:

* a key is usable (a lease is granted, a lease stays uncancelled) only when the model says ACTIVE
  and unexpired; every lease of a key that left ACTIVE is cancelled at once;
* the audit records written by the step are exactly the model's transitions, one record per
  transition (same key, version, from, to, in order), plus exactly the non-transition records the
  step must write (refused use, refused transition, rotation notice) and nothing else.

The log verifies against its signed checkpoints at the end of every run.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from server.audit import AuditConfig, AuditLog, CheckpointSigner, Pseudonymizer, verify_log
from server.keys import (
    Inspection,
    KeyCancelledError,
    KeyExistsError,
    KeyNotFoundError,
    KeyNotUsableError,
    KeyRegistry,
    KeyState,
    KeyStateError,
    RegistryConfig,
    Verdict,
    can_transition,
)

S = KeyState
KEY_IDS = ("a", "b")
LIFETIME, MAX_GRACE = 1000.0, 500.0


PUBLIC = Inspection(Verdict.PUBLIC, "5e" * 32, canonical=b"parsed public keys", key_set="a1" * 32)


@functools.lru_cache(maxsize=1)
def _uploads() -> tuple[bytes, ...]:
    return tuple(f"public evaluation keys #{i}".encode() * 64 for i in range(3))  # three distinct uploads


class Clock:
    def __init__(self) -> None:
        self.t = 1767225600.0

    def __call__(self) -> float:
        return self.t


class KeyLifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="cipherlm-keys-"))
        self.clock, self.signer = Clock(), CheckpointSigner.generate()
        self.log = AuditLog.open(
            AuditConfig(self.dir / "audit.log", fsync=False, checkpoint_every=25),
            self.signer,
            Pseudonymizer(b"p" * 32),
            clock=self.clock,
        )
        self.reg = KeyRegistry(
            RegistryConfig(default_lifetime_s=LIFETIME, max_grace_s=MAX_GRACE),
            self.log,
            clock=self.clock,
        )
        self.model: dict[str, dict[int, dict]] = {}
        self.leases: list = []
        self.seen = 1  # the log's creation record

    # -- model helpers -------------------------------------------------------------------------
    def _due(self, m: dict) -> bool:
        now = self.clock.t
        return m["state"] is S.ACTIVE and (
            (m["expires"] is not None and now >= m["expires"])
            or (m["grace"] is not None and now >= m["grace"])
        )

    def _expire(self, key_id: str, version: int, trans: list) -> None:
        m = self.model[key_id][version]
        if self._due(m):
            trans.append((key_id, version, "active", "deactivated"))
            self._set_state(key_id, version, S.DEACTIVATED)

    def _set_state(self, key_id: str, version: int, to: KeyState) -> None:
        """Model transition; leaving ACTIVE cancels the version's leases for good (reinstating does
        not revive work that was stopped)."""
        if self.model[key_id][version]["state"] is S.ACTIVE and to is not S.ACTIVE:
            for entry in self.leases:
                if entry[:2] == [key_id, version]:
                    entry[3] = True
        self.model[key_id][version]["state"] = to

    def _version(self, key_id: str, pick: int) -> int:
        """Mostly an existing version of ``key_id``; pick 0 names one that does not exist."""
        versions = sorted(self.model.get(key_id, {}))
        return versions[(pick - 1) % len(versions)] if versions and pick else 99

    def _expect(self, transitions: list, others: list[str], ordered: bool = True) -> None:
        """New records == ``transitions`` (as tuples, in order) + ``others`` (event names, any order)."""
        lines = (self.dir / "audit.log").read_bytes().split(b"\n")[self.seen : -1]
        self.seen += len(lines)
        recs = [json.loads(x) for x in lines]
        got_t = [
            (r["key_id"], r["key_version"], r["state_from"], r["state_to"])
            for r in recs
            if r["outcome"] == "success" and r["state_from"] != r["state_to"]
        ]
        got_o = sorted(
            r["event"] for r in recs if not (r["outcome"] == "success" and r["state_from"] != r["state_to"])
        )
        assert got_t == transitions if ordered else sorted(got_t, key=str) == sorted(transitions, key=str)
        assert got_o == sorted(others)

    def _simple(self, key_id, version, op, to: KeyState, event: str, **kw) -> None:
        versions = self.model.get(key_id, {})
        if version not in versions:
            with pytest.raises(KeyNotFoundError):
                op("t", key_id, version, actor="u", **kw)
            return self._expect([], [])
        m = versions[version]
        allowed = can_transition(m["state"], to) and not (
            op == self.reg.reinstate and m["state"] is not S.SUSPENDED
        )
        if allowed:
            op("t", key_id, version, actor="u", **kw)
            self._expect([(key_id, version, m["state"].value, to.value)], [])
            self._set_state(key_id, version, to)
        else:
            with pytest.raises(KeyStateError):
                op("t", key_id, version, actor="u", **kw)
            self._expect([], [event])

    # -- rules ---------------------------------------------------------------------------------
    @initialize(upload=st.integers(0, 2), lifetime=st.one_of(st.none(), st.integers(1, 2000)))
    def start_with_an_active_key(self, upload, lifetime):
        """Most runs should spend their steps on live keys, not on reaching one."""
        self.register("a", upload)
        self.activate("a", 1, lifetime)

    @rule(key_id=st.sampled_from(KEY_IDS), upload=st.integers(0, 2))
    def register(self, key_id, upload):
        if key_id in self.model:
            with pytest.raises(KeyExistsError):
                self.reg.register("t", key_id, _uploads()[upload], PUBLIC, actor="u")
            return self._expect([], [])
        self.reg.register("t", key_id, _uploads()[upload], PUBLIC, actor="u")
        self.model[key_id] = {1: {"state": S.PRE_ACTIVE, "expires": None, "grace": None}}
        self._expect([(key_id, 1, None, "pre_active")], [])

    @rule(
        key_id=st.sampled_from(KEY_IDS),
        pick=st.integers(0, 6),
        lifetime=st.one_of(st.none(), st.integers(1, 2000)),
    )
    def activate(self, key_id, pick, lifetime):
        version = self._version(key_id, pick)
        m = self.model.get(key_id, {}).get(version)
        expires = None if lifetime is None else self.clock.t + lifetime
        if m is not None and m["state"] is S.PRE_ACTIVE:
            self.reg.activate("t", key_id, version, actor="u", expires_at=expires)
            self._expect([(key_id, version, "pre_active", "active")], [])
            m.update(state=S.ACTIVE, expires=expires if expires is not None else self.clock.t + LIFETIME)
            return None
        exc = KeyNotFoundError if m is None else KeyStateError
        with pytest.raises(exc):
            self.reg.activate("t", key_id, version, actor="u", expires_at=expires)
        self._expect([], [] if m is None else ["key.activated"])

    @rule(key_id=st.sampled_from(KEY_IDS), pick=st.one_of(st.none(), st.integers(0, 6)))
    def use(self, key_id, pick):
        version = None if pick is None else self._version(key_id, pick)
        versions = self.model.get(key_id, {})
        v = max(versions) if versions and version is None else version
        if v not in versions:
            with pytest.raises(KeyNotFoundError):
                self.reg.use("t", key_id, version)
            return self._expect([], [])
        trans: list = []
        self._expire(key_id, v, trans)
        if versions[v]["state"] is S.ACTIVE:
            lease = self.reg.use("t", key_id, version)
            assert lease.record.version == v
            self.leases.append([key_id, v, lease, False])
            return self._expect(trans, [])
        with pytest.raises(KeyNotUsableError):
            self.reg.use("t", key_id, version)
        self._expect(trans, ["key.use_refused"])

    @rule(
        key_id=st.sampled_from(KEY_IDS),
        upload=st.integers(0, 2),
        grace=st.sampled_from([0, 1, 30, 300, int(MAX_GRACE)]),
    )
    def rotate(self, key_id, upload, grace):
        versions = self.model.get(key_id)
        if not versions:
            with pytest.raises(KeyNotFoundError):
                self.reg.rotate("t", key_id, _uploads()[upload], PUBLIC, actor="u", grace_s=grace)
            return self._expect([], [])
        old, new = max(versions), max(versions) + 1
        self.reg.rotate("t", key_id, _uploads()[upload], PUBLIC, actor="u", grace_s=grace)
        if versions[old]["state"] is S.ACTIVE:
            versions[old]["grace"] = self.clock.t + grace
        versions[new] = {"state": S.ACTIVE, "expires": self.clock.t + LIFETIME, "grace": None}
        self._expect(
            [(key_id, new, None, "pre_active"), (key_id, new, "pre_active", "active")], ["key.rotated"]
        )

    @rule(key_id=st.sampled_from(KEY_IDS), pick=st.integers(0, 6))
    def suspend(self, key_id, pick):
        version = self._version(key_id, pick)
        self._simple(key_id, version, self.reg.suspend, S.SUSPENDED, "key.suspended")

    @rule(key_id=st.sampled_from(KEY_IDS), pick=st.integers(0, 6))
    def reinstate(self, key_id, pick):
        version = self._version(key_id, pick)
        self._simple(key_id, version, self.reg.reinstate, S.ACTIVE, "key.reinstated")

    @rule(key_id=st.sampled_from(KEY_IDS), pick=st.integers(0, 6), compromised=st.booleans())
    def revoke(self, key_id, pick, compromised):
        version = self._version(key_id, pick)
        to, event = (S.COMPROMISED, "key.compromised") if compromised else (S.DEACTIVATED, "key.deactivated")
        self._simple(key_id, version, self.reg.revoke, to, event, compromised=compromised)

    @rule(key_id=st.sampled_from(KEY_IDS), pick=st.integers(0, 6))
    def destroy(self, key_id, pick):
        version = self._version(key_id, pick)
        self._simple(key_id, version, self.reg.destroy, S.DESTROYED, "key.destroyed")

    @rule(seconds=st.integers(0, 700))
    def tick(self, seconds):
        self.clock.t += seconds

    @rule(offset=st.sampled_from([-1e-3, 0.0]))
    def tick_to_deadline(self, offset):
        """Jump to just before / exactly at the next expiry or grace end (where off-by-ones live)."""
        deadlines = [
            d
            for vs in self.model.values()
            for m in vs.values()
            for d in (m["expires"], m["grace"])
            if d is not None and d + offset > self.clock.t
        ]
        if deadlines:
            self.clock.t = min(deadlines) + offset

    @rule()
    def expire_due(self):
        trans: list = []
        for key_id in sorted(self.model):
            for v in sorted(self.model[key_id]):
                self._expire(key_id, v, trans)
        self.reg.expire_due()
        self._expect(trans, [], ordered=False)  # the sweep's order is the registry's, not the model's

    @rule()
    def check_leases(self):
        """In-flight work checks its lease: allowed exactly while the model says usable."""
        trans: list = []
        for key_id, v, _lease, cancelled in self.leases:
            if not cancelled:   # a cancelled lease fails before it looks at the clock: no lazy expiry
                self._expire(key_id, v, trans)
        for _key_id, _v, lease, cancelled in self.leases:
            if not cancelled:
                lease.check()
            else:
                with pytest.raises(KeyCancelledError):
                    lease.check()
        self._expect(trans, [])

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def registry_matches_model(self):
        for key_id, versions in self.model.items():
            for v, m in versions.items():
                assert self.reg.get("t", key_id, v).state is m["state"]

    @invariant()
    def no_lease_outlives_active(self):
        for key_id, v, lease, cancelled in self.leases:
            assert lease.cancelled == cancelled
            if self.model[key_id][v]["state"] is not S.ACTIVE:
                assert lease.cancelled

    def teardown(self) -> None:
        self.log.close()
        result = verify_log(self.dir / "audit.log", {self.signer.key_id: self.signer.public_key})
        shutil.rmtree(self.dir, ignore_errors=True)
        assert result.ok, result.reason


KeyLifecycle.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_key_lifecycle = KeyLifecycle.TestCase
