"""Contract sections 3 and 7: one canonical scrape target; shared-svc's ServiceMonitors (the
canonical one and, amended section 7, the GPUCluster's own ``nvidia-dcgm-exporter-dra``)."""

from __future__ import annotations

from typing import Any

from shared_svc.reconcile.model import Plan, Settings
from shared_svc.reconcile.monitoring import selects
from shared_svc.reconcile.planner import plan
from tests.worlds import (
    NS,
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


def monitored(result: Plan, name: str = "nvidia-dcgm-exporter") -> list[str]:
    """The exporter Services ServiceMonitor ``name`` selects after the plan."""
    sm = manifest(result, "ServiceMonitor", name)
    return sorted(
        o["metadata"]["name"]
        for o in result.objects
        if o["kind"] == "Service" and selects(sm, o["metadata"]["labels"], NS)
    )


def cp_with_monitor(day: int = 1, **monitor: Any) -> dict[str, Any]:
    return cluster_policy(day=day, spec={"dcgmExporter": {"serviceMonitor": {**SM_ON, **monitor}}})


def test_dra_only_canonical_scrapes_alias_does_not() -> None:
    gc = gpu_cluster(spec=gc_spec(monitor=SM_ON))
    for common in (False, True):
        result = plan(world(gc, stack("GPUCluster", common=common)), Settings())
        assert scrape(result, "nvidia-dcgm-exporter") == "true"
        assert scrape(result, "nvidia-dcgm-exporter-dra") == "false"
        assert monitored(result) == ["nvidia-dcgm-exporter"]
        assert monitored(result, "nvidia-dcgm-exporter-dra") == []


def test_migration_with_gate_closed_scrapes_the_alias_too() -> None:
    gc = gpu_cluster(spec=gc_spec(monitor=SM_ON))
    w = world(cluster_policy(), gc, stack("ClusterPolicy"), stack("GPUCluster", common=False))
    result = plan(w, Settings())
    assert scrape(result, "nvidia-dcgm-exporter") == "true"
    assert scrape(result, "nvidia-dcgm-exporter-dra") == "true"  # no exporter goes unscraped
    # Each by exactly one ServiceMonitor: the alias by the GPUCluster's own.
    assert monitored(result) == ["nvidia-dcgm-exporter"]
    assert monitored(result, "nvidia-dcgm-exporter-dra") == ["nvidia-dcgm-exporter-dra"]


def test_migration_with_only_the_cluster_policy_monitoring_scrapes_the_alias_canonically() -> None:
    cp = cp_with_monitor()
    gc = gpu_cluster(spec=gc_spec())  # no ServiceMonitor of its own
    w = world(cp, gc, stack("ClusterPolicy"), stack("GPUCluster", common=False))
    result = plan(w, Settings())
    assert scrape(result, "nvidia-dcgm-exporter-dra") == "true"
    assert monitored(result) == ["nvidia-dcgm-exporter", "nvidia-dcgm-exporter-dra"]
    assert not any(o["metadata"]["name"] == "nvidia-dcgm-exporter-dra" for o in monitors(result))


def test_gate_open_both_stacks_the_alias_stops_scraping() -> None:
    gc = gpu_cluster(spec=gc_spec(monitor=SM_ON))
    result = plan(
        world(cluster_policy(), gc, stack("ClusterPolicy"), stack("GPUCluster")), Settings()
    )
    assert scrape(result, "nvidia-dcgm-exporter-dra") == "false"
    assert monitored(result) == ["nvidia-dcgm-exporter"]
    assert monitored(result, "nvidia-dcgm-exporter-dra") == []


def monitors(result: Plan) -> list[dict[str, Any]]:
    return [o for o in result.objects if o["kind"] == "ServiceMonitor"]


def gc_monitor(gc: dict[str, Any], **settings: Any) -> dict[str, Any]:
    """The ServiceMonitor the GPUCluster controller keeps (facts 4 and 10): its controller
    reference, the state label, ``app: nvidia-dcgm-exporter-dra`` as selector."""
    sm = service_monitor("nvidia-dcgm-exporter-dra", owners=[cr_ref(gc, controller=True)])
    sm["metadata"]["labels"]["nvidia.com/gpu-operator.state"] = "state-dcgm-exporter"
    sm["spec"]["endpoints"][0].update({"honorLabels": False, **settings})
    return sm


def test_the_gpu_cluster_service_monitor_is_adopted_owned_and_without_the_state_label() -> None:
    gc = gpu_cluster(spec=gc_spec(monitor={**SM_ON, "additionalLabels": {"release": "p"}}))
    live = gc_monitor(gc, interval="30s")
    # A migration with the gate closed: the alias is scraped (scrape "true").
    w = world(cluster_policy(), gc, stack("ClusterPolicy"), stack("GPUCluster", common=False), live)
    result = plan(w, Settings())
    action = action_of(result, "ServiceMonitor", "nvidia-dcgm-exporter-dra")
    assert (action.action, action.reason) == ("update", "ServiceMonitorAdopted")
    assert {"op": "remove", "path": "/metadata/labels/nvidia.com~1gpu-operator.state"} in (
        action.json_patch
    )
    sm = manifest(result, "ServiceMonitor", "nvidia-dcgm-exporter-dra")
    assert sm["metadata"]["ownerReferences"] == [cr_ref(gc)]
    assert sm["metadata"]["labels"] == {
        "app": "nvidia-dcgm-exporter-dra",
        "app.kubernetes.io/managed-by": "shared-svc",
        "release": "p",
    }
    assert sm["spec"]["jobLabel"] == "app"
    # Its settings come from the GPUCluster only (not the live 30s).
    assert sm["spec"]["endpoints"] == [
        {"port": "gpu-metrics", "path": "/metrics", "interval": "15s"}
    ]
    assert monitored(result, "nvidia-dcgm-exporter-dra") == ["nvidia-dcgm-exporter-dra"]
    # Ours now: not a DuplicateScrapeTarget.
    assert [p for p in result.pending if p.reason == "DuplicateScrapeTarget"] == []
    assert plan(settled(w), Settings()).writes == ()


def test_the_dra_service_monitor_settings_and_conflicts_come_from_the_gpu_cluster_only() -> None:
    cp = cp_with_monitor(day=1, interval="30s", honorLabels=True)
    gc = gpu_cluster(day=4, spec=gc_spec(monitor={**SM_ON, "additionalLabels": {"app": "x"}}))
    result = plan(world(cp, gc), Settings())
    dra = manifest(result, "ServiceMonitor", "nvidia-dcgm-exporter-dra")
    assert dra["metadata"]["ownerReferences"] == [cr_ref(gc)]
    assert dra["spec"]["endpoints"][0] == {
        "port": "gpu-metrics",
        "path": "/metrics",
        "interval": "15s",
    }
    canonical = manifest(result, "ServiceMonitor", "nvidia-dcgm-exporter")
    assert canonical["metadata"]["ownerReferences"] == [cr_ref(cp), cr_ref(gc)]
    # The canonical one has both CRs' settings, so their conflicts; the -dra one none.
    assert {c.object for c in result.conflicts} == {"ServiceMonitor/nvidia-dcgm-exporter"}
    reserved = [r for r in result.reports if r.reason == "ReservedLabelIgnored"]
    assert sorted(r.note.rsplit(" ", 1)[-1] for r in reserved) == [
        "ServiceMonitor/nvidia-dcgm-exporter",
        "ServiceMonitor/nvidia-dcgm-exporter-dra",
    ]


def test_the_dra_service_monitor_is_deleted_when_the_gpu_cluster_stops_monitoring() -> None:
    gc = gpu_cluster(spec=gc_spec(monitor=SM_ON))
    w = settled(
        world(cluster_policy(), gc, stack("ClusterPolicy"), stack("GPUCluster", common=False))
    )
    off = gpu_cluster(spec=gc_spec(monitor={"enabled": False}))
    result = plan(world(cluster_policy(), off, *w.services, *w.service_monitors), Settings())
    writes = [(a.action, a.kind, a.name) for a in result.writes]
    assert ("delete", "ServiceMonitor", "nvidia-dcgm-exporter-dra") in writes
    assert ("delete", "ServiceMonitor", "nvidia-dcgm-exporter") in writes
    # The alias leaves it (its label goes) before it is deleted.
    alias = writes.index(("update", "Service", "nvidia-dcgm-exporter-dra"))
    assert alias < writes.index(("delete", "ServiceMonitor", "nvidia-dcgm-exporter-dra"))


def test_a_foreign_held_dra_service_monitor_is_not_adopted_and_stays_a_duplicate() -> None:
    from tests.worlds import foreign_ref

    gc = gpu_cluster(spec=gc_spec(monitor=SM_ON))
    live = gc_monitor(gc)
    live["metadata"]["ownerReferences"].append(foreign_ref())
    w = world(gc, stack("GPUCluster", common=False), live)
    result = plan(w, Settings())
    assert action_of(result, "ServiceMonitor", "nvidia-dcgm-exporter-dra").action == "skip"
    # The alias goes to the canonical ServiceMonitor, and the foreign one is reported.
    assert monitored(result) == ["nvidia-dcgm-exporter"]  # the alias is "false" here
    assert [(p.object, p.reason) for p in result.pending] == [
        ("ServiceMonitor/nvidia-dcgm-exporter-dra", "DuplicateScrapeTarget"),
        ("ServiceMonitor/nvidia-dcgm-exporter-dra", "ServiceMonitorNotAdopted"),
    ]


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
    assert sm["spec"]["selector"] == {
        "matchLabels": {
            "app.kubernetes.io/managed-by": "shared-svc",
            "shared-svc.nvidia.com/service-monitor": "nvidia-dcgm-exporter",
        }
    }
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


# --- a ServiceMonitor going away (issue 46) ------------------------------------------------


def test_a_service_monitor_going_away_selects_nothing_first_and_goes_two_intervals_later() -> None:
    """With a clock (``World.now``): the GPUCluster stops monitoring, so its ``-dra``
    ServiceMonitor is made to select nothing (its targets end, Prometheus marks their
    series stale), and is deleted only once it has selected nothing for two of its scrape
    intervals (15 s) and Prometheus' discovery time (10 s): at 40 s, not before. Without a
    clock (an offline plan) it goes at once."""
    from dataclasses import replace

    from shared_svc.reconcile.monitoring import drained_selector
    from shared_svc.reconcile.names import DRAINED_ANNOTATION
    from tests.worlds import apply_plan

    gc = gpu_cluster(spec=gc_spec(monitor=SM_ON))
    w = settled(
        world(cluster_policy(), gc, stack("ClusterPolicy"), stack("GPUCluster", common=False))
    )
    off = gpu_cluster(spec=gc_spec(monitor={"enabled": False}))
    going = world(cluster_policy(), off, *w.services, *w.service_monitors)
    offline = plan(going, Settings())
    assert action_of(offline, "ServiceMonitor", "nvidia-dcgm-exporter-dra").action == "delete"

    t0 = 1_800_000_000.0
    first = plan(replace(going, now=t0), Settings())
    drain = action_of(first, "ServiceMonitor", "nvidia-dcgm-exporter-dra")
    assert (drain.action, drain.reason) == ("update", "ServiceMonitorDrained")
    assert first.recheck_after == 40.0
    # after the alias Service left it (coverage: it selects fewer, so it goes last)
    writes = [(a.action, a.kind, a.name) for a in first.writes]
    assert writes.index(("update", "Service", "nvidia-dcgm-exporter-dra")) < writes.index(
        ("update", "ServiceMonitor", "nvidia-dcgm-exporter-dra")
    )
    drained = apply_plan(going, first)
    monitor = next(
        m for m in drained.service_monitors if m["metadata"]["name"] == "nvidia-dcgm-exporter-dra"
    )
    assert monitor["spec"]["selector"] == drained_selector("nvidia-dcgm-exporter-dra")
    assert DRAINED_ANNOTATION in monitor["metadata"]["annotations"]
    assert "ownerReferences" not in monitor["metadata"], "not the garbage collector's: ours"
    assert not any(selects(monitor, s["metadata"]["labels"], NS) for s in drained.services)

    waiting = plan(replace(drained, now=t0 + 39.0), Settings())
    assert not [a for a in waiting.writes if a.kind == "ServiceMonitor"]
    assert waiting.recheck_after == 1.0
    due = plan(replace(drained, now=t0 + 40.0), Settings())
    assert action_of(due, "ServiceMonitor", "nvidia-dcgm-exporter-dra").action == "delete"
    assert due.recheck_after is None
    # one that selects something again (a hand edit) is drained again, not deleted
    edited = {**monitor, "spec": {**monitor["spec"], "selector": {"matchLabels": {"app": "x"}}}}
    again = plan(replace(with_monitor(drained, edited), now=t0 + 60.0), Settings())
    assert action_of(again, "ServiceMonitor", "nvidia-dcgm-exporter-dra").reason == (
        "ServiceMonitorDrained"
    )


def test_a_drained_service_monitor_a_cr_needs_again_selects_its_services_again() -> None:
    from dataclasses import replace

    from shared_svc.reconcile.monitoring import monitor_selector
    from tests.worlds import apply_plan

    gc = gpu_cluster(spec=gc_spec(monitor=SM_ON))
    w = settled(
        world(cluster_policy(), gc, stack("ClusterPolicy"), stack("GPUCluster", common=False))
    )
    off = gpu_cluster(spec=gc_spec(monitor={"enabled": False}))
    going = replace(world(cluster_policy(), off, *w.services, *w.service_monitors), now=1.0)
    drained = apply_plan(going, plan(going, Settings()))
    back = replace(drained, gpu_clusters=(gc,))
    result = plan(back, Settings())
    assert result.recheck_after is None
    sm = manifest(result, "ServiceMonitor", "nvidia-dcgm-exporter-dra")
    assert sm["spec"]["selector"] == monitor_selector("nvidia-dcgm-exporter-dra")
    assert action_of(result, "ServiceMonitor", "nvidia-dcgm-exporter-dra").action == "update"


def with_monitor(base: Any, monitor: dict[str, Any]) -> Any:
    from tests.worlds import with_objects

    return with_objects(base, monitor)
