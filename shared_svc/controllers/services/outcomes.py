"""What the Services controller says about each reconcile: the plan's metrics, its
occurrences as Events (the one publisher), dry-run's lines, and failures in few lines:
a write that met a concurrent change at INFO (a WARNING only once the same object keeps
meeting changes), the missing operator namespace once per episode."""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections import Counter
from typing import Any

from shared_svc.config import Config
from shared_svc.controllers.services.executor import ObjectChanged
from shared_svc.controllers.services.metrics import (
    CONTROLLER,
    PENDING_REASONS,
    SELECTOR_MODES,
    ServicesMetrics,
)
from shared_svc.kube.recorder import EventPublisher
from shared_svc.reconcile.failures import namespace_missing_reports
from shared_svc.reconcile.fight import occurrences
from shared_svc.reconcile.model import Plan, World
from shared_svc.reconcile.names import COMMON_LABEL, SERVICE_NAMES

log = logging.getLogger("shared_svc.controller")

# Event publisher scopes (shared_svc.kube.recorder.EventPublisher)
OCCURRENCES_SCOPE = f"{CONTROLLER}/occurrences"
NAMESPACE_SCOPE = f"{CONTROLLER}/operator-namespace-missing"
DRY_RUN_SCOPE = f"{CONTROLLER}/dry-run-announcements"
COMMON_LABELS = frozenset(COMMON_LABEL.values())
# A write meeting a concurrent change of the same object this many reconciles in a row is
# no longer a race (said at INFO) but a problem (a WARNING).
CHANGED_WARN_AFTER = 5


class Outcomes:
    def __init__(self, config: Config, *, events: EventPublisher, metrics: ServicesMetrics) -> None:
        self._config = config
        self._events = events
        self._metrics = metrics
        # every pending reason reported (gauge labels), the known ones from the start
        self._pending_reasons: set[str] = set(PENDING_REASONS)
        self._changed: Counter[str] = Counter()  # object -> reconciles in a row it changed
        self._namespace_said = False  # the missing operator namespace was logged (episode)

    def record_plan_metrics(self, plan: Plan) -> None:
        m = self._metrics
        for kind in ("Service", "ServiceMonitor"):
            m.managed_objects.labels(kind).set(
                sum(1 for o in plan.objects if o.get("kind") == kind)
            )
        modes = {
            o.name: "common" if set(o.selector or ()) & COMMON_LABELS else "app"
            for o in plan.status
            if o.kind == "Service"
        }
        for service in SERVICE_NAMES:
            for mode in SELECTOR_MODES:
                m.service_selector.labels(service, mode).set(1 if modes.get(service) == mode else 0)
        m.conflicts.set(len(plan.conflicts))
        reasons = Counter(p.reason for p in plan.pending)
        # Reasons that went away are set to 0, not left at their last value.
        self._pending_reasons |= set(reasons)
        for reason in self._pending_reasons:
            m.pending.labels(reason).set(reasons[reason])
        m.spec_errors.set(len(plan.errors))

    async def occurrences(self, plan: Plan) -> None:
        """The plan's occurrences (conflicts, pending, errors): each sent once while it
        lasts; one whose Event could not be written is retried next reconcile
        (``reconcile.fight.warnings_to_emit`` / ``next_active``, in the publisher)."""
        await self._events.level(OCCURRENCES_SCOPE, occurrences(plan.reports))

    async def show(self, plan: Plan) -> None:
        """Dry-run: each write logged; each Event logged once by the publisher, not sent."""
        await self.occurrences(plan)
        for a in plan.writes:
            for report in a.announces:
                await self._events.once(DRY_RUN_SCOPE, report)
        for a in plan.writes:
            log.info(
                "dry-run: would write",
                extra={"action": a.action, "kind": a.kind, "object": a.name, "reason": a.reason},
            )

    async def succeeded(self) -> None:
        """An episode of failures is over."""
        await self._events.level(NAMESPACE_SCOPE, ())
        self._changed.clear()
        self._namespace_said = False

    def changed(self, exc: ObjectChanged) -> None:
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

    async def namespace_missing(self, error: str, world: World) -> None:
        """One WARNING and one set of Events per episode (until a reconcile succeeds); the
        retries at DEBUG."""
        level = logging.DEBUG if self._namespace_said else logging.WARNING
        log.log(
            level,
            "operator namespace %s is missing or terminating: retrying with backoff",
            self._config.namespace,
            extra={"error": error},
        )
        self._namespace_said = True
        reports = namespace_missing_reports(world, self._config.namespace)
        await self._events.level(NAMESPACE_SCOPE, reports)

    def finished(
        self, rid: str, result: str, error: str | None, writes: int, duration: float
    ) -> dict[str, Any]:
        """The reconcile's ``lastReconcile`` (for /status), logged unless a standby's."""
        # A standby's plan writes nothing: it is no reconcile of the Services, and it
        # must not make a stuck leader's age look fresh (the dashboard and the alert read
        # the leader's gauge, and a standby's stays where its own leadership left it).
        if result not in ("error", "conflict", "standby"):
            self._metrics.last_success.set(time.time())
        if result != "standby":
            log.info(
                "reconciled",
                extra={"result": result, "writes": writes, "durationSeconds": round(duration, 4)},
            )
        return {
            "id": rid,
            "at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "result": result,
            "error": error,
            "writes": writes,
            "durationSeconds": round(duration, 4),
        }
