"""Per-tenant service accounting for the fair scheduler (virtual time, as in start-time fair queuing).

Each tenant with work has a counter of the tokens the engine computed for it. The scheduler serves the
tenant with the smallest counter first, so over time every busy tenant gets the same number of tokens.
A tenant that was idle must not bank credit (it would then take whole steps on its return): when it becomes
active again its counter is raised to the *clock*, the smallest counter among the tenants that were busy
in the last step (Linux CFS does the same with ``min_vruntime``). Counters of idle tenants that hold no
debt are dropped, so the table stays as large as the set of busy tenants.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable


class FairShare:
    """Tokens served per tenant key (the request's ``tenant``; ``None`` is one tenant too)."""

    def __init__(self) -> None:
        self.served: dict[Hashable, int] = {}
        self.clock = 0

    def activate(self, tenants: Iterable[Hashable]) -> None:
        """Start a step with these tenants busy: a returning tenant starts at the clock, not below it."""
        for t in tenants:
            self.served[t] = max(self.served.get(t, 0), self.clock)

    def charge(self, tenant: Hashable, tokens: int) -> None:
        """Count ``tokens`` computed for ``tenant`` in this step."""
        self.served[tenant] = self.served.get(tenant, self.clock) + tokens

    def end_step(self, busy: Iterable[Hashable]) -> None:
        """Advance the clock to the least-served busy tenant; forget idle tenants without debt."""
        busy = set(busy)
        if busy:
            self.clock = max(self.clock, min(self.served[t] for t in busy))
        for t in [t for t, v in self.served.items() if t not in busy and v <= self.clock]:
            del self.served[t]

    def rank(self, tenant: Hashable) -> int:
        """The tenant's place in the queue: fewer tokens served runs first."""
        return self.served.get(tenant, self.clock)
