"""The running service's Prometheus registry and the metrics of no one controller:
controller-runtime's (``shared_svc.runtime.instrumentation``, one set for both
controllers), leader election, Events written (every sender), the Lease's errors and
each cache's sync (set by the cache registry for every cache). Each controller registers
its own metrics on the same registry (``controllers/services/metrics.py``,
``controllers/upgrade/metrics.py``).

One registry per running service (not the global default), so several replicas can run
in one process in tests and each /metrics shows only its own figures.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from shared_svc.runtime.instrumentation import RuntimeMetrics


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # The reconcile loop's metrics: the runtime's, shared by both controllers
        # (controller="shared-services" / "upgrade").
        self.runtime = RuntimeMetrics.of(r)
        self.leader = Gauge(
            "leader_election_master_status", "1 if this replica leads.", ["name"], registry=r
        )
        self.events = Counter(
            "shared_svc_events_total",
            "Events emitted, by type and reason.",
            ["type", "reason"],
            registry=r,
        )
        self.lease_errors = Counter(
            "shared_svc_lease_errors_total",
            "Lease requests (acquire or renew) that failed or timed out.",
            registry=r,
        )
        self.cache_synced = Gauge(
            "shared_svc_cache_synced",
            "1 when the cache of a resource is synced (set by the cache registry whenever it "
            "changes).",
            ["resource"],
            registry=r,
        )

    def cache_synced_changed(self, cache: str, synced: bool) -> None:
        """The cache registry's report (``kube.registry.CacheRegistry``: every cache)."""
        self.cache_synced.labels(cache).set(1 if synced else 0)
