"""The Controller: what a controller reads, declared; workers over a work queue, run.

A controller says what it reads and how an event becomes a key (:meth:`Controller.watch`,
controller-runtime's ``Watch(source, handler, predicates...)``) and what it looks at
again from time to time (:meth:`Controller.resync`); :meth:`Controller.run` does the
rest, as controller-runtime's ``Controller.Start``: it adds the handlers to the caches,
waits for every watched cache to sync, then starts the workers and the resync.

The workers hand the keys of the :class:`~.workqueue.WorkQueue` out, one key to one
worker at a time; with ``only_when_synced``, only while every cache it reads is synced (a
cache that lost its watch is re-listing: no reconcile runs on what it holds; the key
waits in the queue: the Services controller, which plans from all of them). They record controller-runtime's metrics, turn a failure into a rate-limited retry
(nothing escapes a worker), beat the heartbeat (from the start: waiting for the caches
is not being wedged) and, on stop, finish the keys in flight (bounded) before
:meth:`Controller.run` returns.

What a re-list means: a cache that lists again after it lost its watch (an API-server
outage) hands out its objects again (``kube.store``: a replay); the key of a replayed
object is retried at once (:meth:`Controller.retry_now`): the failures before the outage
say nothing about now.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from shared_svc.k8s.objects import K8sObject
from shared_svc.runtime.instrumentation import RuntimeMetrics
from shared_svc.runtime.source import Enqueue, Predicate, Source, all_synced, until_synced
from shared_svc.runtime.workqueue import ShutDown, WorkQueue
from shared_svc.wait.loop import repeat
from shared_svc.wait.ratelimit import RateLimiter
from shared_svc.wait.runnable import Runnable

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)

# A controller whose heartbeat is older than this, or whose reconcile has run longer, is
# not alive (/livez fails, the kubelet restarts the pod).
STALL_SECONDS = 120.0
DRAIN_SECONDS = 30.0  # how long a stop waits for the keys in flight


@dataclass(frozen=True)
class Result:
    """What one reconcile of a key says. ``result`` is the metric's label (None: nothing
    was reconciled; not counted)."""

    result: str | None = "success"
    requeue_after: float | None = None  # look again this soon even without a change
    retry: bool = False  # failed: queue again after the rate limiter's delay
    forget: bool = True  # start the key's failure count over


@dataclass(frozen=True)
class Options:
    """How the runtime runs a reconciler (controller-runtime's ``controller.Options``):
    its metrics, its retry backoff, how many workers, the spacing of a key's reconciles
    (``cooldown``), the heartbeat, and whether no key is handed out while a cache it
    reads re-lists (``only_when_synced``)."""

    metrics: RuntimeMetrics
    rate_limiter: RateLimiter
    workers: int = 1
    cooldown: float | None = None
    beat_seconds: Callable[[], float] = lambda: 1.0
    on_beat: Callable[[], None] | None = None
    only_when_synced: bool = False


class Reconciler(Protocol[K]):
    """controller-runtime's ``Reconciler`` (``Reconcile(ctx, req) (Result, error)``) and
    its ``SetupWithManager``: what a controller package writes; the runtime's
    :class:`Controller` is built from it by :func:`controller_for`.

    ``reconcile(key)``: one key, what happened and when to look again; ``options``: how
    it is run; ``setup(controller)``: what it reads, declared (``watch``, ``reads``,
    ``resync``), and what its parts ask of the queue; ``ready()``: ready beyond its caches'
    sync; ``parts()``: Runnables that run beside it (started before it, stopped after)."""

    name: str
    options: Options

    async def reconcile(self, key: K) -> Result: ...

    def setup(self, controller: Controller[K]) -> None: ...

    def ready(self) -> bool: ...

    def parts(self) -> list[Runnable]: ...


def controller_for(reconciler: Reconciler[K]) -> Controller[K]:
    """The runtime's Controller of ``reconciler`` (controller-runtime's builder,
    ``ControllerManagedBy(mgr)...Complete(r)``): the one way a controller is made; run it
    with its parts by a Manager (:meth:`Controller.runnables`)."""
    controller: Controller[K] = Controller(
        reconciler.name,
        reconciler.reconcile,
        reconciler.options,
        ready=reconciler.ready,
        parts=reconciler.parts(),
    )
    reconciler.setup(controller)
    return controller


@dataclass(frozen=True)
class _Watch(Generic[K]):
    source: Source
    handler: Enqueue[K]


class Controller(Runnable, Generic[K]):
    """Workers over a work queue, fed by the caches it watches. With ``cooldown``
    (seconds), a key is handed out again no sooner than ``cooldown`` after its last
    reconcile ended (or, after a failure, than its retry delay): changes meanwhile become
    one reconcile. Without it, keys are queued at once.

    A Runnable of the Manager, on a standby too (a controller plans there, its caches
    warm; its reconciler gates its own writes): ready once every cache it reads is synced
    and ``ready()`` holds; becoming leader, it looks at every key of its resync again
    (what the last leader left)."""

    needs_leader = False

    def __init__(
        self,
        name: str,
        reconcile: Callable[[K], Awaitable[Result]],
        options: Options,
        *,
        ready: Callable[[], bool] = lambda: True,
        parts: Sequence[Runnable] = (),
    ) -> None:
        """``ready``: ready beyond the caches' sync; ``parts``: Runnables that run beside
        it (:meth:`runnables`)."""
        self.name = name
        self._ready = ready
        self._parts = tuple(parts)
        self._only_when_synced = options.only_when_synced
        self._reconcile = reconcile
        self._metrics = metrics = options.metrics
        metrics.declare(name)
        self.queue: WorkQueue[K] = WorkQueue(
            name, rate_limiter=options.rate_limiter, metrics=metrics
        )
        self.workers = options.workers
        self._cooldown = options.cooldown
        self._not_before: dict[K, float] = {}  # loop time (with a cooldown)
        self._retry_now: set[K] = set()
        self._beat_seconds = options.beat_seconds
        self._on_beat = options.on_beat
        self._started: dict[K, float] = {}  # monotonic start of each reconcile in flight
        self._watches: list[_Watch[K]] = []
        self._reads: list[Source] = []
        self._resync: tuple[Callable[[], float], Callable[[], Iterable[K]]] | None = None
        self._handlers_added = False
        self.heartbeat = time.monotonic()
        self.reconciles = 0

    # --- what it reads ---

    def watch(
        self, source: Source, key_of: Callable[[K8sObject], K], *predicates: Predicate
    ) -> Enqueue[K]:
        """Declares that this controller reads ``source``: each of its events that every
        predicate lets through enqueues ``key_of`` its object (a replay retries it now).
        The handler is added by :meth:`run`, which waits for ``source`` to sync; it is
        returned (its counts: ``events``, ``enqueued``)."""
        handler: Enqueue[K] = Enqueue(self.enqueue, key_of, predicates, retry=self.retry_now)
        self._watches.append(_Watch(source, handler))
        return handler

    def reads(self, source: Source) -> None:
        """Declares that this controller reads ``source`` without keying its events (the
        upgrade controller's DaemonSets, read when a node comes): :meth:`run` waits for
        it to sync, and no key is handed out while it is not."""
        self._reads.append(source)

    def resync(self, seconds: float | Callable[[], float], keys: Callable[[], Iterable[K]]) -> None:
        """Every ``seconds``, each of ``keys()`` is enqueued (client-go's resync: a
        reconcile from the caches, no re-list)."""
        period = seconds if callable(seconds) else (lambda: float(seconds))
        self._resync = (period, keys)

    @property
    def sources(self) -> tuple[Source, ...]:
        """Every cache it reads: watched, or only read."""
        return (*(w.source for w in self._watches), *self._reads)

    def synced(self) -> bool:
        """Every cache it reads is synced."""
        return all_synced(self.sources)

    # --- the Runnable (``wait.runnable``) ---

    def runnables(self) -> list[Runnable]:
        """Its parts, then itself: Runnables of a Manager, after the caches (on SIGTERM
        the controller stops first, then its parts)."""
        return [*self._parts, self]

    def ready(self) -> bool:
        """Every cache it reads is synced, and its reconciler is ready (``/readyz``)."""
        return self.synced() and self._ready()

    def leadership_changed(self, leader: bool) -> None:
        if leader:
            self.enqueue_all()  # what the last leader left

    def status(self) -> dict[str, Any]:
        return {}

    # --- adding keys ---

    def enqueue(self, key: K) -> None:
        """Something about ``key`` changed: reconcile it (respecting the cooldown)."""
        if self._cooldown is None or self.queue.processing(key):
            self.queue.add(key)  # in flight: queued again when done (after the spacing)
        else:
            self.queue.add_after(key, self.spacing(key))

    def enqueue_all(self) -> None:
        """Every key the resync knows, now (becoming leader: what the last leader left)."""
        if self._resync is not None:
            for key in self._resync[1]():
                self.enqueue(key)

    def retry_now(self, key: K) -> None:
        """The cause of past failures may be gone (a cache listed again, discovery
        changed): forget them and reconcile now. A key that has not failed, and is not
        being reconciled (which may fail), is only enqueued."""
        failures = self.queue.num_requeues(key)
        if not failures and not self.queue.processing(key):
            self.enqueue(key)
            return
        if failures:
            log.info(
                "what failed before may work now: retrying at once",
                extra={"controller": self.name, "key": str(key), "failures": failures},
            )
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

    def failures(self, key: K) -> int:
        """Reconciles of ``key`` failed in a row (its retry count)."""
        return self.queue.num_requeues(key)

    # --- health ---

    def alive(self) -> bool:
        now = time.monotonic()
        wedged = any(now - started > STALL_SECONDS for started in self._started.values())
        return now - self.heartbeat < STALL_SECONDS and not wedged

    # --- running ---

    async def run(self, stop: asyncio.Event) -> None:
        """Adds the handlers, waits for every watched cache to sync, then runs the workers
        and the resync until ``stop``; then finishes the keys in flight (bounded)."""
        if not self._handlers_added:
            self._handlers_added = True
            for w in self._watches:
                w.source.add_handler(w.handler)
        tasks = [asyncio.ensure_future(self._beat(stop))]
        try:
            if await until_synced(stop, self.sources):
                tasks += [asyncio.ensure_future(self._worker()) for _ in range(self.workers)]
                if self._resync is not None:
                    tasks.append(asyncio.ensure_future(self._resync_loop(stop)))
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

    async def _resync_loop(self, stop: asyncio.Event) -> None:
        assert self._resync is not None
        await repeat(
            stop, self.enqueue_all, self._resync[0], name=f"{self.name} resync", at_once=False
        )

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
            if self._only_when_synced:  # no key is held while a cache re-lists
                for source in self.sources:
                    await source.synced.wait()
            try:
                key = await self.queue.get()
            except ShutDown:
                return
            if self._only_when_synced and not self.synced():  # lost meanwhile: it waits
                self.queue.done(key)
                self.queue.add(key)
                continue
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
            self._metrics.reconciled(self.name, result.result, time.perf_counter() - started)
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
