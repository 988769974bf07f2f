"""A work queue of hashable keys with client-go's semantics, on asyncio.

- **dedup**: a key added while it waits is handed out once;
- **in-flight tracking**: a key is handed to one worker at a time; added while a worker
  has it, it is queued again only after :meth:`WorkQueue.done` (then at once, or after
  the ``dirty_after`` that ``done`` is given);
- **delayed adds**: :meth:`WorkQueue.add_after`; of two pending delayed adds of a key the
  earlier wins, and an add now cancels a pending delayed one (it is subsumed);
- **rate-limited adds**: :meth:`WorkQueue.add_rate_limited` asks the queue's limiter how
  long the key waits (``forget`` and ``num_requeues`` pass through);
- **shutdown**: after :meth:`WorkQueue.shut_down` no key is handed out or added;
  :meth:`WorkQueue.drain` waits (bounded) for the keys in flight to be done.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Hashable
from typing import Generic, TypeVar

from shared_svc.runtime.instrumentation import RuntimeMetrics
from shared_svc.wait.ratelimit import ItemExponentialFailureRateLimiter, RateLimiter

K = TypeVar("K", bound=Hashable)


class ShutDown(Exception):
    """The queue is shut down: no more keys."""


class WorkQueue(Generic[K]):
    def __init__(
        self,
        name: str,
        *,
        rate_limiter: RateLimiter | None = None,
        metrics: RuntimeMetrics | None = None,
    ) -> None:
        self.name = name
        self.rate_limiter: RateLimiter = rate_limiter or ItemExponentialFailureRateLimiter(
            0.005, 1000.0
        )
        self._metrics = metrics
        self._order: deque[K] = deque()
        self._queued: set[K] = set()
        self._processing: set[K] = set()
        self._dirty: set[K] = set()  # added while in flight
        self._timers: dict[K, tuple[float, asyncio.TimerHandle]] = {}
        self._getters: deque[asyncio.Future[None]] = deque()
        self._shutting_down = False
        self._idle = asyncio.Event()  # set while no key is in flight
        self._idle.set()
        # With metrics: when each queued key was added, and each key in flight handed out
        # (workqueue_queue_duration_seconds, workqueue_work_duration_seconds).
        self._added_at: dict[K, float] = {}
        self._got_at: dict[K, float] = {}

    # --- adding ---

    def add(self, key: K) -> None:
        if self._shutting_down:
            return
        self._cancel_timer(key)
        if key in self._processing:
            self._dirty.add(key)
            return
        if key in self._queued:
            return
        self._queued.add(key)
        self._order.append(key)
        if self._metrics:
            self._metrics.workqueue_adds.labels(self.name).inc()
            self._added_at[key] = time.monotonic()
        self._depth()
        self._wake_one()

    def add_after(self, key: K, delay: float) -> None:
        """Add ``key`` in ``delay`` seconds (now when ``delay <= 0``); an earlier pending
        delayed add of the same key wins."""
        if self._shutting_down:
            return
        if delay <= 0:
            self.add(key)
            return
        loop = asyncio.get_running_loop()
        due = loop.time() + delay
        current = self._timers.get(key)
        if current is not None:
            if current[0] <= due:
                return
            current[1].cancel()
        self._timers[key] = (due, loop.call_at(due, self._fire, key))

    def add_rate_limited(self, key: K) -> float:
        """Add ``key`` after the delay its limiter gives (a retry); returns that delay."""
        delay = self.rate_limiter.when(key)
        if self._metrics:
            self._metrics.workqueue_retries.labels(self.name).inc()
        self.add_after(key, delay)
        return delay

    def forget(self, key: K) -> None:
        self.rate_limiter.forget(key)

    def num_requeues(self, key: K) -> int:
        return self.rate_limiter.num_requeues(key)

    # --- handing out ---

    async def get(self) -> K:
        """The next key, marked in flight until :meth:`done`; raises :class:`ShutDown`."""
        while not self._order:
            if self._shutting_down:
                raise ShutDown(self.name)
            waiter = asyncio.get_running_loop().create_future()
            self._getters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter in self._getters:
                    self._getters.remove(waiter)
                elif self._order:
                    self._wake_one()  # woken, then cancelled: pass the wake on
                raise
        if self._shutting_down:
            raise ShutDown(self.name)
        key = self._order.popleft()
        self._queued.discard(key)
        self._processing.add(key)
        self._idle.clear()
        self._depth()
        if self._metrics:
            now = time.monotonic()
            added = self._added_at.pop(key, now)
            self._metrics.workqueue_queue_duration.labels(self.name).observe(now - added)
            self._got_at[key] = now
        return key

    def done(self, key: K, *, dirty_after: float = 0.0) -> None:
        """``key`` is finished; if it was added meanwhile it is queued again (at once, or
        in ``dirty_after`` seconds)."""
        self._processing.discard(key)
        if not self._processing:
            self._idle.set()
        got = self._got_at.pop(key, None)
        if self._metrics and got is not None:
            self._metrics.workqueue_work_duration.labels(self.name).observe(time.monotonic() - got)
        if key in self._dirty:
            self._dirty.discard(key)
            self.add_after(key, dirty_after)
        if self._order:
            self._wake_one()  # a getter woken for a key another took first waits again

    # --- state ---

    def __len__(self) -> int:
        return len(self._order)

    def processing(self, key: K) -> bool:
        return key in self._processing

    def pending(self, key: K) -> bool:
        """Queued, re-added while in flight, or due by a delayed add."""
        return key in self._queued or key in self._dirty or key in self._timers

    # --- shutdown ---

    def shut_down(self) -> None:
        """No key is handed out or added any more; workers waiting in :meth:`get` get
        :class:`ShutDown`. Keys in flight may still finish (:meth:`drain`)."""
        self._shutting_down = True
        for _, handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        while self._getters:
            waiter = self._getters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    async def drain(self, timeout: float) -> bool:
        """Waits up to ``timeout`` for the keys in flight to be done; True if they are."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    # --- internals ---

    def _fire(self, key: K) -> None:
        self._timers.pop(key, None)
        self.add(key)

    def _cancel_timer(self, key: K) -> None:
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer[1].cancel()

    def _wake_one(self) -> None:
        while self._getters:
            waiter = self._getters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _depth(self) -> None:
        if self._metrics:
            self._metrics.workqueue_depth.labels(self.name).set(len(self._order))
