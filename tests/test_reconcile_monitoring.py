"""Contract sections 3 and 7: one canonical scrape target, the one ServiceMonitor."""

from __future__ import annotations

from typing import Any

from shared_svc.reconcile.model import Plan, Settings
from shared_svc.reconcile.planner import plan
from tests.worlds import (
    action_of,
    cluster_policy,
    cr_ref,
    gc_spec,
    gpu_cluster,
    manifest,
    service_monitor,
    settled,
    stack,
    world,
)

SM_ON = {"enabled": True, "interval": "15s"}


def scrape(result: Plan, name: str) -> str:
    value: str = manifest(result, "Service", name)["metadata"]["annotations"][
        "prometheus.io/scrape"
    ]
    return value


def monitored(result: Plan) -> list[str]:
    sm = manifest(result, "ServiceMonitor", "nvidia-dcgm-exporter")
    values: list[str] = sm["spec"]["selector"]["matchExpressions"][0]["values"]
    return values


def cp_with_monitor(day: int = 1, **monitor: Any) -> dict[str, Any]:
    return cluster_policy(day=day, spec={"dcgmExporter": {"serviceMonitor": {**SM_ON, **monitor}}})


def test_dra_only_canonical_scrapes_alias_does_not() -> None:
    gc = gpu_cluster(spec=gc_spec(monitor=SM_ON))
    for common in (False, True):
        result = plan(world(gc, stack("GPUCluster", common=common)), Settings())
        assert scrape(result, "nvidia-dcgm-exporter") == "true"
        assert scrape(result, "nvidia-dcgm-exporter-dra") == "false"
        assert monitored(result) == ["nvidia-dcgm-exporter"]


def test_migration_with_gate_closed_scrapes_the_alias_too() -> None:
    gc = gpu_cluster(spec=gc_spec(monitor=SM_ON))
    w = world(cluster_policy(), gc, stack("ClusterPolicy"), stack("GPUCluster", common=False))
    result = plan(w, Settings())
    assert scrape(result, "nvidia-dcgm-exporter") == "true"
    assert scrape(result, "nvidia-dcgm-exporter-dra") == "true"  # no exporter goes unscraped
    assert monitored(result) == ["nvidia-dcgm-exporter", "nvidia-dcgm-exporter-dra"]


def test_gate_open_both_stacks_the_alias_stops_scraping() -> None:
    gc = gpu_cluster(spec=gc_spec(monitor=SM_ON))
    result = plan(
        world(cluster_policy(), gc, stack("ClusterPolicy"), stack("GPUCluster")), Settings()
    )
    assert scrape(result, "nvidia-dcgm-exporter-dra") == "false"
    assert monitored(result) == ["nvidia-dcgm-exporter"]


def test_service_monitor_shape_and_settings() -> None:
    result = plan(
        world(
            cp_with_monitor(
                scrapeTimeout="10s", honorLabels=True, additionalLabels={"release": "prom"}
            )
        ),
        Settings(),
    )
    sm = manifest(result, "ServiceMonitor", "nvidia-dcgm-exporter")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"] == {
        "app": "nvidia-dcgm-exporter",
        "app.kubernetes.io/managed-by": "shared-svc",
        "release": "prom",
    }
    assert sm["spec"]["jobLabel"] == "app"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["gpu-operator"]}
    assert sm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/managed-by": "shared-svc"}
    assert sm["spec"]["endpoints"] == [
        {
            "port": "gpu-metrics",
            "path": "/metrics",
            "interval": "15s",
            "scrapeTimeout": "10s",
            "honorLabels": True,
        }
    ]


def test_service_monitor_owned_only_by_crs_that_enable_it() -> None:
    gc = gpu_cluster(spec=gc_spec(monitor=SM_ON))
    result = plan(world(cluster_policy(), gc), Settings())
    sm = manifest(result, "ServiceMonitor", "nvidia-dcgm-exporter")
    assert sm["metadata"]["ownerReferences"] == [cr_ref(gc)]


def test_service_monitor_conflicts_per_field_and_label() -> None:
    cp = cp_with_monitor(
        day=1, interval="30s", additionalLabels={"release": "a", "team": "x"}, relabelings=[]
    )
    gc = gpu_cluster(
        day=4,
        spec=gc_spec(
            monitor={
                **SM_ON,
                "additionalLabels": {"release": "b"},
                "relabelings": [{"action": "drop"}],
            }
        ),
    )
    result = plan(world(cp, gc), Settings())
    fields = {c.field: c for c in result.conflicts}
    assert set(fields) == {
        "spec.endpoints[0].interval",
        "spec.endpoints[0].relabelings",
        'metadata.labels["release"]',
    }
    assert (
        fields["spec.endpoints[0].relabelings"].winner.value == []
    )  # an empty list is a set value
    assert all(c.object == "ServiceMonitor/nvidia-dcgm-exporter" for c in result.conflicts)
    reasons = [r for r in result.reports if r.reason == "ServiceMonitorConfigConflict"]
    assert len(reasons) == 3 and all(r.regarding.kind == "GPUCluster" for r in reasons)


def test_reserved_additional_labels_are_dropped_with_a_warning() -> None:
    cp = cp_with_monitor(
        additionalLabels={"app": "x", "nvidia.com/gpu-operator.state": "s", "ok": "1"}
    )
    result = plan(world(cp), Settings())
    labels = manifest(result, "ServiceMonitor", "nvidia-dcgm-exporter")["metadata"]["labels"]
    assert labels["app"] == "nvidia-dcgm-exporter" and labels["ok"] == "1"
    assert "nvidia.com/gpu-operator.state" not in labels
    warned = [r for r in result.reports if r.reason == "ReservedLabelIgnored"]
    assert len(warned) == 2 and all(
        r.type == "Warning" and r.regarding.kind == "ClusterPolicy" for r in warned
    )


def test_service_monitor_not_served_is_skipped_with_a_note_and_never_deleted() -> None:
    live = service_monitor("nvidia-dcgm-exporter", managed=True, owners=[cr_ref(cluster_policy())])
    result = plan(world(cp_with_monitor(), live), Settings(service_monitor_served=False))
    assert all(o["kind"] == "Service" for o in result.objects)
    assert not any(a.kind == "ServiceMonitor" for a in result.actions)
    assert "not served" in result.notes[0]


def test_service_monitor_deleted_when_disabled() -> None:
    w = settled(world(cp_with_monitor()))
    result = plan(world(cluster_policy(), *w.services, *w.service_monitors), Settings())
    assert action_of(result, "ServiceMonitor", "nvidia-dcgm-exporter").action == "delete"
    # The ServiceMonitor goes before anything else is deleted, and deletes come last.
    assert result.actions[-1].action != "delete" or result.actions[-1].kind == "Service"


def test_unmanaged_service_monitor_selecting_our_target_is_a_duplicate() -> None:
    other = service_monitor("prom-dcgm", match_labels={"app": "nvidia-dcgm-exporter"})
    result = plan(world(cp_with_monitor(), other), Settings())
    [pending] = result.pending
    assert (pending.object, pending.reason) == ("ServiceMonitor/prom-dcgm", "DuplicateScrapeTarget")
    assert any(
        r.reason == "DuplicateScrapeTarget" and r.regarding.name == "prom-dcgm"
        for r in result.reports
    )


def test_leftover_dra_service_monitor_selecting_the_alias_is_a_duplicate() -> None:
    leftover = service_monitor("nvidia-dcgm-exporter-dra")
    result = plan(world(gpu_cluster(), leftover), Settings())
    assert [(p.object, p.reason) for p in result.pending] == [
        ("ServiceMonitor/nvidia-dcgm-exporter-dra", "DuplicateScrapeTarget")
    ]
    assert "scrape=false" in result.pending[0].message


def test_unrelated_service_monitor_is_not_reported() -> None:
    other = service_monitor("node-exporter", match_labels={"app": "node-exporter"})
    assert plan(world(cp_with_monitor(), other), Settings()).pending == ()


def test_unmanaged_same_named_service_monitor_is_adopted_not_reported() -> None:
    cp = cp_with_monitor()
    live = service_monitor("nvidia-dcgm-exporter", owners=[cr_ref(cp, controller=True)])
    result = plan(world(cp, live), Settings())
    assert (
        action_of(result, "ServiceMonitor", "nvidia-dcgm-exporter").reason
        == "ServiceMonitorAdopted"
    )
    assert result.pending == ()
    skipped = plan(world(cp, live), Settings(adopt=False))
    assert (
        action_of(skipped, "ServiceMonitor", "nvidia-dcgm-exporter").reason
        == "ServiceMonitorNotAdopted"
    )
