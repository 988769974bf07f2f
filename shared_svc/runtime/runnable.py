"""Runnables, the controller helper that runs workers over a work queue, and the manager.

A :class:`Runnable` runs until its ``stop`` event is set and answers ``ready()`` (caches
synced), ``alive()`` (not wedged), ``status()`` (for ``/status``) and
``leadership_changed()``. One whose ``needs_leader`` is true runs only while this replica
leads (the :class:`Manager` starts and stops it); one that plans on a standby too (both
controllers: warm caches, take over at once) runs always and gates its own writes.

A :class:`Controller` hands the keys of its :class:`~.workqueue.WorkQueue` to ``workers``
workers, one key to one worker at a time, records controller-runtime's metrics, turns a
failure into a rate-limited retry (nothing escapes a worker), beats its heartbeat and, on
stop, finishes the keys in flight (bounded) before it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from shared_svc.runtime.metrics import RuntimeMetrics
from shared_svc.runtime.ratelimit import RateLimiter
from shared_svc.runtime.workqueue import ShutDown, WorkQueue

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)

# A controller whose heartbeat is older than this, or whose reconcile has run longer, is
# not alive (/livez fails, the kubelet restarts the pod).
STALL_SECONDS = 120.0
DRAIN_SECONDS = 30.0  # how long a stop waits for the keys in flight


class Runnable(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def needs_leader(self) -> bool: ...
    async def run(self, stop: asyncio.Event) -> None: ...
    def ready(self) -> bool: ...
    def alive(self) -> bool: ...
    def status(self) -> dict[str, Any]: ...
    def leadership_changed(self, leader: bool) -> None: ...


@dataclass(frozen=True)
class Result:
    """What one reconcile of a key says. ``result`` is the metric's label (None: nothing
    was reconciled, e.g. the caches are not synced yet; not counted)."""

    result: str | None = "success"
    requeue_after: float | None = None  # look again this soon even without a change
    retry: bool = False  # failed: queue again after the rate limiter's delay
    forget: bool = True  # start the key's failure count over


class Controller(Generic[K]):
    """Workers over a work queue. With ``cooldown`` (seconds), a key is handed out again
    no sooner than ``cooldown`` after its last reconcile ended (or, after a failure, than
    its retry delay): changes meanwhile become one reconcile. Without it, keys are queued
    at once."""

    def __init__(
        self,
        name: str,
        reconcile: Callable[[K], Awaitable[Result]],
        *,
        metrics: RuntimeMetrics,
        rate_limiter: RateLimiter,
        workers: int = 1,
        cooldown: float | None = None,
        beat_seconds: Callable[[], float] = lambda: 1.0,
        on_beat: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self._reconcile = reconcile
        self._metrics = metrics
        self.queue: WorkQueue[K] = WorkQueue(name, rate_limiter=rate_limiter, metrics=metrics)
        self.workers = workers
        self._cooldown = cooldown
        self._not_before: dict[K, float] = {}  # loop time (with a cooldown)
        self._retry_now: set[K] = set()
        self._beat_seconds = beat_seconds
        self._on_beat = on_beat
        self._started: dict[K, float] = {}  # monotonic start of each reconcile in flight
        self.heartbeat = time.monotonic()
        self.reconciles = 0

    # --- adding keys ---

    def enqueue(self, key: K) -> None:
        """Something about ``key`` changed: reconcile it (respecting the cooldown)."""
        if self._cooldown is None or self.queue.processing(key):
            self.queue.add(key)  # in flight: queued again when done (after the spacing)
        else:
            self.queue.add_after(key, self.spacing(key))

    def retry_now(self, key: K) -> None:
        """The cause of past failures may be gone: forget them and reconcile now."""
        self.queue.forget(key)
        self._not_before.pop(key, None)
        if self.queue.processing(key):
            self._retry_now.add(key)
        self.queue.add(key)

    def spacing(self, key: K) -> float:
        due = self._not_before.get(key)
        return 0.0 if due is None else max(0.0, due - asyncio.get_running_loop().time())

    def pending(self, key: K) -> bool:
        return self.queue.pending(key)

    # --- health ---

    def alive(self) -> bool:
        now = time.monotonic()
        wedged = any(now - started > STALL_SECONDS for started in self._started.values())
        return now - self.heartbeat < STALL_SECONDS and not wedged

    # --- running ---

    async def run(self, stop: asyncio.Event) -> None:
        tasks = [asyncio.ensure_future(self._worker()) for _ in range(self.workers)]
        tasks.append(asyncio.ensure_future(self._beat(stop)))
        try:
            await stop.wait()
            # Finish the keys in flight, so a SIGTERM never cuts a reconcile's writes in
            # half (bounded: a stuck call is cut).
            self.queue.shut_down()
            if not await self.queue.drain(DRAIN_SECONDS):
                log.warning("stopping with reconciles in flight", extra={"controller": self.name})
        finally:
            self.queue.shut_down()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _beat(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.heartbeat = time.monotonic()
            if self._on_beat is not None:
                try:
                    self._on_beat()
                except Exception:
                    log.exception("beat failed", extra={"controller": self.name})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._beat_seconds())

    async def _worker(self) -> None:
        while True:
            try:
                key = await self.queue.get()
            except ShutDown:
                return
            await self.process(key)

    async def process(self, key: K) -> None:
        """Reconcile one key handed out by the queue, then account for it."""
        started = time.perf_counter()
        self._started[key] = time.monotonic()
        self.reconciles += 1
        dirty_after = 0.0
        try:
            try:
                result = await self._reconcile(key)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning(
                    "reconcile failed",
                    extra={"controller": self.name, "key": str(key), "error": repr(exc)[:300]},
                )
                result = Result("error", retry=True)
            m = self._metrics
            if result.result is not None:
                m.reconcile_total.labels(self.name, result.result).inc()
                if result.result == "error":
                    m.reconcile_errors.labels(self.name).inc()
                m.reconcile_time.labels(self.name).observe(time.perf_counter() - started)
            now = asyncio.get_running_loop().time()
            if key in self._retry_now:
                self._retry_now.discard(key)  # a retry_now during the reconcile
                self.queue.forget(key)
                self._not_before.pop(key, None)
            elif result.retry:
                delay = self.queue.add_rate_limited(key)
                if self._cooldown is not None:
                    self._not_before[key] = now + delay
            else:
                if result.forget:
                    self.queue.forget(key)
                if self._cooldown is not None:
                    self._not_before[key] = now + self._cooldown
                if result.requeue_after is not None:
                    self.queue.add_after(key, result.requeue_after)
            if self._cooldown is not None:
                dirty_after = self.spacing(key)
        finally:
            self._started.pop(key, None)
            self.queue.done(key, dirty_after=dirty_after)


async def every(
    stop: asyncio.Event, seconds: Callable[[], float], fn: Callable[[], Any], *, name: str
) -> None:
    """Calls ``fn`` every ``seconds()`` until ``stop``; a failure is logged, not fatal."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds())
        if stop.is_set():
            return
        try:
            result = fn()
            if asyncio.iscoroutine(result):
                await result
        except Exception:
            log.exception("periodic task failed", extra={"task": name})


class Manager:
    """Runs the runnables: those that need the leader only while this replica leads."""

    def __init__(self, runnables: Sequence[Runnable], is_leader: Callable[[], bool]) -> None:
        self.runnables = list(runnables)
        self._is_leader = is_leader
        self._leadership = asyncio.Event()

    def leadership_changed(self, leader: bool) -> None:
        for runnable in self.runnables:
            runnable.leadership_changed(leader)
        self._leadership.set()

    async def run(self, stop: asyncio.Event) -> list[BaseException]:
        """Until ``stop`` or until a runnable ends unexpectedly; then stops every runnable
        (each finishes its work in flight). Returns what the runnables that ended
        unexpectedly raised."""
        work_stop = asyncio.Event()
        always = [
            asyncio.ensure_future(r.run(work_stop)) for r in self.runnables if not r.needs_leader
        ]
        gated = [r for r in self.runnables if r.needs_leader]
        leading: dict[int, tuple[asyncio.Event, asyncio.Future[None]]] = {}
        stopper: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
        try:
            while True:
                if gated:
                    await self._gate(gated, leading)
                self._leadership.clear()
                changed: asyncio.Future[Any] = asyncio.ensure_future(self._leadership.wait())
                running = [*always, *(task for _, task in leading.values())]
                waited: list[asyncio.Future[Any]] = [stopper, changed, *running]
                await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                if stopper.done() or any(t.done() for t in running):
                    break
        finally:
            stopper.cancel()
            crashed = [
                exc
                for t in [*always, *(task for _, task in leading.values())]
                if t.done() and not t.cancelled() and (exc := t.exception()) is not None
            ]
            for exc in crashed:
                log.error("controller ended unexpectedly", exc_info=exc)
            work_stop.set()
            for own_stop, _ in leading.values():
                own_stop.set()
            await asyncio.gather(
                *always, *(task for _, task in leading.values()), return_exceptions=True
            )
        return crashed

    async def _gate(
        self,
        gated: list[Runnable],
        leading: dict[int, tuple[asyncio.Event, asyncio.Future[None]]],
    ) -> None:
        lead = self._is_leader()
        for runnable in gated:
            entry = leading.get(id(runnable))
            if lead and entry is None:
                own_stop = asyncio.Event()
                leading[id(runnable)] = (own_stop, asyncio.ensure_future(runnable.run(own_stop)))
            elif not lead and entry is not None:
                entry[0].set()
                await asyncio.gather(entry[1], return_exceptions=True)
                del leading[id(runnable)]
