"""Prometheus metrics of the Services controller (prefix ``shared_svc_``).

Registered on the registry the service runner passes (one per running service, see
``shared_svc.service_metrics``), or on a private one. Its reconcile loop is counted by
the runtime's metrics (``controller_runtime_*{controller="shared-services"}``,
``workqueue_*{name="shared-services"}``, ``shared_svc.runtime.instrumentation``); these
are what is proper to the Services it manages. Every value of a labelled gauge whose
values are known is there from the start (0), so a dashboard or an alert never meets a
missing series (docs/operations.md, "Metrics").
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from shared_svc.reconcile.names import SERVICE_NAMES

CONTROLLER = "shared-services"  # the ``controller`` / ``name`` label of the runtime's metrics
# shared_svc_pending{reason}: the reasons a plan can hold an object back (reconcile.planner,
# reconcile.monitoring).
PENDING_REASONS = (
    "SelectorMigrationPending",
    "ServiceNotAdopted",
    "ServiceMonitorNotAdopted",
    "DuplicateScrapeTarget",
)
# shared_svc_service_selector{dcgm_service,mode}: what a Service's selector selects by. The
# Service's label is dcgm_service, not service: prometheus-operator gives every target of a
# ServiceMonitor a `service` label (the scraped Service's name), which would rename ours to
# exported_service (TARGET_LABELS in shared_svc.service_metrics).
SELECTOR_MODES = ("common", "app")


class ServicesMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
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
            ["dcgm_service", "mode"],
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
        self.conflicting_writer = Counter(
            "shared_svc_conflicting_writer_total",
            "Times another field manager was found fighting over a field.",
            registry=r,
        )
        self.last_success = Gauge(
            "shared_svc_last_successful_reconcile_timestamp_seconds",
            "Unix time of the last successful reconcile.",
            registry=r,
        )
        for reason in PENDING_REASONS:
            self.pending.labels(reason).set(0)
        for service in SERVICE_NAMES:
            for mode in SELECTOR_MODES:
                self.service_selector.labels(service, mode).set(0)
