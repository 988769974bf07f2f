"""Prometheus metrics of the driver-upgrade controller (prefix ``shared_svc_upgrade_``).

Registered on the registry the service runner passes (one per running service, see
``shared_svc.service_metrics``), or on a private one. Its reconcile loop is counted by the
runtime's metrics (``controller_runtime_*{controller="upgrade"}``, ``workqueue_*{name="upgrade"}``,
``shared_svc.runtime.instrumentation``); these are what is proper to upgrades.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

PHASES = (
    "idle",
    "freeing",
    "freed",
    "parked",
    "waiting",
    "restoring",
    "aborting",
    "restart-only",
)


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
        for phase in PHASES:
            self.nodes.labels(phase=phase).set(0)
