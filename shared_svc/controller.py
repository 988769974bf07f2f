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
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from shared_svc.admission.rules import name_writers
from shared_svc.config import Config
from shared_svc.k8s.events import Report
from shared_svc.k8s.managed_fields import managers_of_field
from shared_svc.kube.cache import Informer, Informers, Resource, describe_error
from shared_svc.kube.events import Emitter, EventPublisher
from shared_svc.kube.resources import CLUSTER_POLICIES, SERVICE_MONITORS, daemonsets
from shared_svc.kube.writer import Writer, concurrent_change, namespace_gone, raw_request
from shared_svc.logs import reconcile_id
from shared_svc.metrics import CONTROLLER, Metrics
from shared_svc.reconcile.failures import namespace_missing_reports
from shared_svc.reconcile.fight import FightHistory, fight_report, fight_verdict, occurrences
from shared_svc.reconcile.model import Action, Plan, World
from shared_svc.reconcile.planner import plan as make_plan
from shared_svc.reconcile.selectors import pod_fields
from shared_svc.runtime.ratelimit import ItemExponentialFailureRateLimiter
from shared_svc.runtime.runnable import Controller, Periodic, Result, Runnable, every

log = logging.getLogger(__name__)

SERVICE_MONITOR_GV = SERVICE_MONITORS.group_version
# The runtime beats this often, backoff included (liveness: not wedged; whether
# reconciles succeed is /status and /metrics, not /livez).
HEARTBEAT_SECONDS = 5.0
KEY = "services"  # the one key of the work queue: "look at the namespace again"
# Event publisher scopes (shared_svc.kube.events.EventPublisher)
OCCURRENCES_SCOPE = f"{CONTROLLER}/occurrences"
NAMESPACE_SCOPE = f"{CONTROLLER}/operator-namespace-missing"
DRY_RUN_SCOPE = f"{CONTROLLER}/dry-run-announcements"
# A write meeting a concurrent change of the same object this many reconciles in a row is
# no longer a race (said at INFO) but a problem (a WARNING).
CHANGED_WARN_AFTER = 5
CACHE_WAIT_SECONDS = 0.5  # caches not synced yet: look again this soon


class ObjectChanged(Exception):
    """A write met a concurrent change of its object (``kube.writer.concurrent_change``)."""

    def __init__(self, kind: str, name: str, cause: BaseException) -> None:
        self.object = f"{kind}/{name}"
        self.error = describe_error(cause)
        super().__init__(f"{self.object}: {self.error}")


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
        # Caches shared with the upgrade controller when the runner passes its registry.
        self._shared = informers or Informers(api)
        self._config = config
        # The one Event publisher (the service's, shared with the upgrade controller and the
        # guard monitor); a bare recorder is wrapped in one of our own.
        self._events = (
            recorder
            if isinstance(recorder, EventPublisher)
            else EventPublisher(
                recorder,
                dry_run=config.dry_run,
                on_written=lambda r: metrics.events.labels(r.type, r.reason).inc(),
            )
        )
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
        self._rediscover = asyncio.Event()  # a 404 on the ServiceMonitor path: look now
        # ServiceMonitor discovery: a Runnable of its own, every discovery_seconds or at once
        # when a write met "404 page not found" on the ServiceMonitor path.
        self.discovery = Periodic(
            "servicemonitor-discovery",
            self._discover,
            lambda: self._config.discovery_seconds,
            wake=self._rediscover,
            on_stop=self._stop_service_monitors,
        )
        self._relists: dict[int, int] = {}  # id(informer) -> relists seen
        self._informers: dict[str, Informer] = {}
        self._sm_informer: Informer | None = None
        self._sm_task: asyncio.Task[None] | None = None
        self._sm_stop = asyncio.Event()
        self.service_monitor_served = False
        self.last_plan: Plan | None = None
        self.last_reconcile: dict[str, Any] = {}
        self.reconciling = False
        # ConflictingWriter: what we applied last, and how often the same drift came back.
        self._applied: dict[tuple[str, str], dict[str, Any]] = {}
        # (kind, name, field) -> monotonic times we re-applied an unchanged intent to it
        self._corrections = FightHistory()
        self.contested: dict[tuple[str, str], dict[str, Any]] = {}
        self._pending_reasons: set[str] = set()  # every pending reason ever reported (gauge labels)
        self._changed: Counter[str] = (
            Counter()
        )  # object -> reconciles in a row its write met a change
        self._namespace_said = False  # the missing operator namespace was logged in this episode

    # --- caches ---
    def _resources(self) -> dict[str, Resource]:
        ns = self._config.namespace
        return {
            "clusterpolicies": CLUSTER_POLICIES,
            "gpuclusters": Resource(
                "nvidia.com",
                "v1alpha1",
                "gpuclusters",
                "GPUCluster",
                crd_name="gpuclusters.nvidia.com",
            ),
            "services": Resource("", "v1", "services", "Service", namespace=ns),
            # With the upgrade controller on, its cache of all namespaces' DaemonSets is
            # shared (planning reads only those of the namespace); else only the namespace.
            "daemonsets": daemonsets(None if self._config.upgrade_controller else ns),
            # Only the fields planning reads of a pod are kept (the rest is most of its bytes).
            "pods": Resource("", "v1", "pods", "Pod", namespace=ns, project=pod_fields),
        }

    def _informer(self, resource: Resource, *, shared: bool = True) -> Informer:
        """The cache of ``resource``: from the shared registry, or (ServiceMonitors, started
        and stopped with discovery) this controller's own."""
        kwargs: dict[str, Any] = {
            "on_change": lambda: self._cache_changed(informer),
            "backoff_max_seconds": min(30.0, self._config.backoff_max_seconds),
            "on_synced": self._metrics.cache_synced.labels(resource.plural).set,
        }
        informer: Informer = (
            self._shared.informer(resource, **kwargs)
            if shared
            else Informer(self._api, resource, **kwargs)
        )
        return informer

    def _cache_changed(self, informer: Informer) -> None:
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

    # --- the runnable (shared_svc.runtime.runnable.Runnable) ---

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

    async def _discover_service_monitor(self) -> bool:
        try:
            res = await raw_request(self._api, "GET", SERVICE_MONITOR_GV)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return any(r.get("name") == "servicemonitors" for r in res.get("resources", []))

    async def _discover(self) -> None:
        """One look whether ServiceMonitor is served (Prometheus Operator installed later or
        removed): its cache is started or stopped with it. Run by ``discovery``."""
        try:
            served = await self._discover_service_monitor()
        except Exception as exc:
            log.warning("discovery failed", extra={"error": str(exc)})
            served = self.service_monitor_served  # unknown: keep what we knew
        if served and self._sm_informer is None:
            self._sm_stop = asyncio.Event()
            self._sm_informer = self._informer(
                Resource(
                    "monitoring.coreos.com",
                    "v1",
                    "servicemonitors",
                    "ServiceMonitor",
                    namespace=self._config.namespace,
                    crd_name="servicemonitors.monitoring.coreos.com",
                ),
                shared=False,
            )
            self._sm_task = asyncio.ensure_future(self._sm_informer.run(self._sm_stop))
        elif not served and self._sm_informer is not None:
            await self._stop_service_monitors()
        if served != self.service_monitor_served:
            log.info("ServiceMonitor API served" if served else "ServiceMonitor API not served")
            self.service_monitor_served = served
            self._retry_now()  # what failed before may work now

    async def _stop_service_monitors(self) -> None:
        self._sm_stop.set()
        if self._sm_task:
            await asyncio.gather(self._sm_task, return_exceptions=True)
        self._sm_informer, self._sm_task = None, None

    def runnables(self) -> list[Runnable]:
        """ServiceMonitor discovery, then the controller (Runnables of the service's
        Manager: on SIGTERM the controller stops first, then discovery and its cache)."""
        return [self.discovery, self]

    # --- the loop ---
    async def run(self, stop: asyncio.Event) -> None:
        self._informers = {name: self._informer(res) for name, res in self._resources().items()}
        tasks = [asyncio.ensure_future(self._shared.run(i, stop)) for i in self._informers.values()]
        tasks.append(
            asyncio.ensure_future(
                every(stop, lambda: self._config.resync_seconds, self.trigger, name="resync")
            )
        )
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
        i = self._informers
        return World(
            cluster_policies=i["clusterpolicies"].items(),
            gpu_clusters=i["gpuclusters"].items(),
            daemonsets=i["daemonsets"].items(),
            pods=i["pods"].items(),
            services=i["services"].items(),
            service_monitors=self._sm_informer.items()
            if self._sm_informer and self.service_monitor_served
            else (),
        )

    async def reconcile_once(self) -> bool:
        rid = uuid.uuid4().hex[:12]
        token = reconcile_id.set(rid)
        started = time.monotonic()
        self.reconciling = True
        result, error, writes = "success", None, 0
        world = self.snapshot()
        try:
            plan = make_plan(
                world,
                self._config.core_settings(service_monitor_served=self.service_monitor_served),
            )
            self.last_plan = plan
            self._record_plan_metrics(plan)
            leader = self._is_leader()
            if not leader:
                result = "standby"
            elif self._config.dry_run:
                result = "dry-run"
                await self._emit_occurrences(plan)  # logged by the publisher, not written
                for report in plan.reports:
                    if report.after_write is not None:
                        await self._events.once(DRY_RUN_SCOPE, report)
                for a in plan.writes:
                    log.info(
                        "dry-run: would write",
                        extra={
                            "action": a.action,
                            "kind": a.kind,
                            "object": a.name,
                            "reason": a.reason,
                        },
                    )
            else:
                writes = await self._execute(plan, world)
                await self._emit_occurrences(plan)
            await self._events.level(NAMESPACE_SCOPE, ())  # the episode is over
            self._changed.clear()
            self._namespace_said = False
            return True
        except ObjectChanged as exc:
            result, error = "conflict", str(exc)
            self._say_changed(exc)
            return False
        except Exception as exc:
            result, error = "error", f"{type(exc).__name__}: {_short(exc)}"
            if namespace_gone(exc):
                self._say_namespace_missing(error)
                await self._report_namespace_missing(world)
            else:
                log.warning("reconcile failed", extra={"error": error})
            return False
        finally:
            duration = time.monotonic() - started
            self.reconciling = False
            if result not in ("error", "conflict"):
                self._metrics.last_success.set(time.time())
            self.last_reconcile = {
                "id": rid,
                "at": _utc(),
                "result": result,
                "error": error,
                "writes": writes,
                "durationSeconds": round(duration, 4),
            }
            if result != "standby":
                log.info(
                    "reconciled",
                    extra={
                        "result": result,
                        "writes": writes,
                        "durationSeconds": round(duration, 4),
                    },
                )
            reconcile_id.reset(token)

    def _say_changed(self, exc: ObjectChanged) -> None:
        """One short line: INFO while it is a race, WARNING once the same object keeps
        meeting changes (``CHANGED_WARN_AFTER`` reconciles in a row)."""
        self._changed[exc.object] += 1
        times = self._changed[exc.object]
        level = logging.WARNING if times >= CHANGED_WARN_AFTER else logging.INFO
        log.log(
            level,
            "%s changed meanwhile (%s): planning again from the cache",
            exc.object,
            exc.error.split(":", 1)[0],
            extra={"object": exc.object, "times": times},
        )

    def _say_namespace_missing(self, error: str) -> None:
        """One WARNING per episode (until a reconcile succeeds); the retries at DEBUG."""
        level = logging.DEBUG if self._namespace_said else logging.WARNING
        log.log(
            level,
            "operator namespace %s is missing or terminating: retrying with backoff",
            self._config.namespace,
            extra={"error": error},
        )
        self._namespace_said = True

    async def _report_namespace_missing(self, world: World) -> None:
        """Once per episode (until a reconcile succeeds again): the retries stay in the logs."""
        reports = namespace_missing_reports(world, self._config.namespace)
        await self._events.level(NAMESPACE_SCOPE, reports)

    def _record_plan_metrics(self, plan: Plan) -> None:
        m = self._metrics
        for kind in ("Service", "ServiceMonitor"):
            m.managed_objects.labels(kind).set(
                sum(1 for o in plan.objects if o.get("kind") == kind)
            )
        m.conflicts.set(len(plan.conflicts))
        reasons = Counter(p.reason for p in plan.pending)
        # Reasons that went away are set to 0, not left at their last value.
        self._pending_reasons |= set(reasons)
        for reason in self._pending_reasons:
            m.pending.labels(reason).set(reasons[reason])
        m.spec_errors.set(len(plan.errors))

    async def _execute(self, plan: Plan, world: World) -> int:
        """Runs the plan's actions in order; stops at the first failure (the order keeps coverage)."""
        live = {
            (o["kind"], o["metadata"]["name"]): o
            for o in (*world.services, *world.service_monitors)
        }
        ns = self._config.namespace
        writes = 0
        announcements: dict[tuple[str, str], list[Report]] = {}
        for report in plan.reports:
            if report.after_write is not None:
                announcements.setdefault(report.after_write, []).append(report)
        now = time.monotonic()
        for action in plan.actions:
            key = (action.kind, action.name)
            if action.action == "unchanged":
                continue
            if action.action not in ("create", "update", "delete"):
                continue
            contest = self.contested.get(key)
            if contest and contest["until"] > now:
                continue  # reported as ConflictingWriter: leave it alone for a while
            if contest:
                del self.contested[key]
            if action.action == "update" and await self._is_fight(action, live.get(key)):
                continue
            if not self._is_leader():
                raise RuntimeError("lost leadership during reconcile")
            try:
                if action.action == "delete":
                    await self._writer.delete(
                        action.kind, ns, action.name, dict(action.preconditions or {})
                    )
                    self._metrics.writes.labels("delete", action.kind).inc()
                    writes += 1
                    self._applied.pop(key, None)
                else:
                    if action.json_patch:
                        await self._writer.json_patch(
                            action.kind, ns, action.name, list(action.json_patch)
                        )
                        self._metrics.writes.labels("patch", action.kind).inc()
                        writes += 1
                    if action.apply is not None:
                        await self._writer.apply(action.apply)
                        self._metrics.writes.labels("apply", action.kind).inc()
                        writes += 1
                        self._applied[key] = action.apply
            except ApiException as exc:
                if concurrent_change(exc):
                    raise ObjectChanged(action.kind, action.name, exc) from exc
                if exc.status == 404 and action.kind == "ServiceMonitor":
                    # "404 page not found": the ServiceMonitor API may be gone. Look now,
                    # not at the next discovery pass.
                    self._rediscover.set()
                raise
            log.info(
                "wrote",
                extra={
                    "action": action.action,
                    "kind": action.kind,
                    "object": action.name,
                    "reason": action.reason,
                },
            )
            # Announced right after its own write: a later failure must not lose it (the
            # next plan will not repeat a write that already happened).
            for report in announcements.pop(key, ()):
                await self._emit(report)
        return writes

    async def _is_fight(self, action: Action, live: dict[str, Any] | None) -> bool:
        """True when another writer keeps undoing the same intent: report once, back off.

        A fight is the same intent re-applied to the same field ``threshold`` times within
        the window. Only a change of our own intent resets the count: a reconcile that finds
        the object right between two strikes of the other writer proves nothing.
        """
        key = (action.kind, action.name)
        history, verdict = fight_verdict(
            self._corrections,
            action.kind,
            action.name,
            apply_body=action.apply,
            last_applied=self._applied.get(key),
            live_present=live is not None,
            changed_fields=action.changed_fields,
            now=time.monotonic(),
            threshold=self._config.conflicting_writer_threshold,
            window=self._config.conflicting_writer_window_seconds,
        )
        self._corrections = history
        if verdict is None or live is None:
            return False
        field = verdict.field
        owners = managers_of_field(live, field)
        writers = name_writers(live, owners)  # e.g. "gpu-operator / Update"
        managers = owners or [w.split(" / ")[0] for w in writers]
        until = time.monotonic() + self._config.conflicting_writer_backoff_seconds
        self.contested[key] = {
            "object": f"{action.kind}/{action.name}",
            "field": field,
            "managers": managers,
            "writers": writers,
            "until": until,
            "since": _utc(),
        }
        self._metrics.conflicting_writer.inc()
        await self._emit(
            fight_report(verdict, live, writers, self._config.conflicting_writer_backoff_seconds)
        )
        return True

    async def _emit_occurrences(self, plan: Plan) -> None:
        """The plan's occurrences (conflicts, pending, errors): each sent once while it
        lasts; one whose Event could not be written is retried next reconcile
        (``reconcile.fight.warnings_to_emit`` / ``next_active``, in the publisher)."""
        await self._events.level(OCCURRENCES_SCOPE, occurrences(plan.reports))

    async def _emit(self, report: Report) -> bool:
        return await self._events.emit(report)

    # --- status ---
    def status(self) -> dict[str, Any]:
        plan = self.last_plan
        actions = {(a.kind, a.name): a for a in plan.actions} if plan else {}
        objects = []
        if plan:
            for s in plan.status:
                entry = {
                    "kind": s.kind,
                    "name": s.name,
                    "neededBy": list(s.needed_by),
                    "selector": s.selector,
                    "heldBack": s.held_back,
                    "gates": [
                        {"stack": g.stack, "open": g.open, "failing": list(g.failing)}
                        for g in s.gates
                    ],
                }
                act = actions.get((s.kind, s.name))
                if act:
                    entry["lastAction"] = {"action": act.action, "reason": act.reason}
                objects.append(entry)
        now = time.monotonic()
        return {
            "cachesSynced": self.caches_synced(),
            "caches": self.cache_status(),
            "serviceMonitorServed": self.service_monitor_served,
            "lastReconcile": self.last_reconcile,
            "objects": objects,
            "conflicts": [asdict(c) for c in plan.conflicts] if plan else [],
            "pending": [asdict(p) for p in plan.pending] if plan else [],
            "errors": [asdict(e) for e in plan.errors] if plan else [],
            "notes": list(plan.notes) if plan else [],
            "contested": [
                {
                    **{k: v for k, v in c.items() if k != "until"},
                    "secondsLeft": max(0, round(c["until"] - now)),
                }
                for c in self.contested.values()
            ],
            "writes": dict(self._writer.writes),
        }


def _short(exc: Exception) -> str:
    if isinstance(exc, ApiException):
        body = exc.body.decode(errors="replace") if isinstance(exc.body, bytes) else exc.body
        return f"{exc.status} {body or exc.reason or ''}"[:300]
    return str(exc)[:300]
