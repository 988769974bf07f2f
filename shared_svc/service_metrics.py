"""Prometheus metrics: controller-runtime's names (``shared_svc.runtime.instrumentation``, one
set for both controllers) plus domain metrics.

One registry per running service (not the global default), so several replicas can run
in one process in tests and each /metrics shows only its own figures.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from shared_svc.runtime.instrumentation import RuntimeMetrics

CONTROLLER = "shared-services"


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
