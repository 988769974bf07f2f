"""The Services controller: cache snapshot -> planner -> writer -> reports.

Level-triggered: an event only says "look again"; every reconcile reads the whole
namespace from the caches. It runs on the runtime (``shared_svc.runtime``) as a work
queue with one key, ``services``, and one worker: events coalesce into that key (dedup),
and reconciles never overlap (in-flight tracking). An event while idle is served at
once; one that arrives during a reconcile, or less than ``coalesce_seconds`` after it,
is handed out when that spacing has passed (a delayed add), so a burst becomes few
reconciles. A failed reconcile is retried after the runtime's exponential backoff (with
jitter), cut short when a cache re-lists (the watches are back after an outage) or
discovery changes; the runtime beats the heartbeat all along (liveness = not wedged).
Every write also passes the writer's token bucket. Only the leader writes;
a standby keeps its caches warm and plans, so it can take over at once.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from shared_svc.config import Config
from shared_svc.controllers.services import caches
from shared_svc.controllers.services.discovery import ServiceMonitorDiscovery
from shared_svc.controllers.services.executor import Executor, ObjectChanged
from shared_svc.controllers.services.outcomes import Outcomes
from shared_svc.controllers.services.status import plan_status
from shared_svc.kube.recorder import Emitter, EventPublisher
from shared_svc.kube.reflector import Informer, Resource
from shared_svc.kube.registry import Cache, Informers
from shared_svc.kube.writer import Writer, namespace_gone
from shared_svc.logs import reconcile_id
from shared_svc.reconcile.fight import Contest
from shared_svc.reconcile.model import Plan, World, world_of
from shared_svc.reconcile.planner import plan as make_plan
from shared_svc.runtime.manager import Controller, Result, Runnable, every
from shared_svc.service_metrics import CONTROLLER, Metrics
from shared_svc.wait.ratelimit import ItemExponentialFailureRateLimiter

log = logging.getLogger("shared_svc.controller")  # the name its log lines have always had

# The runtime beats this often, backoff included (liveness: not wedged; whether
# reconciles succeed is /status and /metrics, not /livez).
HEARTBEAT_SECONDS = 5.0
KEY = "services"  # the one key of the work queue: "look at the namespace again"
CACHE_WAIT_SECONDS = 0.5  # caches not synced yet: look again this soon


def publisher_of(
    recorder: EventPublisher | Emitter, config: Config, metrics: Metrics
) -> EventPublisher:
    """The one Event publisher (the service's, shared with the upgrade controller and the
    guard monitor), or a bare recorder wrapped in one of our own (tests)."""
    if isinstance(recorder, EventPublisher):
        return recorder
    return EventPublisher(
        recorder,
        dry_run=config.dry_run,
        on_written=lambda r: metrics.events.labels(r.type, r.reason).inc(),
    )


def _utc() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class ServicesController:
    def __init__(
        self,
        api: ApiClient,
        config: Config,
        *,
        recorder: EventPublisher | Emitter,
        writer: Writer,
        metrics: Metrics,
        is_leader: Callable[[], bool],
        informers: Informers | None = None,
    ) -> None:
        self._api = api
        # Caches shared with the upgrade controller when the runner passes its registry
        # (its Manager runs them); else this controller's own, run by ``run``.
        self._owns_caches = informers is None
        self._shared = informers or caches.registry(api, config)
        self._config = config
        self._events = publisher_of(recorder, config, metrics)
        self._writer = writer
        self._metrics = metrics
        self._is_leader = is_leader
        self._runtime: Controller[str] = Controller(
            CONTROLLER,
            self._reconcile_key,
            metrics=metrics.runtime,
            rate_limiter=ItemExponentialFailureRateLimiter(
                config.backoff_base_seconds, config.backoff_max_seconds, jitter=0.5
            ),
            workers=1,
            cooldown=config.coalesce_seconds,
            beat_seconds=lambda: HEARTBEAT_SECONDS,
        )
        # ServiceMonitor discovery: a Runnable of its own (discovery.py), with its own cache.
        self.discovery = ServiceMonitorDiscovery(
            api,
            config,
            make_informer=lambda resource: self._informer(resource, shared=False),
            on_change=self._retry_now,
        )
        self._rediscover = self.discovery.wake  # a 404 on the ServiceMonitor path: look now
        self._relists: dict[int, int] = {}  # id(informer) -> relists seen
        # What planning reads, asked for now: the registry's caches start before ``run``.
        self._informers: dict[str, Cache] = {
            name: self._informer(resource) for name, resource in self._resources().items()
        }
        self.last_plan: Plan | None = None
        self.last_reconcile: dict[str, Any] = {}
        self.reconciling = False
        self._executor = Executor(
            config,
            writer=writer,
            events=self._events,
            metrics=metrics,
            is_leader=is_leader,
            rediscover=self._rediscover,
        )
        self._outcomes = Outcomes(config, events=self._events, metrics=metrics)

    # --- caches ---
    def _resources(self) -> dict[str, Resource]:
        """What planning reads, as declared once for every controller (``shared_svc.controllers.services.caches``)."""
        declared = caches.declare(self._config)
        return {
            "clusterpolicies": declared.cluster_policies,
            "gpuclusters": declared.gpu_clusters,
            "services": declared.services,
            "daemonsets": declared.daemonsets,
            "pods": declared.pods,
        }

    def _informer(self, resource: Resource, *, shared: bool = True) -> Cache:
        """The cache of ``resource``: from the shared registry, or (ServiceMonitors, started
        and stopped with discovery) this controller's own."""
        kwargs: dict[str, Any] = {
            "on_change": lambda: self._cache_changed(informer),
            "on_synced": self._metrics.cache_synced.labels(resource.plural).set,
        }
        informer: Cache = (
            self._shared.informer(resource, **kwargs)
            if shared
            else Informer(
                self._api,
                resource,
                backoff_max_seconds=min(
                    caches.CACHE_BACKOFF_MAX_SECONDS, self._config.backoff_max_seconds
                ),
                **kwargs,
            )
        )
        return informer

    def _cache_changed(self, informer: Cache) -> None:
        relists = informer.relists
        if self._relists.get(id(informer)) != relists:
            # A (re-)list, e.g. the watches back after an API-server outage: the failures
            # before it say nothing about now, so retry at once instead of after the backoff.
            self._relists[id(informer)] = relists
            self._retry_now()
            if (
                informer is self._sm_informer
                and not informer.served
                and self.service_monitor_served
            ):
                self._rediscover.set()  # the ServiceMonitor CRD is gone: no need to wait
        self.trigger()

    def trigger(self) -> None:
        self._runtime.enqueue(KEY)

    def _retry_now(self) -> None:
        """A backoff ends early: what failed before may work now (else: a change)."""
        if self._failures:
            log.info("caches re-synced or discovery changed: retrying now")
        if self._failures or self._runtime.queue.processing(KEY):
            self._runtime.retry_now(KEY)  # also a reconcile failing right now
        else:
            self.trigger()

    @property
    def _failures(self) -> int:
        """Reconciles failed in a row (the runtime's retry count)."""
        return self._runtime.queue.num_requeues(KEY)

    @property
    def heartbeat(self) -> float:
        return self._runtime.heartbeat

    @heartbeat.setter
    def heartbeat(self, value: float) -> None:
        self._runtime.heartbeat = value

    def pending(self) -> bool:
        """A reconcile is due (queued, or waiting out the spacing or a backoff)."""
        return self._runtime.pending(KEY)

    # --- the runnable (shared_svc.runtime.manager.Runnable) ---

    name = CONTROLLER
    needs_leader = False  # a standby plans too (warm caches); only the leader writes

    def ready(self) -> bool:
        return self.caches_synced()

    def alive(self) -> bool:
        return self._runtime.alive()

    def leadership_changed(self, leader: bool) -> None:
        if leader:
            self.trigger()

    def caches_synced(self) -> bool:
        informers = list(self._informers.values())
        if self.service_monitor_served:
            if self._sm_informer is None:
                return False
            informers.append(self._sm_informer)
        return bool(informers) and all(i.synced.is_set() for i in informers)

    def cache_status(self) -> dict[str, Any]:
        out = {}
        for name, inf in [
            *self._informers.items(),
            *([("servicemonitors", self._sm_informer)] if self._sm_informer else []),
        ]:
            out[name] = {
                "synced": inf.synced.is_set(),
                "served": inf.served,
                "objects": len(inf.items()),
                "lastError": inf.last_error,
            }
            self._metrics.cache_synced.labels(name).set(1 if inf.synced.is_set() else 0)
        return out

    @property
    def _sm_informer(self) -> Cache | None:
        """The ServiceMonitor cache, while discovery finds the API served."""
        return self.discovery.informer

    @property
    def service_monitor_served(self) -> bool:
        return self.discovery.served

    def runnables(self) -> list[Runnable]:
        """ServiceMonitor discovery, then the controller (Runnables of the service's
        Manager, after the shared registry's caches: on SIGTERM the controller stops
        first, then discovery and its own ServiceMonitor cache, then the shared caches)."""
        return [self.discovery, self]

    # --- the loop ---
    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop``; then the reconcile in flight ends. The caches it reads are the
        Manager's (started before, stopped after), or, made without the runner's registry
        (tests), its own, run beside it. It reconciles once they are synced."""
        tasks = [
            asyncio.ensure_future(
                every(stop, lambda: self._config.resync_seconds, self.trigger, name="resync")
            )
        ]
        if self._owns_caches:
            tasks.append(asyncio.ensure_future(self._shared.run(stop)))
        try:
            await self._runtime.run(stop)  # until stop; then the reconcile in flight ends
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _reconcile_key(self, key: str) -> Result:
        """The runtime's reconcile of the one key."""
        if not self.caches_synced():
            # An informer that syncs (again) triggers; look again soon anyway.
            self.last_reconcile = {"result": "waiting-for-caches", "at": _utc()}
            return Result(None, requeue_after=CACHE_WAIT_SECONDS, forget=False)
        if await self.reconcile_once():
            return Result("success")
        if self.last_reconcile.get("result") == "conflict":
            return Result("conflict", retry=True)  # planned again from the fresh cache
        return Result("error", retry=True)

    def snapshot(self) -> World:
        """What the caches hold now, as the planner reads it (``model.world_of``)."""
        kinds = {plural: resource.kind for plural, resource in self._resources().items()}
        by_kind = {kinds[plural]: cache.items() for plural, cache in self._informers.items()}
        if self._sm_informer and self.service_monitor_served:
            by_kind["ServiceMonitor"] = self._sm_informer.items()
        return world_of(by_kind)

    async def reconcile_once(self) -> bool:
        """One reconcile from the caches; True unless it failed (an error, or a write that
        met a concurrent change: planned again)."""
        rid = uuid.uuid4().hex[:12]
        token = reconcile_id.set(rid)
        started = time.monotonic()
        self.reconciling = True
        result, error, writes = "error", None, 0
        world = self.snapshot()
        try:
            result, writes = await self._plan_and_act(world)
            await self._outcomes.succeeded()
            return True
        except ObjectChanged as exc:
            result, error = "conflict", str(exc)
            self._outcomes.changed(exc)
            return False
        except Exception as exc:
            result, error = "error", f"{type(exc).__name__}: {_short(exc)}"
            if namespace_gone(exc):
                await self._outcomes.namespace_missing(error, world)
            else:
                log.warning("reconcile failed", extra={"error": error})
            return False
        finally:
            self.reconciling = False
            duration = time.monotonic() - started
            self.last_reconcile = self._outcomes.finished(rid, result, error, writes, duration)
            reconcile_id.reset(token)

    async def _plan_and_act(self, world: World) -> tuple[str, int]:
        """Plans; the leader writes, dry-run shows, a standby only plans. Returns the
        result and the number of write requests."""
        settings = self._config.core_settings(service_monitor_served=self.service_monitor_served)
        plan = make_plan(world, settings)
        self.last_plan = plan
        self._record_plan_metrics(plan)
        if not self._is_leader():
            return "standby", 0
        if self._config.dry_run:
            await self._outcomes.show(plan)
            return "dry-run", 0
        writes = await self._execute(plan)
        await self._emit_occurrences(plan)
        return "success", writes

    def _record_plan_metrics(self, plan: Plan) -> None:
        self._outcomes.record_plan_metrics(plan)

    async def _execute(self, plan: Plan) -> int:
        """The plan's writes, each followed by its announcements (``executor.Executor``)."""
        return await self._executor.execute(plan)

    @property
    def contested(self) -> dict[tuple[str, str], Contest]:
        return self._executor.contested

    async def _emit_occurrences(self, plan: Plan) -> None:
        await self._outcomes.occurrences(plan)

    # --- status ---
    def status(self) -> dict[str, Any]:
        return {
            "cachesSynced": self.caches_synced(),
            "caches": self.cache_status(),
            "serviceMonitorServed": self.service_monitor_served,
            "lastReconcile": self.last_reconcile,
            **plan_status(self.last_plan),
            "contested": self._executor.contested_status(),
            "writes": dict(self._writer.writes),
        }


def _short(exc: Exception) -> str:
    if isinstance(exc, ApiException):
        body = exc.body.decode(errors="replace") if isinstance(exc.body, bytes) else exc.body
        return f"{exc.status} {body or exc.reason or ''}"[:300]
    return str(exc)[:300]
