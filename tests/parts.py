"""The controllers' parts as production builds them, with no API server (issue 29).

A controller is made as the service makes it, its caches from a registry whose caches
are filled in this process (``testenv.caches``), and run as the service runs it: by a
small Manager (:func:`managed`), which starts its runnables, and through them the
runtime (handlers added, caches waited for, workers and resync started). The Services
controller's executor and outcomes are made here alone, to be tested directly.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from shared_svc.config import Config
from shared_svc.controllers.services.executor import Executor
from shared_svc.controllers.services.metrics import ServicesMetrics
from shared_svc.controllers.services.outcomes import Outcomes
from shared_svc.controllers.services.reconciler import ServicesReconciler
from shared_svc.k8s.events import Report
from shared_svc.k8s.objects import K8sObject
from shared_svc.kube.recorder import EventPublisher
from shared_svc.kube.registry import CacheRegistry
from shared_svc.runtime.manager import Manager, Runnable
from testenv.caches import fill, offline_registry


class NoEvents:
    """A recorder that writes every Event (nowhere)."""

    async def emit(self, report: Report) -> bool:
        return True


def services_controller(
    config: Config | None = None,
    *,
    writer: Any = None,
    recorder: Any = None,
    leader: bool = True,
    registry: CacheRegistry | None = None,
    objects: dict[str, list[K8sObject]] | None = None,
) -> ServicesReconciler:
    """The Services controller on an offline registry, every cache it reads listed (with
    ``objects`` by cache name, else empty): synced, as after the caches' first lists."""
    ctrl = ServicesReconciler(
        None,  # type: ignore[arg-type]  # no API: discovery is not run
        config or Config(),
        caches=registry or offline_registry(),
        recorder=recorder or NoEvents(),
        writer=writer,
        is_leader=lambda: leader,
    )
    for name, cache in ctrl.caches.items():
        fill(cache, (objects or {}).get(name, []))
    return ctrl


def executor(
    config: Config | None = None,
    *,
    writer: Any,
    recorder: Any = None,
    rediscover: asyncio.Event | None = None,
) -> Executor:
    """The Services controller's executor alone (``controllers/services/executor.py``)."""
    cfg = config or Config()
    return Executor(
        cfg,
        writer=writer,
        events=EventPublisher(recorder or NoEvents(), dry_run=cfg.dry_run),
        metrics=ServicesMetrics(),
        rediscover=rediscover or asyncio.Event(),
    )


def outcomes(
    config: Config | None = None, *, recorder: Any = None, metrics: ServicesMetrics | None = None
) -> Outcomes:
    """What the Services controller says about each reconcile, alone (``outcomes.py``)."""
    cfg = config or Config()
    return Outcomes(
        cfg,
        events=EventPublisher(recorder or NoEvents(), dry_run=cfg.dry_run),
        metrics=metrics or ServicesMetrics(),
    )


@contextlib.asynccontextmanager
async def managed(
    parts: Sequence[Runnable], *, is_leader: Callable[[], bool] = lambda: True
) -> AsyncIterator[Manager]:
    """``parts`` run by a Manager until the block ends, then stopped as on SIGTERM (in
    reverse order, the work in flight finished); a part that ended unexpectedly fails."""
    manager = Manager(parts, is_leader)
    stop = asyncio.Event()
    task = await manager.start(stop)
    try:
        yield manager
    finally:
        stop.set()
        crashed = await asyncio.wait_for(task, 30)
        assert crashed == [], crashed
