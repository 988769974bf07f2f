"""Runnables, the controller helper that runs workers over a work queue, and the manager.

A :class:`Runnable` (the protocol, with its defaults, is ``wait.runnable``'s: parts in
``kube/`` are Runnables too) runs until its ``stop`` event is set and answers ``ready()``
(caches synced), ``alive()`` (not wedged), ``status()`` (for ``/status``) and
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
from typing import Any, Generic, TypeVar

from shared_svc.runtime.metrics import RuntimeMetrics
from shared_svc.runtime.workqueue import ShutDown, WorkQueue
from shared_svc.wait.loop import repeat
from shared_svc.wait.ratelimit import RateLimiter
from shared_svc.wait.runnable import Runnable as Runnable  # the protocol, below kube/

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)

# A controller whose heartbeat is older than this, or whose reconcile has run longer, is
# not alive (/livez fails, the kubelet restarts the pod).
STALL_SECONDS = 120.0
DRAIN_SECONDS = 30.0  # how long a stop waits for the keys in flight


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
        metrics.declare(name)
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
    """Calls ``fn`` every ``seconds()`` until ``stop`` (the first call after one period)."""
    await repeat(stop, fn, seconds, name=name, at_once=False)


class Periodic(Runnable):
    """A :class:`Runnable` that calls ``step`` at once and then every ``seconds()`` (or when
    ``wake`` is set) until stopped, then awaits ``on_stop``. For the parts that only look
    again from time to time: the Lease, the guard monitor, the certificate reload,
    ServiceMonitor discovery."""

    def __init__(
        self,
        name: str,
        step: Callable[[], Any],
        seconds: Callable[[], float],
        *,
        wake: asyncio.Event | None = None,
        on_stop: Callable[[], Awaitable[None]] | None = None,
        status: Callable[[], dict[str, Any]] | None = None,
        needs_leader: bool = False,
    ) -> None:
        self.name = name
        self.needs_leader = needs_leader
        self._step = step
        self._seconds = seconds
        self._wake = wake
        self._on_stop = on_stop
        self._status = status
        self.steps = 0
        self.stopped = False
        self._in_step_since: float | None = None  # monotonic start of the step running now

    async def _counted(self) -> None:
        self.steps += 1
        self._in_step_since = time.monotonic()
        try:
            result = self._step()
            if asyncio.iscoroutine(result):
                await result
        finally:
            self._in_step_since = None

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await repeat(stop, self._counted, self._seconds, name=self.name, wake=self._wake)
        finally:
            if self._on_stop is not None:
                await self._on_stop()
            self.stopped = True

    def alive(self) -> bool:
        """Not stuck in one step for longer than ``STALL_SECONDS`` (/livez)."""
        since = self._in_step_since
        return since is None or time.monotonic() - since < STALL_SECONDS

    def status(self) -> dict[str, Any]:
        return self._status() if self._status is not None else {}


def _started_event(runnable: Runnable) -> asyncio.Event | None:
    """A runnable that needs a moment to start (a server binding its port) has ``started``."""
    started = getattr(runnable, "started", None)
    return started if isinstance(started, asyncio.Event) else None


class Manager:
    """Runs the runnables: those that need the leader only while this replica leads.

    They start in the order given, each one that has a ``started`` event only after the
    one before it has started (the HTTP server listens before the Lease is campaigned
    for); the others start at once, one after the other without waiting (the caches all
    list at once, and the controllers after them wait for the caches they read to
    sync). They stop in the reverse order, each after the one after it has finished (the
    controllers finish their reconcile in flight, then the caches stop, then the Lease
    is released, then the servers close). ``started`` is set once every runnable has
    started.
    """

    def __init__(self, runnables: Sequence[Runnable], is_leader: Callable[[], bool]) -> None:
        self.runnables = list(runnables)
        self._is_leader = is_leader
        self._leadership = asyncio.Event()
        self.started = asyncio.Event()
        self.stopped: list[str] = []  # names, in the order they stopped

    def leadership_changed(self, leader: bool) -> None:
        for runnable in self.runnables:
            runnable.leadership_changed(leader)
        self._leadership.set()

    def alive(self) -> bool:
        return all(r.alive() for r in self.runnables)

    def ready(self) -> bool:
        return all(r.ready() for r in self.runnables)

    async def run(self, stop: asyncio.Event) -> list[BaseException]:
        """Until ``stop`` or until a runnable ends unexpectedly; then stops every runnable
        in reverse order (each finishes its work in flight). Returns what the runnables
        that ended unexpectedly raised."""
        tasks: dict[int, tuple[asyncio.Event, asyncio.Future[None]]] = {}
        stopper: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
        try:
            for runnable in self.runnables:
                if runnable.needs_leader:
                    continue
                tasks[id(runnable)] = entry = self._start(runnable)
                started = _started_event(runnable)
                if started is not None:
                    waiter: asyncio.Future[Any] = asyncio.ensure_future(started.wait())
                    await asyncio.wait(
                        [waiter, entry[1], stopper], return_when=asyncio.FIRST_COMPLETED
                    )
                    waiter.cancel()
                    if entry[1].done() or stopper.done():
                        return await self._stop_all(tasks)
            self.started.set()
            while True:
                await self._gate(tasks)
                self._leadership.clear()
                changed: asyncio.Future[Any] = asyncio.ensure_future(self._leadership.wait())
                running = [task for _, task in tasks.values()]
                await asyncio.wait(
                    [stopper, changed, *running], return_when=asyncio.FIRST_COMPLETED
                )
                changed.cancel()
                if stopper.done() or any(t.done() for t in running):
                    return await self._stop_all(tasks)
        finally:
            stopper.cancel()

    def _start(self, runnable: Runnable) -> tuple[asyncio.Event, asyncio.Future[None]]:
        own_stop = asyncio.Event()
        return own_stop, asyncio.ensure_future(runnable.run(own_stop))

    async def _stop_all(
        self, tasks: dict[int, tuple[asyncio.Event, asyncio.Future[None]]]
    ) -> list[BaseException]:
        crashed = [
            exc
            for _, t in tasks.values()
            if t.done() and not t.cancelled() and (exc := t.exception()) is not None
        ]
        for exc in crashed:
            log.error("controller ended unexpectedly", exc_info=exc)
        for runnable in reversed(self.runnables):
            entry = tasks.pop(id(runnable), None)
            if entry is None:
                continue
            entry[0].set()
            await asyncio.gather(entry[1], return_exceptions=True)
            self.stopped.append(runnable.name)
        return crashed

    async def _gate(self, tasks: dict[int, tuple[asyncio.Event, asyncio.Future[None]]]) -> None:
        lead = self._is_leader()
        for runnable in self.runnables:
            if not runnable.needs_leader:
                continue
            entry = tasks.get(id(runnable))
            if lead and entry is None:
                tasks[id(runnable)] = self._start(runnable)
            elif not lead and entry is not None:
                entry[0].set()
                await asyncio.gather(entry[1], return_exceptions=True)
                del tasks[id(runnable)]
