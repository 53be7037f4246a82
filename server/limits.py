"""Per-tenant limits: requests/min, encrypted steps/min, tokens/min, concurrent requests — refused with
429 + Retry-After.

Rates are token buckets (capacity = the per-minute limit, refilled continuously), so a tenant may burst
up to its minute's budget and then proceeds at the steady rate; the ``Retry-After`` is the time until
the bucket holds enough again. Checks run in the request path *before* the engine sees the request:
requests/min and concurrency before the body is tokenized, tokens/min right after (the cost is the
prompt plus ``n * max_tokens`` reserved; what a request did not generate is refunded). The clock is
injected so tests are exact.

A step of an open encrypted session (one layer, or one linear part of a layer, for one token) is charged
to its own bucket, steps/min, not to requests/min: an offload generation sends 4 steps per server layer per
token (112 for the 28-layer plan), so as requests it spent the default 600 a minute in ~8 tokens on a GPU
and was then held to 10 steps a second, 11 s a token (issue 17, session 10). Steps still take a
concurrency slot.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator

from server.errors import InvalidRequestError, RateLimitError
from server.settings import LimitSettings

Clock = Callable[[], float]


@dataclasses.dataclass
class TokenBucket:
    """``capacity`` units, refilled at ``capacity / 60`` per second."""

    capacity: float
    level: float
    stamp: float

    @classmethod
    def per_minute(cls, limit: int, now: float) -> TokenBucket:
        return cls(capacity=float(limit), level=float(limit), stamp=now)

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.capacity / 60.0)
        self.stamp = now

    def take(self, amount: float, now: float) -> float:
        """Take ``amount`` if available and return 0; else take nothing and return the seconds to wait."""
        self._refill(now)
        if self.level >= amount:
            self.level -= amount
            return 0.0
        return (amount - self.level) * 60.0 / self.capacity

    def give_back(self, amount: float, now: float) -> None:
        """Return unused units (never above capacity)."""
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)


class TenantLimiter:
    """The live limit state of one tenant."""

    def __init__(self, limits: LimitSettings, clock: Clock) -> None:
        self.limits = limits
        self._clock = clock
        now = clock()
        rpm, spm, tpm = limits.requests_per_minute, limits.steps_per_minute, limits.tokens_per_minute
        self._requests = TokenBucket.per_minute(rpm, now) if rpm else None
        self._steps = TokenBucket.per_minute(spm, now) if spm else None
        self._tokens = TokenBucket.per_minute(tpm, now) if tpm else None
        self.in_flight = 0
        self._lock = threading.Lock()

    def admit(self) -> None:
        """Count one request against requests/min and take a concurrency slot (release with :meth:`release`).

        Raises:
            RateLimitError: over requests/min or at max concurrency (nothing was taken).
        """
        self._admit(self._requests, "requests_per_minute", "requests")

    def admit_step(self) -> None:
        """:meth:`admit` for a step of an open encrypted session: counted against steps/min, not requests/min
        (a generation is one request's worth of work in many steps; see the module docstring).

        Raises:
            RateLimitError: over steps/min or at max concurrency (nothing was taken).
        """
        self._admit(self._steps, "steps_per_minute", "steps")

    def _admit(self, bucket: TokenBucket | None, limit: str, unit: str) -> None:
        with self._lock:
            cap = self.limits.max_concurrent
            if cap is not None and self.in_flight >= cap:
                raise RateLimitError(f"too many concurrent requests (limit {cap})", retry_after=1.0,
                                     code="concurrency_limit_exceeded")
            if bucket is not None:
                wait = bucket.take(1, self._clock())
                if wait:
                    raise RateLimitError(f"rate limit reached: {getattr(self.limits, limit)} {unit} per minute",
                                         retry_after=wait, code=f"{limit}_exceeded")
            self.in_flight += 1

    def release(self) -> None:
        """Give back the concurrency slot taken by :meth:`admit`."""
        with self._lock:
            self.in_flight = max(0, self.in_flight - 1)

    def charge_tokens(self, tokens: int) -> None:
        """Reserve ``tokens`` against tokens/min.

        Raises:
            InvalidRequestError: the request alone exceeds the per-minute budget (retrying cannot help).
            RateLimitError: not enough budget now; Retry-After says when.
        """
        if self._tokens is None:
            return
        limit = self.limits.tokens_per_minute
        if tokens > limit:
            raise InvalidRequestError(
                f"this request needs {tokens} tokens (prompt + n * max_tokens) but the tenant's limit is "
                f"{limit} tokens per minute; lower max_tokens or n",
                param="max_tokens", code="request_too_large")
        with self._lock:
            wait = self._tokens.take(tokens, self._clock())
        if wait:
            raise RateLimitError(f"rate limit reached: {limit} tokens per minute", retry_after=wait,
                                 code="tokens_per_minute_exceeded")

    def refund_tokens(self, tokens: int) -> None:
        """Return reserved tokens the request did not use."""
        if self._tokens is not None and tokens > 0:
            with self._lock:
                self._tokens.give_back(tokens, self._clock())


class LimitRegistry:
    """One :class:`TenantLimiter` per tenant id, created on first use."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._limiters: dict[str, TenantLimiter] = {}
        self._lock = threading.Lock()

    def for_tenant(self, tenant_id: str, limits: LimitSettings) -> TenantLimiter:
        """The tenant's limiter (rebuilt when its limits changed)."""
        with self._lock:
            limiter = self._limiters.get(tenant_id)
            if limiter is None or limiter.limits != limits:
                limiter = self._limiters[tenant_id] = TenantLimiter(limits, self._clock)
            return limiter

    @contextlib.contextmanager
    def slot(self, tenant_id: str, limits: LimitSettings) -> Iterator[TenantLimiter]:
        """``admit`` on enter, ``release`` on exit."""
        limiter = self.for_tenant(tenant_id, limits)
        limiter.admit()
        try:
            yield limiter
        finally:
            limiter.release()
