"""The Services controller: cache snapshot -> planner -> writer -> reports.

Level-triggered: an event only says "look again"; every reconcile reads the whole
namespace from the caches. What it reads, declared (``runtime.controller.Controller.watch``):
the caches of ``caches.py`` and the ServiceMonitor cache (``discovery.py``), every event
keyed to the one key, ``services``. The runtime adds the handlers, waits for every cache
to sync, then runs one worker over that key and the resync (``resync_seconds``): events
coalesce into the key (dedup), and reconciles never overlap (in-flight tracking). An
event while idle is served at once; one that arrives during a reconcile, or less than
``coalesce_seconds`` after it, is handed out when that spacing has passed (a delayed
add), so a burst becomes few reconciles. No reconcile runs while a cache it reads is not
synced (it re-lists after a lost watch: the key waits). A failed reconcile is retried
after the runtime's exponential backoff (with jitter), cut short when a cache lists
again (the watches are back after an outage: its objects are handed out again, a
replay) or discovery changes; the runtime beats the heartbeat all along (liveness = not
wedged). Every write also passes the writer's token bucket. Only the leader writes; a
standby keeps its caches warm and plans, so it can take over at once.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException
from prometheus_client import CollectorRegistry

from shared_svc.config import Config
from shared_svc.controllers.services.caches import declare
from shared_svc.controllers.services.discovery import ServiceMonitorDiscovery
from shared_svc.controllers.services.executor import Executor, ObjectChanged
from shared_svc.controllers.services.metrics import CONTROLLER, ServicesMetrics
from shared_svc.controllers.services.outcomes import Outcomes
from shared_svc.controllers.services.status import plan_status
from shared_svc.k8s.objects import K8sObject
from shared_svc.kube.recorder import Emitter, EventPublisher, publisher_of
from shared_svc.kube.registry import AnyCache, CacheRegistry
from shared_svc.kube.writer import Writer, namespace_gone, write_mode
from shared_svc.logs import reconcile_id
from shared_svc.reconcile.model import Plan, World, world_of
from shared_svc.reconcile.planner import plan as make_plan
from shared_svc.runtime.controller import Controller, Options, Result
from shared_svc.runtime.instrumentation import RuntimeMetrics
from shared_svc.runtime.manager import Runnable
from shared_svc.runtime.source import all_synced
from shared_svc.wait.ratelimit import ItemExponentialFailureRateLimiter

log = logging.getLogger("shared_svc.controller")  # the name its log lines have always had

# The runtime beats this often, backoff included (liveness: not wedged; whether
# reconciles succeed is /status and /metrics, not /livez).
HEARTBEAT_SECONDS = 5.0
KEY = "services"  # the one key of the work queue: "look at the namespace again"


def _key(_: K8sObject) -> str:
    return KEY


class ServicesReconciler:
    """Started by the service runner when ``services_controller`` is on; the runtime's
    Controller is built from it (``runtime.controller.controller_for``). Its parts: what it
    reads (``caches``, from the process's registry; ServiceMonitors through
    ``discovery``), the executor of a plan's writes (``executor``), what it says about
    each reconcile (``outcomes``, through the one Event publisher) and the status
    serializer (``status``)."""

    name = CONTROLLER

    def __init__(
        self,
        api: ApiClient,
        config: Config,
        *,
        caches: CacheRegistry,
        recorder: EventPublisher | Emitter,
        writer: Writer,
        is_leader: Callable[[], bool],
        metrics: CollectorRegistry | None = None,
    ) -> None:
        """``recorder``: the service's one Event publisher, or a bare recorder (tests), put
        in a publisher of its own that keeps the meaning of dry-run."""
        self._config = config
        self._events = publisher_of(recorder, dry_run=config.dry_run)
        self._writer = writer
        self.metrics = ServicesMetrics(metrics)
        self._is_leader = is_leader
        # A standby plans too (warm caches); only the leader writes. One worker over the
        # one key; no key is handed out while a cache re-lists: it plans from all of them.
        self.options = Options(
            metrics=RuntimeMetrics.of(self.metrics.registry),
            rate_limiter=ItemExponentialFailureRateLimiter(
                config.backoff_base_seconds, config.backoff_max_seconds, jitter=0.5
            ),
            workers=1,
            cooldown=config.coalesce_seconds,
            beat_seconds=lambda: HEARTBEAT_SECONDS,
            only_when_synced=True,
        )
        # What planning reads, asked for now: the registry's caches start before ``run``.
        self.caches: dict[str, AnyCache] = {
            name: caches.cache(resource) for name, resource in declare(config).items()
        }
        # ServiceMonitor discovery: a Runnable of its own, with the ServiceMonitor cache
        # it switches on while the API is served (a change retries at once: ``setup``).
        self.discovery = ServiceMonitorDiscovery(api, config, caches=caches)
        self.last_plan: Plan | None = None
        self.last_reconcile: dict[str, Any] = {}
        self.reconciling = False
        self._executor = Executor(
            config,
            writer=writer,
            events=self._events,
            metrics=self.metrics,
            rediscover=self.discovery.wake,  # a 404 on the ServiceMonitor path: look now
        )
        self._outcomes = Outcomes(config, events=self._events, metrics=self.metrics)

    # --- how the runtime runs it (``runtime.controller.Reconciler``) ---

    def setup(self, controller: Controller[str]) -> None:
        """Every cache it reads, each event keyed to the one key; the resync; a change of
        discovery ends a backoff (what failed before may work now)."""
        for cache in self._sources():
            controller.watch(cache, _key)
        controller.resync(lambda: self._config.resync_seconds, lambda: (KEY,))
        self.discovery.on_change = lambda: controller.retry_now(KEY)

    def parts(self) -> list[Runnable]:
        """ServiceMonitor discovery and the ServiceMonitor cache it switches (Runnables of
        the service's Manager, after the registry's caches, before the controller: on
        SIGTERM the controller stops first, then the ServiceMonitor cache and discovery,
        then the shared caches)."""
        return [self.discovery, self.discovery.cache_runnable]

    def ready(self) -> bool:
        """Planned once (and, by the runtime, synced): the admission guard's webhook,
        served by every replica, then knows who needs each Service (``needed_by``) before
        the pod takes its calls."""
        return self.last_plan is not None

    def caches_synced(self) -> bool:
        """Every cache it reads is synced (the ServiceMonitors' while their API is served;
        else it holds them as not served)."""
        return all_synced(self._sources())

    def _sources(self) -> tuple[AnyCache, ...]:
        return (*self.caches.values(), self.discovery.cache)

    @property
    def service_monitor_served(self) -> bool:
        return self.discovery.served

    def _read(self) -> Sequence[tuple[str, AnyCache]]:
        """The caches planning reads now: the ServiceMonitors' while served."""
        sm = [("servicemonitors", self.discovery.cache)] if self.service_monitor_served else []
        return [*self.caches.items(), *sm]

    def cache_status(self) -> dict[str, Any]:
        return {
            name: {
                "synced": cache.synced.is_set(),
                "served": cache.served,
                "objects": len(cache.items()),
                "lastError": cache.last_error,
            }
            for name, cache in self._read()
        }

    async def reconcile(self, key: str) -> Result:
        """One reconcile of the namespace from the caches (the one key): a success looks
        again when a rule that waits is due (a drained ServiceMonitor's deletion); a write
        that met a concurrent change is a conflict, planned again from the fresh cache
        after the backoff; any other failure an error."""
        result = await self._reconcile_once()
        if result == "conflict":
            return Result("conflict", retry=True)
        if result == "error":
            return Result("error", retry=True)
        wait = self.last_plan.recheck_after if self.last_plan is not None else None
        return Result("success", requeue_after=wait)

    def snapshot(self) -> World:
        """What the caches hold now, as the planner reads it (``model.world_of``)."""
        return world_of(
            {cache.resource.kind: cache.items() for _, cache in self._read()}, now=time.time()
        )

    async def _reconcile_once(self) -> str:
        """One reconcile from the caches; what became of it (``lastReconcile.result``:
        success, standby, dry-run; conflict: a write met a concurrent change; error)."""
        rid = uuid.uuid4().hex[:12]
        token = reconcile_id.set(rid)
        started = time.monotonic()
        self.reconciling = True
        result, error, writes = "error", None, 0
        world = self.snapshot()
        try:
            result, writes = await self._plan_and_act(world)
            await self._outcomes.succeeded()
        except ObjectChanged as exc:
            result, error = "conflict", str(exc)
            self._outcomes.changed(exc)
        except Exception as exc:
            result, error = "error", f"{type(exc).__name__}: {_short(exc)}"
            if namespace_gone(exc):
                await self._outcomes.namespace_missing(error, world)
            else:
                log.warning("reconcile failed", extra={"error": error})
        finally:
            self.reconciling = False
            duration = time.monotonic() - started
            self.last_reconcile = self._outcomes.finished(rid, result, error, writes, duration)
            reconcile_id.reset(token)
        return result

    async def _plan_and_act(self, world: World) -> tuple[str, int]:
        """Plans; the leader writes, dry-run shows, a standby only plans. Returns the
        result and the number of write requests."""
        settings = self._config.core_settings(service_monitor_served=self.service_monitor_served)
        plan = make_plan(world, settings)
        self.last_plan = plan
        self._outcomes.record_plan_metrics(plan)
        mode = write_mode(leader=self._is_leader(), dry_run=self._config.dry_run)
        if mode == "standby":
            return "standby", 0
        if mode == "dry-run":
            await self._outcomes.show(plan)
            return "dry-run", 0
        # The plan's writes, each followed by its announcements (``executor.Executor``).
        writes = await self._executor.execute(plan)
        await self._outcomes.occurrences(plan)
        return "success", writes

    # --- what the admission guard reads (``admission.guard.AdmissionGuard``) ---

    def cached_objects(self) -> list[Mapping[str, Any]] | None:
        """Our Services and ServiceMonitors as cached (None until every cache synced)."""
        if not self.caches_synced():
            return None
        world = self.snapshot()
        return [*world.services, *world.service_monitors]

    def needed_by(self) -> dict[tuple[str, str], tuple[str, ...]] | None:
        """Who needs each managed object, from the last plan (None before the first)."""
        plan = self.last_plan
        if plan is None:
            return None
        return {(s.kind, s.name): tuple(s.needed_by) for s in plan.status}

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
