"""Rate limiters: how long a key waits before its next try (client-go's workqueue family).

Every retry delay in shared-svc comes from here: a failed reconcile of either controller
and a failed list or watch of a cache. Each limiter answers ``when(key)`` (the delay of
the next try, counting it as a failure), ``forget(key)`` (it succeeded: start over) and
``num_requeues(key)``.

The same token bucket also paces writes: every write of the Services writer and of the
upgrade controller waits for a token (``BucketRateLimiter.take``), as client-go's REST
client does with its QPS/Burst limiter.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Protocol


class RateLimiter(Protocol):
    def when(self, key: Hashable) -> float: ...
    def forget(self, key: Hashable) -> None: ...
    def num_requeues(self, key: Hashable) -> int: ...


def exponential_delay(
    failures: int,
    base: float,
    cap: float,
    *,
    max_exponent: int = 30,
    jitter: float = 0.0,
) -> float:
    """``min(cap, base * 2**min(failures, max_exponent))``, then scaled into
    ``[1 - jitter, 1]`` by ``jitter`` (a fraction) drawn from ``random``."""
    delay: float = min(cap, base * 2.0 ** min(failures, max_exponent))
    if jitter:
        delay *= 1 - jitter + jitter * random.random()
    return delay


class ItemExponentialFailureRateLimiter:
    """Per key: the n-th failure in a row waits ``min(cap, base * 2**min(n, max_exponent))``,
    times a random factor in ``[1 - jitter, 1]`` (spreads replicas and caches that failed
    together). ``forget`` starts the key over."""

    def __init__(
        self,
        base: float,
        cap: float,
        *,
        max_exponent: int = 30,
        jitter: float = 0.0,
    ) -> None:
        if base <= 0 or cap <= 0 or not 0 <= jitter < 1:
            raise ValueError("base and cap must be > 0 and jitter in [0, 1)")
        self.base = base
        self.cap = cap
        self.max_exponent = max_exponent
        self.jitter = jitter
        self._failures: Counter[Hashable] = Counter()

    def when(self, key: Hashable) -> float:
        self._failures[key] += 1
        return exponential_delay(
            self._failures[key],
            self.base,
            self.cap,
            max_exponent=self.max_exponent,
            jitter=self.jitter,
        )

    def forget(self, key: Hashable) -> None:
        self._failures.pop(key, None)

    def num_requeues(self, key: Hashable) -> int:
        return self._failures[key]


class BucketRateLimiter:
    """An overall token bucket over all keys: ``rate`` tries per second, ``burst`` at once.
    ``when`` reserves a token and answers how long until it is there; ``take`` reserves
    one and waits for it (a write's turn: concurrent callers queue in reservation order)."""

    def __init__(self, rate: float, burst: int, *, clock: Callable[[], float]) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate = rate
        self.burst = float(burst)
        self._clock = clock
        self._tokens = float(burst)
        self._last: float | None = None

    def when(self, key: Hashable) -> float:
        now = self._clock()
        if self._last is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= 1
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate

    async def take(self) -> None:
        """Wait until a token is there, and spend it."""
        delay = self.when(None)
        if delay > 0:
            await asyncio.sleep(delay)

    def forget(self, key: Hashable) -> None:
        pass

    def num_requeues(self, key: Hashable) -> int:
        return 0
