"""Key states and allowed transitions after NIST SP 800-57 Part 1 Rev. 5, section 7 (figure 3)."""

from __future__ import annotations

import enum

__all__ = ["KeyState", "TRANSITIONS", "can_transition"]


class KeyState(str, enum.Enum):
    """Lifecycle state of one key version. Only ACTIVE keys may be used."""

    PRE_ACTIVE = "pre_active"
    ACTIVE = "active"
    SUSPENDED = "suspended"
    DEACTIVATED = "deactivated"
    COMPROMISED = "compromised"
    DESTROYED = "destroyed"


S = KeyState
TRANSITIONS: dict[KeyState, frozenset[KeyState]] = {
    S.PRE_ACTIVE: frozenset({S.ACTIVE, S.COMPROMISED, S.DESTROYED}),
    S.ACTIVE: frozenset({S.SUSPENDED, S.DEACTIVATED, S.COMPROMISED}),
    S.SUSPENDED: frozenset({S.ACTIVE, S.DEACTIVATED, S.COMPROMISED}),
    S.DEACTIVATED: frozenset({S.COMPROMISED, S.DESTROYED}),
    S.COMPROMISED: frozenset({S.DESTROYED}),
    S.DESTROYED: frozenset(),
}


def can_transition(src: KeyState, dst: KeyState) -> bool:
    """Whether SP 800-57 allows ``src -> dst``."""
    return dst in TRANSITIONS[src]
