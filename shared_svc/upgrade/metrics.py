"""Prometheus metrics of the driver-upgrade controller (prefix ``shared_svc_upgrade_``).

Registered on the registry the service runner passes (one per running service, see
``shared_svc.metrics``), or on a private one.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PHASES = ("idle", "freeing", "freed", "parked", "waiting", "restoring", "aborting")


class UpgradeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.nodes = Gauge(
            "shared_svc_upgrade_nodes",
            "Upgrading nodes by phase of their consumers.",
            ["phase"],
            registry=r,
        )
        self.pending_pods = Gauge(
            "shared_svc_upgrade_pending_pods",
            "GPU consumers still on nodes being freed.",
            registry=r,
        )
        self.blocked_pods = Gauge(
            "shared_svc_upgrade_blocked_pods",
            "GPU consumers whose eviction is refused past the timeout.",
            registry=r,
        )
        self.reconcile_total = Counter(
            "shared_svc_upgrade_reconcile_total",
            "Node reconciles by result.",
            ["result"],
            registry=r,
        )
        self.reconcile_time = Histogram(
            "shared_svc_upgrade_reconcile_seconds",
            "Time per node reconcile (reads, plan, writes).",
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.evictions = Counter(
            "shared_svc_upgrade_evictions_total",
            "Eviction requests by outcome.",
            ["outcome"],
            registry=r,
        )
        self.deletions = Counter(
            "shared_svc_upgrade_pod_deletions_total",
            "Pods deleted after the eviction timeout.",
            registry=r,
        )
        self.node_patches = Counter(
            "shared_svc_upgrade_node_patches_total",
            "Node label/annotation patches by outcome.",
            ["outcome"],
            registry=r,
        )
        self.restores = Counter(
            "shared_svc_upgrade_restores_total",
            "Nodes restored, by cause (done, aborted).",
            ["cause"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "shared_svc_upgrade_queue_depth", "Nodes waiting for a reconcile.", registry=r
        )
        for phase in PHASES:
            self.nodes.labels(phase=phase).set(0)
