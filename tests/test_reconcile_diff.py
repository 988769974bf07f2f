"""Contract section 5: a right world writes nothing; writes are ordered so coverage never dips."""

from __future__ import annotations

import copy

from shared_svc.reconcile.model import Settings
from shared_svc.reconcile.names import MONITOR_LABEL
from shared_svc.reconcile.planner import plan
from tests.worlds import (
    action_of,
    apply_plan,
    cluster_policy,
    find,
    gc_spec,
    gpu_cluster,
    settled,
    stack,
    with_objects,
    world,
)

SM_ON = {"enabled": True}


def test_api_defaults_count_as_equal() -> None:
    w = settled(world(cluster_policy()))
    svc = find(w, "Service", "nvidia-dcgm")
    assert svc is not None
    stripped = copy.deepcopy(svc)
    for port in stripped["spec"]["ports"]:
        del port["protocol"], port["targetPort"]
    assert (
        action_of(plan(with_objects(w, stripped), Settings()), "Service", "nvidia-dcgm").action
        == "unchanged"
    )


def test_drift_in_a_field_we_set_is_repaired() -> None:
    w = settled(world(cluster_policy()))
    svc = copy.deepcopy(find(w, "Service", "nvidia-dcgm"))
    assert svc is not None
    svc["spec"]["internalTrafficPolicy"] = "Cluster"
    action = action_of(plan(with_objects(w, svc), Settings()), "Service", "nvidia-dcgm")
    assert (action.action, action.reason, action.changed_fields) == (
        "update",
        "ConfigChanged",
        ("spec.internalTrafficPolicy",),
    )
    assert action.json_patch == ()


def test_fields_of_other_managers_are_not_compared() -> None:
    w = settled(world(cluster_policy()))
    svc = copy.deepcopy(find(w, "Service", "nvidia-dcgm-exporter"))
    assert svc is not None
    svc["metadata"]["labels"]["team"] = "gpu"
    svc["metadata"]["annotations"]["note"] = "x"
    svc["spec"]["sessionAffinity"] = "ClientIP"
    assert plan(with_objects(w, svc), Settings()).writes == ()


def test_a_field_we_no_longer_set_is_detected_by_the_intent_hash() -> None:
    cp = cluster_policy(spec={"dcgmExporter": {"service": {"type": "NodePort"}}})
    w = settled(world(cp))
    unset = cluster_policy(spec={})
    result = plan(with_objects(w, unset), Settings())
    action = action_of(result, "Service", "nvidia-dcgm-exporter")
    assert action.action == "update"
    assert 'metadata.annotations["shared-svc.nvidia.com/intent-hash"]' in action.changed_fields
    after = apply_plan(with_objects(w, unset), result)
    svc = find(after, "Service", "nvidia-dcgm-exporter")
    assert svc is not None and svc["spec"]["type"] == "ClusterIP"
    assert "nodePort" not in svc["spec"]["ports"][0]
    assert plan(after, Settings()).writes == ()


def test_state_label_on_a_managed_object_is_removed_by_patch() -> None:
    w = settled(world(cluster_policy()))
    svc = copy.deepcopy(find(w, "Service", "nvidia-dcgm"))
    assert svc is not None
    svc["metadata"]["labels"]["nvidia.com/gpu-operator.state"] = "state-dcgm"
    action = action_of(plan(with_objects(w, svc), Settings()), "Service", "nvidia-dcgm")
    assert action.action == "update"
    assert action.json_patch[-1] == {
        "op": "remove",
        "path": "/metadata/labels/nvidia.com~1gpu-operator.state",
    }
    assert action.preconditions == {
        "uid": svc["metadata"]["uid"],
        "resourceVersion": svc["metadata"]["resourceVersion"],
    }


def _names(actions: object) -> list[tuple[str, str, str]]:
    return [(a.action, a.kind, a.name) for a in actions]  # type: ignore[attr-defined]


def test_gate_closing_turns_the_alias_on_before_the_canonical_narrows() -> None:
    gc = gpu_cluster(spec=gc_spec(monitor=SM_ON))
    cp = cluster_policy()
    w = settled(world(cp, gc, stack("ClusterPolicy"), stack("GPUCluster")))
    canonical_svc = find(w, "Service", "nvidia-dcgm-exporter")
    assert canonical_svc is not None
    assert canonical_svc["spec"]["selector"] == {"nvidia.com/gpu-operator.dcgm-exporter": "true"}
    # Rollback of the DRA exporter: its pods lose the common label.
    w = with_objects(w, *stack("GPUCluster", common=False, components=["exporter"]))
    order = _names(plan(w, Settings()).writes)
    alias = order.index(("update", "Service", "nvidia-dcgm-exporter-dra"))
    canonical = order.index(("update", "Service", "nvidia-dcgm-exporter"))
    assert alias < canonical
    # The alias names its ServiceMonitor in the write that turns it "true": no
    # ServiceMonitor changes with a scrape decision (section 7).
    assert [k for k in order if k[1] == "ServiceMonitor"] == []


def test_gate_opening_widens_the_canonical_before_the_alias_stops() -> None:
    gc = gpu_cluster(spec=gc_spec(monitor=SM_ON))
    w = settled(
        world(cluster_policy(), gc, stack("ClusterPolicy"), stack("GPUCluster", common=False))
    )
    w = with_objects(w, *stack("GPUCluster", common=True))
    order = _names(plan(w, Settings()).writes)
    canonical = order.index(("update", "Service", "nvidia-dcgm-exporter"))
    alias = order.index(("update", "Service", "nvidia-dcgm-exporter-dra"))
    assert canonical < alias
    assert [k for k in order if k[1] == "ServiceMonitor"] == []


def test_creates_first_deletes_last_a_service_naming_a_new_monitor_after_it() -> None:
    w = settled(world(cluster_policy()))
    gc = gpu_cluster(spec=gc_spec(monitor=SM_ON))
    w2 = with_objects(w, gc)
    w2 = type(w2)(gpu_clusters=w2.gpu_clusters, services=w2.services)  # the ClusterPolicy is gone
    result = plan(w2, Settings())
    kinds = [(a.action, a.kind) for a in result.writes]
    assert kinds[0] == ("create", "Service")
    created = {a.name: i for i, a in enumerate(result.writes) if a.kind == "ServiceMonitor"}
    assert set(created) == {"nvidia-dcgm-exporter", "nvidia-dcgm-exporter-dra"}
    # A Service whose label names a ServiceMonitor this plan creates is written after it.
    for i, a in enumerate(result.writes):
        named = (a.apply or {}).get("metadata", {}).get("labels", {}).get(MONITOR_LABEL)
        if a.kind == "Service" and named is not None:
            assert i > created[named], (a.name, named, kinds)
