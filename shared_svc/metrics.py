"""Prometheus metrics: controller-runtime's names (``shared_svc.runtime.metrics``, one
set for both controllers) plus domain metrics.

One registry per running service (not the global default), so several replicas can run
in one process in tests and each /metrics shows only its own figures. Every value of a
labelled gauge whose values are known is there from the start (0), so a dashboard or an
alert never meets a missing series (docs/operations.md, "Metrics").
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from shared_svc.reconcile.names import SERVICE_NAMES
from shared_svc.runtime.metrics import RuntimeMetrics

CONTROLLER = "shared-services"
# shared_svc_pending{reason}: the reasons a plan can hold an object back (reconcile.planner,
# reconcile.monitoring).
PENDING_REASONS = (
    "SelectorMigrationPending",
    "ServiceNotAdopted",
    "ServiceMonitorNotAdopted",
    "DuplicateScrapeTarget",
)
# shared_svc_service_selector{service,mode}: what a Service's selector selects by.
SELECTOR_MODES = ("common", "app")
# shared_svc_admission_guard{mode}: admission.guard.guard_mode's values.
GUARD_MODES = ("policy", "webhook", "none", "unknown")
# shared_svc_admission_webhooks{served}: the guard's webhooks by what their probe found.
WEBHOOK_SERVED = ("true", "false", "unprobed")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # The reconcile loop's metrics: the runtime's, shared with the upgrade controller
        # (controller="shared-services" / "upgrade").
        self.runtime = RuntimeMetrics.of(r)
        self.leader = Gauge(
            "leader_election_master_status", "1 if this replica leads.", ["name"], registry=r
        )
        self.managed_objects = Gauge(
            "shared_svc_managed_objects", "Objects managed, by kind.", ["kind"], registry=r
        )
        self.conflicts = Gauge(
            "shared_svc_config_conflicts", "Exporter config conflicts in the last plan.", registry=r
        )
        self.pending = Gauge(
            "shared_svc_pending",
            "Pending items in the last plan, by reason.",
            ["reason"],
            registry=r,
        )
        self.service_selector = Gauge(
            "shared_svc_service_selector",
            "1 for what each DCGM Service's selector selects by: the common label or the "
            "stack's app label (0 and 0: the Service is not managed).",
            ["service", "mode"],
            registry=r,
        )
        self.spec_errors = Gauge(
            "shared_svc_spec_errors", "CRs whose spec cannot be understood.", registry=r
        )
        self.writes = Counter(
            "shared_svc_writes_total",
            "Write requests sent, by verb and kind.",
            ["verb", "kind"],
            registry=r,
        )
        self.events = Counter(
            "shared_svc_events_total",
            "Events emitted, by type and reason.",
            ["type", "reason"],
            registry=r,
        )
        self.conflicting_writer = Counter(
            "shared_svc_conflicting_writer_total",
            "Times another field manager was found fighting over a field.",
            registry=r,
        )
        self.lease_errors = Counter(
            "shared_svc_lease_errors_total",
            "Lease requests (acquire or renew) that failed or timed out.",
            registry=r,
        )
        self.cache_synced = Gauge(
            "shared_svc_cache_synced",
            "1 when the cache of a resource is synced (set by the cache when it changes).",
            ["resource"],
            registry=r,
        )
        self.last_success = Gauge(
            "shared_svc_last_successful_reconcile_timestamp_seconds",
            "Unix time of the last successful reconcile.",
            registry=r,
        )
        self._admission(r)
        self._zero()

    def _admission(self, r: CollectorRegistry) -> None:
        """The guard monitor's (``admission.guard``), set by :meth:`publish_guard`."""
        self.guard_mode = Gauge(
            "shared_svc_admission_guard",
            "1 for the admission guard found active: policy, webhook, none or unknown.",
            ["mode"],
            registry=r,
        )
        self.guard_webhooks = Gauge(
            "shared_svc_admission_webhooks",
            "The admission guard's webhooks by their probe: served true, false (configured "
            "but answering no AdmissionReview) or unprobed (behind the chart's Service).",
            ["served"],
            registry=r,
        )
        self.unguarded_writers = Gauge(
            "shared_svc_admission_unguarded_writers",
            "Objects of shared-svc that gpu-operator's field manager writes while no "
            "admission guard is active (the AdmissionGuardMissing Warning).",
            registry=r,
        )

    def _zero(self) -> None:
        """Every known value of the labelled gauges, at 0."""
        for reason in PENDING_REASONS:
            self.pending.labels(reason).set(0)
        for service in SERVICE_NAMES:
            for mode in SELECTOR_MODES:
                self.service_selector.labels(service, mode).set(0)
        for mode in GUARD_MODES:
            self.guard_mode.labels(mode).set(0)
        for served in WEBHOOK_SERVED:
            self.guard_webhooks.labels(served).set(0)

    def publish_guard(
        self, mode: str, webhooks: list[dict[str, Any]], unguarded_writers: int
    ) -> None:
        """The guard monitor's findings after each check (``admission.guard.GuardMonitor``)."""
        for m in GUARD_MODES:
            self.guard_mode.labels(m).set(1 if m == mode else 0)
        served = {True: "true", False: "false", None: "unprobed"}
        counts = {v: 0 for v in WEBHOOK_SERVED}
        for hook in webhooks:
            counts[served[hook.get("served")]] += 1
        for value, n in counts.items():
            self.guard_webhooks.labels(value).set(n)
        self.unguarded_writers.set(unguarded_writers)
