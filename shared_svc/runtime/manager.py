"""The Manager and the Runnables it runs besides the controllers.

A :class:`Runnable` (the protocol, with its defaults, is ``wait.runnable``'s: parts in
``kube/`` are Runnables too) runs until its ``stop`` event is set and answers ``ready()``
(caches synced), ``alive()`` (not wedged), ``status()`` (for ``/status``) and
``leadership_changed()``. One whose ``needs_leader`` is true runs only while this replica
leads (the :class:`Manager` starts and stops it); one that plans on a standby too (both
controllers: warm caches, take over at once) runs always and gates its own writes.

Every long-running task of shared-svc is started here or by the controller runtime
(``runtime.controller``): the :class:`Manager` runs the parts, a :class:`Periodic` is a
part that looks again from time to time, a :class:`Switched` one runs another part only
while a condition holds. Nothing else starts a task that outlives its call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from shared_svc.k8s.objects import K8sObject, name_of
from shared_svc.runtime import controller
from shared_svc.runtime.source import Enqueue, Source, all_synced, until_synced
from shared_svc.wait.loop import repeat
from shared_svc.wait.runnable import Runnable as Runnable  # the protocol, below kube/

log = logging.getLogger(__name__)


class Periodic(Runnable):
    """A :class:`Runnable` that calls ``step`` at once and then every ``seconds()`` (or when
    ``wake`` is set) until stopped, then awaits ``on_stop``. For the parts that only look
    again from time to time: the Lease, the guard monitor, the certificate reload,
    ServiceMonitor discovery, the upgrade gate's review. One that :meth:`watch`es caches
    takes its first step once they are synced, and each of their changes wakes it."""

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
        self.wake = wake if wake is not None else asyncio.Event()
        self._on_stop = on_stop
        self._status = status
        self._watched: list[tuple[Source, Enqueue[str]]] = []
        self.steps = 0
        self.stopped = False
        self._in_step_since: float | None = None  # monotonic start of the step running now

    def watch(self, source: Source) -> Enqueue[str]:
        """Each change of ``source`` wakes this part; its first step waits for the sync."""
        handler: Enqueue[str] = Enqueue(self._woken, _name)
        self._watched.append((source, handler))
        return handler

    def _woken(self, _: str) -> None:
        self.wake.set()

    def ready(self) -> bool:
        return all_synced(source for source, _ in self._watched)

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
            for source, handler in self._watched:
                source.add_handler(handler)
            if await until_synced(stop, [source for source, _ in self._watched]):
                await repeat(stop, self._counted, self._seconds, name=self.name, wake=self.wake)
        finally:
            if self._on_stop is not None:
                await self._on_stop()
            self.stopped = True

    def alive(self) -> bool:
        """Not stuck in one step for longer than ``STALL_SECONDS`` (/livez)."""
        since = self._in_step_since
        return since is None or time.monotonic() - since < controller.STALL_SECONDS

    def status(self) -> dict[str, Any]:
        return self._status() if self._status is not None else {}


def _name(obj: K8sObject) -> str:
    return name_of(obj)


class Switched(Runnable):
    """Runs ``part`` only while ``on()`` holds (the ServiceMonitor cache, while discovery
    finds its API served): :meth:`flip` says ``on()`` may have changed; the part is then
    started, or stopped as the Manager stops a part (its stop set, its run awaited),
    after which ``when_off`` puts it in its off state. Ready while off, or once the part
    is; a part that ends while on ends this one (the Manager stops every part)."""

    def __init__(
        self,
        part: Runnable,
        on: Callable[[], bool],
        *,
        when_off: Callable[[], None] | None = None,
    ) -> None:
        self.name = part.name
        self.part = part
        self._on = on
        self._when_off = when_off
        self._flipped = asyncio.Event()
        self.running = False

    def flip(self) -> None:
        self._flipped.set()

    def ready(self) -> bool:
        return not self.running or self.part.ready()

    def alive(self) -> bool:
        return not self.running or self.part.alive()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self._flipped.clear()
            if not self._on():
                await _first(stop, self._flipped)
                continue
            await self._run_while_on(stop)

    async def _run_while_on(self, stop: asyncio.Event) -> None:
        own_stop = asyncio.Event()
        task = asyncio.ensure_future(self.part.run(own_stop))
        self.running = True
        try:
            while not stop.is_set() and self._on() and not task.done():
                self._flipped.clear()
                await _first(stop, self._flipped, task)
        finally:
            own_stop.set()
            await asyncio.gather(task, return_exceptions=True)
            self.running = False
            if self._when_off is not None:
                self._when_off()
        if task.done() and not task.cancelled() and not stop.is_set() and self._on():
            task.result()  # what ended it, raised: it ends this part too


async def _first(stop: asyncio.Event, flipped: asyncio.Event, *others: asyncio.Future[Any]) -> None:
    """Waits for ``stop``, ``flipped`` or one of ``others``."""
    waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(flipped.wait())]
    try:
        await asyncio.wait([*waiters, *others], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


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

    async def start(self, stop: asyncio.Event) -> asyncio.Future[list[BaseException]]:
        """Runs the Manager (:meth:`run`) in the background and returns once every runnable
        has started (``started``), or once the run ended first (a runnable that ended
        while starting, or ``stop``). Returns the run: awaited, what :meth:`run` returns."""
        task = asyncio.ensure_future(self.run(stop))
        started = asyncio.ensure_future(self.started.wait())
        try:
            await asyncio.wait([task, started], return_when=asyncio.FIRST_COMPLETED)
        finally:
            started.cancel()
        return task

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
