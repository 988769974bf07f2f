"""Prometheus metrics of the driver-upgrade controller (prefix ``shared_svc_upgrade_``).

Registered on the registry the service runner passes (one per running service, see
``shared_svc.service_metrics``), or on a private one. Its reconcile loop is counted by the
runtime's metrics (``controller_runtime_*{controller="upgrade"}``, ``workqueue_*{name="upgrade"}``,
``shared_svc.runtime.instrumentation``); these are what is proper to upgrades. The gauges are set
on every beat of the controller (:meth:`UpgradeMetrics.publish`) from the counts of the
node statuses, kept as each changes (:meth:`UpgradeMetrics.changed`);
every value of a labelled gauge is there from the start (0), so a dashboard or an alert
never meets a missing series.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterable
from typing import TYPE_CHECKING, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge

from shared_svc.upgrade import record, states
from shared_svc.upgrade.gate import GateState, GateVerdicts

if TYPE_CHECKING:
    from shared_svc.upgrade.node_plan import NodeStatus

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
# The values of the upgrade-state label, as ``shared_svc_upgrade_nodes_by_state{state}``:
# libs' states; "unknown" is libs' own UpgradeStateUnknown (the empty value), "other" a
# value this version does not know, "none" a parked node without the label.
NODE_STATES = (
    *sorted(s for s in states.ALL_STATES if s),
    "unknown",
    "other",
    "none",
)
# The gate's verdicts (``shared_svc.upgrade.gate.GateState``)
GATE_STATES: tuple[str, ...] = get_args(GateState)


def state_value(state: str | None) -> str:
    """The ``state`` label of a node's upgrade-state label value."""
    if state is None:
        return "none"
    if state == "":
        return "unknown"
    return state if state in states.ALL_STATES else "other"


def stalled(statuses: Iterable[NodeStatus], now: float, timeout: float) -> int:
    """Nodes being freed for longer than the eviction timeout (counted from the record's
    ``since``, when freeing began) none of whose consumers' evictions is refused: what holds
    them is consumers that were asked to leave and do not (stuck terminating, pods of
    prepared DaemonSets that stay, DaemonSets never prepared). A node with a blocked
    eviction counts in ``shared_svc_upgrade_blocked_pods`` instead, never in both."""
    n = 0
    for s in statuses:
        if s.phase != "freeing" or s.blocked or s.since is None:
            continue
        try:
            if now - record.parse_time(s.since) > timeout:
                n += 1
        except record.RecordError:
            continue
    return n


class UpgradeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self._gauges(r)
        self._counters(r)
        for phase in PHASES:
            self.nodes.labels(phase=phase).set(0)
        for state in NODE_STATES:
            self.nodes_by_state.labels(state=state).set(0)
        self._gate_sources: set[tuple[str, str]] = set()  # (kind, name) with series
        # The counts of the statuses shown, kept as they change (``changed``): a beat sets
        # the gauges from them and walks only the nodes being freed (issue 33: a fleet at
        # rest, 5,000 nodes shown idle, costs nothing a beat, and a wave's 500 changes a
        # second do not each cost a walk over the 5,000).
        self._phases: Tally[str] = Tally()
        self._states: Tally[str] = Tally()
        self._pods: Tally[str] = Tally()  # pending, blocked, stuck
        self._freeing: dict[str, NodeStatus] = {}  # node -> its status, phase "freeing"

    def _gauges(self, registry: CollectorRegistry) -> None:
        """What the upgrade shows now: the nodes, the consumers still on them, the gate."""
        self.nodes = Gauge(
            "shared_svc_upgrade_nodes",
            "Upgrading nodes by phase of their consumers.",
            ["phase"],
            registry=registry,
        )
        self.nodes_by_state = Gauge(
            "shared_svc_upgrade_nodes_by_state",
            "Upgrading nodes by their driver-upgrade state label.",
            ["state"],
            registry=registry,
        )
        self.pending_pods = Gauge(
            "shared_svc_upgrade_pending_pods",
            "GPU consumers still on nodes being freed.",
            registry=registry,
        )
        self.blocked_pods = Gauge(
            "shared_svc_upgrade_blocked_pods",
            "GPU consumers whose eviction is refused past the timeout.",
            registry=registry,
        )
        self.stuck_pods = Gauge(
            "shared_svc_upgrade_stuck_pods",
            "GPU consumers evicted but still terminating past the timeout.",
            registry=registry,
        )
        self.stalled_nodes = Gauge(
            "shared_svc_upgrade_stalled_nodes",
            "Nodes being freed past the eviction timeout with no eviction refused: "
            "consumers that do not leave.",
            registry=registry,
        )
        self.gate = Gauge(
            "shared_svc_upgrade_gate",
            "1 for the verdict on the gate (waitForCompletion.podSelector) of each upgrade "
            "policy gpu-operator reads (kind ClusterPolicy or NVIDIADriver, its name; both "
            "empty: no policy source).",
            ["kind", "name", "state"],
            registry=registry,
        )

    def _counters(self, registry: CollectorRegistry) -> None:
        """What the upgrade did: evictions, deletions, node patches, restores."""
        self.evictions = Counter(
            "shared_svc_upgrade_evictions_total",
            "Eviction requests by outcome.",
            ["outcome"],
            registry=registry,
        )
        self.deletions = Counter(
            "shared_svc_upgrade_pod_deletions_total",
            "Pods deleted after the eviction timeout.",
            registry=registry,
        )
        self.node_patches = Counter(
            "shared_svc_upgrade_node_patches_total",
            "Node label/annotation patches by outcome.",
            ["outcome"],
            registry=registry,
        )
        self.restores = Counter(
            "shared_svc_upgrade_restores_total",
            "Nodes restored, by cause (done, aborted).",
            ["cause"],
            registry=registry,
        )

    def changed(self, old: NodeStatus | None, new: NodeStatus | None) -> None:
        """A node's shown status went from ``old`` to ``new`` (None: not shown)."""
        for status, sign in ((old, -1), (new, 1)):
            if status is None:
                continue
            self._phases[status.phase] += sign
            self._states[state_value(status.state)] += sign
            self._pods["pending"] += sign * len(status.pending)
            self._pods["blocked"] += sign * len(status.blocked)
            self._pods["stuck"] += sign * len(status.stuck)
        if old is not None:
            self._freeing.pop(old.node, None)
        if new is not None and new.phase == "freeing":
            self._freeing[new.node] = new

    def publish(self, *, gate: GateVerdicts | None, now: float, eviction_timeout: float) -> None:
        """The gauges from the counts of the statuses (:meth:`changed`) and the gate's
        verdicts (None: not reviewed yet), a beat a second; of the nodes, only those being
        freed are looked at (what time moves: the stalled ones)."""
        for phase in PHASES:
            self.nodes.labels(phase=phase).set(self._phases[phase])
        for state in NODE_STATES:
            self.nodes_by_state.labels(state=state).set(self._states[state])
        self.pending_pods.set(self._pods["pending"])
        self.blocked_pods.set(self._pods["blocked"])
        self.stuck_pods.set(self._pods["stuck"])
        self.stalled_nodes.set(stalled(self._freeing.values(), now, eviction_timeout))
        if gate is not None:
            self._publish_gate(gate)

    def _publish_gate(self, gate: GateVerdicts) -> None:
        """One series per state of each policy source reviewed; a source gone loses its series."""
        sources = {(c.kind, c.name): c.state for c in gate.checks}
        for kind, name in self._gate_sources - sources.keys():
            for state in GATE_STATES:
                self.gate.remove(kind, name, state)
        for (kind, name), verdict in sources.items():
            for state in GATE_STATES:
                self.gate.labels(kind=kind, name=name, state=state).set(
                    1 if state == verdict else 0
                )
        self._gate_sources = set(sources)
