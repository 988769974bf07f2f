"""The metrics the alerts and the dashboard read (issue 32), from the values the shells set
them from: the upgrade controller's node statuses and gate, the guard monitor's findings,
the Services plan. A live ``shared-svc run`` exposes them: tests/test_monitoring_prometheus.py."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from shared_svc.config import Config
from shared_svc.controllers.services.metrics import PENDING_REASONS, ServicesMetrics
from shared_svc.controllers.services.outcomes import Outcomes
from shared_svc.controllers.upgrade.metrics import GATE_STATES, NODE_STATES, PHASES, UpgradeMetrics
from shared_svc.kube.recorder import EventPublisher
from shared_svc.reconcile.model import ObjectStatus, Plan
from shared_svc.runtime.controller import Controller, Result
from shared_svc.runtime.instrumentation import RuntimeMetrics
from shared_svc.service_metrics import Metrics
from shared_svc.upgrade.planner import NodeStatus
from shared_svc.upgrade.record import format_time
from shared_svc.wait.ratelimit import ItemExponentialFailureRateLimiter

NOW = 1_800_000_000.0
TIMEOUT = 300.0


def value(registry: CollectorRegistry, metric: str, **labels: str) -> float | None:
    return registry.get_sample_value(metric, labels)


def status(
    name: str, state: str | None, phase: Any, since: float | None = None, **kw: Any
) -> NodeStatus:
    return NodeStatus(
        node=name,
        state=state,
        mode="free",
        phase=phase,
        parked_label=phase != "idle",
        parked_by_us=phase != "idle",
        since=None if since is None else format_time(since),
        freed_at=None,
        **kw,
    )


def test_stalled_nodes_are_freeing_past_the_timeout_with_no_eviction_refused() -> None:
    m = UpgradeMetrics()
    statuses = [
        status(
            "stuck",
            "pod-restart-required",
            "freeing",
            NOW - 400,
            pending=("ml/a",),
            stuck=("ml/a",),
        ),
        status("ds-stays", "drain-required", "freeing", NOW - 301, daemonset_pods=("mon/x",)),
        status(
            "blocked", "cordon-required", "freeing", NOW - 900, pending=("ml/b",), blocked=("ml/b",)
        ),
        status("young", "cordon-required", "freeing", NOW - 100, pending=("ml/c", "ml/d")),
        status("freed-long-ago", "pod-restart-required", "freed", NOW - 4000),
        status("parked", "validation-required", "parked", NOW - 4000),
        status("waiting", "upgrade-required", "idle"),
        status("libs-unknown", "", "idle"),
        status("newer-state", "a-future-state-required", "parked", NOW - 10),
        status("label-gone", None, "aborting", NOW - 10),
    ]
    for shown in statuses:
        m.changed(None, shown)
    m.publish(gate="missing", now=NOW, eviction_timeout=TIMEOUT)
    r = m.registry
    assert value(r, "shared_svc_upgrade_stalled_nodes") == 2
    assert value(r, "shared_svc_upgrade_blocked_pods") == 1
    assert value(r, "shared_svc_upgrade_stuck_pods") == 1
    assert value(r, "shared_svc_upgrade_pending_pods") == 4
    assert value(r, "shared_svc_upgrade_nodes", phase="freeing") == 4
    assert value(r, "shared_svc_upgrade_nodes", phase="restoring") == 0
    by_state = {s: value(r, "shared_svc_upgrade_nodes_by_state", state=s) for s in NODE_STATES}
    assert by_state["cordon-required"] == 2 and by_state["pod-restart-required"] == 2
    assert by_state["unknown"] == 1 and by_state["other"] == 1 and by_state["none"] == 1
    assert by_state["upgrade-done"] == 0 and sum(v or 0 for v in by_state.values()) == 10
    assert {s: value(r, "shared_svc_upgrade_gate", state=s) for s in GATE_STATES} == {
        s: 1.0 if s == "missing" else 0.0 for s in GATE_STATES
    }
    # once the consumers leave, and before the gate is reviewed
    for shown in statuses:
        m.changed(shown, None)
    m.publish(gate=None, now=NOW, eviction_timeout=TIMEOUT)
    assert value(r, "shared_svc_upgrade_pending_pods") == 0
    assert all(value(r, "shared_svc_upgrade_nodes", phase=p) == 0 for p in PHASES)
    assert all(value(r, "shared_svc_upgrade_nodes_by_state", state=s) == 0 for s in NODE_STATES)
    assert value(r, "shared_svc_upgrade_stalled_nodes") == 0
    assert all(value(r, "shared_svc_upgrade_gate", state=s) == 0 for s in GATE_STATES)


def test_the_counts_follow_each_change_and_a_beat_walks_only_the_nodes_being_freed() -> None:
    """Issues 33 and the wave: a status change updates the counts (no walk over the 5,000
    statuses shown); a beat sets the gauges from them and looks only at the nodes being
    freed, whose stalled count time moves."""
    m = UpgradeMetrics()
    r = m.registry
    young = status("young", "cordon-required", "freeing", NOW - 100, pending=("ml/c",))
    idle = [status(f"n{i}", "upgrade-done", "idle") for i in range(3)]
    for shown in (young, *idle):
        m.changed(None, shown)
    m.publish(gate="ok", now=NOW, eviction_timeout=TIMEOUT)
    assert value(r, "shared_svc_upgrade_stalled_nodes") == 0
    assert value(r, "shared_svc_upgrade_nodes_by_state", state="upgrade-done") == 3
    assert value(r, "shared_svc_upgrade_pending_pods") == 1
    m.publish(gate="missing", now=NOW + 300, eviction_timeout=TIMEOUT)
    assert value(r, "shared_svc_upgrade_stalled_nodes") == 1  # past the timeout now
    assert value(r, "shared_svc_upgrade_gate", state="missing") == 1
    freed = status("young", "cordon-required", "freed", NOW - 100)
    m.changed(young, freed)  # its consumer left
    m.publish(gate="ok", now=NOW + 300, eviction_timeout=TIMEOUT)
    assert value(r, "shared_svc_upgrade_stalled_nodes") == 0
    assert value(r, "shared_svc_upgrade_nodes", phase="freeing") == 0
    assert value(r, "shared_svc_upgrade_nodes", phase="freed") == 1
    assert value(r, "shared_svc_upgrade_pending_pods") == 0
    assert value(r, "shared_svc_upgrade_nodes_by_state", state="cordon-required") == 1
    m.changed(idle[0], None)  # the node left the caches
    m.publish(gate="ok", now=NOW + 300, eviction_timeout=TIMEOUT)
    assert value(r, "shared_svc_upgrade_nodes_by_state", state="upgrade-done") == 2
    assert value(r, "shared_svc_upgrade_nodes", phase="idle") == 2


def test_every_known_series_is_there_at_zero_from_the_start() -> None:
    m = Metrics()
    ServicesMetrics(m.registry)
    UpgradeMetrics(m.registry)
    r = m.registry
    assert all(value(r, "shared_svc_pending", reason=x) == 0 for x in PENDING_REASONS)
    assert value(r, "shared_svc_service_selector", service="nvidia-dcgm", mode="common") == 0
    assert value(r, "shared_svc_admission_guard", mode="none") == 0
    assert value(r, "shared_svc_admission_webhooks", served="false") == 0
    assert value(r, "shared_svc_admission_unguarded_writers") == 0
    assert all(value(r, "shared_svc_upgrade_gate", state=s) == 0 for s in GATE_STATES)
    assert all(value(r, "shared_svc_upgrade_nodes_by_state", state=s) == 0 for s in NODE_STATES)

    async def reconcile(key: str) -> Result:
        return Result()

    Controller(
        "upgrade",
        reconcile,
        metrics=RuntimeMetrics.of(r),
        rate_limiter=ItemExponentialFailureRateLimiter(0.01, 1.0),
    )
    assert value(r, "workqueue_retries_total", name="upgrade") == 0
    assert value(r, "workqueue_depth", name="upgrade") == 0
    assert value(r, "controller_runtime_reconcile_errors_total", controller="upgrade") == 0
    assert value(r, "controller_runtime_reconcile_total", controller="upgrade", result="error") == 0


def test_the_guard_monitors_findings() -> None:
    m = Metrics()
    webhooks = [{"served": False}, {"served": True}, {"served": None}, {"served": False}]
    m.publish_guard("none", webhooks, 3)
    r = m.registry
    assert value(r, "shared_svc_admission_guard", mode="none") == 1
    assert value(r, "shared_svc_admission_guard", mode="policy") == 0
    assert value(r, "shared_svc_admission_webhooks", served="false") == 2
    assert value(r, "shared_svc_admission_webhooks", served="true") == 1
    assert value(r, "shared_svc_admission_webhooks", served="unprobed") == 1
    assert value(r, "shared_svc_admission_unguarded_writers") == 3
    m.publish_guard("policy", [], 0)
    assert value(r, "shared_svc_admission_guard", mode="none") == 0
    assert value(r, "shared_svc_admission_webhooks", served="false") == 0


def test_the_guard_probes_verdict_per_guard_one_reason_at_a_time() -> None:
    from shared_svc.admission.verdicts import GUARDS, REASONS
    from shared_svc.service_metrics import PROBE_GUARDS, PROBE_REASONS

    assert (PROBE_GUARDS, PROBE_REASONS) == (GUARDS, REASONS)  # spelled out in both layers
    m = Metrics()
    r = m.registry
    name = "shared_svc_admission_guard_probe"
    # from the start: every series, not_probed
    for guard in GUARDS:
        assert [value(r, name, guard=guard, reason=x) for x in REASONS] == [0, 0, 0, 0, 1]
    m.publish_guard("webhook", [], 0, {"delete": "fails_open", "update": "served"})
    assert value(r, name, guard="delete", reason="fails_open") == 1
    assert value(r, name, guard="delete", reason="not_probed") == 0
    assert value(r, name, guard="update", reason="served") == 1
    m.publish_guard("webhook", [], 0, {"delete": "served", "update": "served"})
    assert value(r, name, guard="delete", reason="fails_open") == 0
    assert value(r, name, guard="delete", reason="served") == 1


class _Quiet:
    async def emit(self, report: Any) -> None:  # pragma: no cover - never called here
        raise AssertionError(report)


def test_each_services_selector_mode() -> None:
    m = ServicesMetrics()
    outcomes = Outcomes(
        Config(namespace="gpu-operator"), events=EventPublisher(_Quiet()), metrics=m
    )
    plan = Plan(
        status=(
            ObjectStatus(
                "Service",
                "nvidia-dcgm",
                ("ClusterPolicy/cp",),
                {"nvidia.com/gpu-operator.dcgm": "true"},
            ),
            ObjectStatus(
                "Service",
                "nvidia-dcgm-exporter",
                ("ClusterPolicy/cp",),
                {"app": "nvidia-dcgm-exporter"},
            ),
            ObjectStatus("ServiceMonitor", "nvidia-dcgm-exporter", ("ClusterPolicy/cp",)),
        )
    )
    outcomes.record_plan_metrics(plan)
    r = m.registry

    def modes(service: str) -> tuple[float | None, float | None]:
        return (
            value(r, "shared_svc_service_selector", service=service, mode="common"),
            value(r, "shared_svc_service_selector", service=service, mode="app"),
        )

    assert modes("nvidia-dcgm") == (1, 0)
    assert modes("nvidia-dcgm-exporter") == (0, 1)
    assert modes("nvidia-dcgm-dra") == (0, 0), "not managed"
    assert value(r, "shared_svc_pending", reason="SelectorMigrationPending") == 0
    outcomes.record_plan_metrics(Plan())
    assert modes("nvidia-dcgm") == (0, 0)
