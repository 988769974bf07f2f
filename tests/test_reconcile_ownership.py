"""Contract section 5: owner references, adoption, deletion, migrations between stacks."""

from __future__ import annotations

from shared_svc.reconcile.model import Settings, World
from shared_svc.reconcile.planner import plan
from tests.worlds import (
    action_of,
    apply_plan,
    cluster_policy,
    cr_ref,
    find,
    foreign_ref,
    gpu_cluster,
    gpu_operator_service,
    manifest,
    owner_names,
    service,
    service_monitor,
    settled,
    stack,
    with_objects,
    without,
    world,
)

CP = cluster_policy()
GC = gpu_cluster()


def test_owner_refs_are_sorted_non_controller_one_per_needing_cr() -> None:
    result = plan(world(GC, CP), Settings())
    refs = manifest(result, "Service", "nvidia-dcgm")["metadata"]["ownerReferences"]
    assert refs == [cr_ref(CP), cr_ref(GC)]
    assert all(r["controller"] is False and r["blockOwnerDeletion"] is False for r in refs)
    assert owner_names(manifest(result, "Service", "nvidia-dcgm-dra")) == ["GPUCluster/gpu-cluster"]


def test_adopting_gpu_operator_services_converts_controller_refs_and_strips_state_label() -> None:
    live = gpu_operator_service("nvidia-dcgm-dra", GC)
    result = plan(world(GC, live), Settings())
    action = action_of(result, "Service", "nvidia-dcgm-dra")
    assert (action.action, action.reason) == ("update", "ServiceAdopted")
    assert action.json_patch == (
        {"op": "test", "path": "/metadata/uid", "value": "uid-svc-nvidia-dcgm-dra"},
        {"op": "replace", "path": "/metadata/resourceVersion", "value": "7"},
        {"op": "replace", "path": "/metadata/ownerReferences", "value": [cr_ref(GC)]},
        {"op": "remove", "path": "/metadata/labels/nvidia.com~1gpu-operator.state"},
    )
    assert action.preconditions == {"uid": "uid-svc-nvidia-dcgm-dra", "resourceVersion": "7"}
    assert action.apply is not None
    assert "nvidia.com/gpu-operator.state" not in action.apply["metadata"]["labels"]
    after = apply_plan(world(GC, live), result)
    adopted = find(after, "Service", "nvidia-dcgm-dra")
    assert adopted is not None
    assert adopted["metadata"]["ownerReferences"] == [cr_ref(GC)]
    assert "nvidia.com/gpu-operator.state" not in adopted["metadata"]["labels"]
    assert adopted["spec"]["clusterIP"] == "10.0.0.1"  # API-assigned, never overwritten
    assert plan(after, Settings()).writes == ()
    assert any(r.reason == "ServiceAdopted" and r.after_write for r in result.reports)


def test_no_adopt_skips_and_reports_service_not_adopted() -> None:
    live = gpu_operator_service("nvidia-dcgm", CP)
    result = plan(world(CP, live), Settings(adopt=False))
    assert action_of(result, "Service", "nvidia-dcgm").action == "skip"
    assert [(p.object, p.reason) for p in result.pending] == [
        ("Service/nvidia-dcgm", "ServiceNotAdopted")
    ]
    assert all(o["metadata"]["name"] != "nvidia-dcgm" for o in result.objects)


def test_same_named_service_with_a_foreign_owner_is_not_adopted() -> None:
    live = service("nvidia-dcgm", owners=[foreign_ref()])
    result = plan(world(CP, live), Settings())
    assert action_of(result, "Service", "nvidia-dcgm").reason == "ServiceNotAdopted"
    assert result.pending[0].reason == "ServiceNotAdopted"


def test_foreign_owner_refs_are_kept_in_the_manifest_but_not_applied() -> None:
    live = service("nvidia-dcgm", managed=True, owners=[foreign_ref(), cr_ref(CP)])
    result = plan(world(CP, live), Settings())
    assert manifest(result, "Service", "nvidia-dcgm")["metadata"]["ownerReferences"] == [
        foreign_ref(),
        cr_ref(CP),
    ]
    action = action_of(result, "Service", "nvidia-dcgm")
    assert action.apply is not None and action.apply["metadata"]["ownerReferences"] == [cr_ref(CP)]
    after = settled(world(CP, live))
    obj = find(after, "Service", "nvidia-dcgm")
    assert obj is not None and obj["metadata"]["ownerReferences"] == [foreign_ref(), cr_ref(CP)]


def test_delete_only_when_managed_unneeded_and_no_foreign_owner() -> None:
    live = service("nvidia-dcgm-dra", managed=True, owners=[cr_ref(GC)], rv="42")
    result = plan(world(live), Settings())
    action = action_of(result, "Service", "nvidia-dcgm-dra")
    assert (action.action, action.reason) == ("delete", "ServiceDeleted")
    assert action.preconditions == {"uid": "uid-svc-nvidia-dcgm-dra", "resourceVersion": "42"}


def test_unmanaged_unneeded_objects_are_never_touched() -> None:
    result = plan(
        world(gpu_operator_service("nvidia-dcgm", CP), service_monitor("nvidia-dcgm-exporter")),
        Settings(),
    )
    assert result.actions == ()


def test_unneeded_object_held_by_a_foreign_owner_only_loses_our_refs() -> None:
    live = service("nvidia-dcgm", managed=True, owners=[cr_ref(CP), foreign_ref()])
    result = plan(world(live), Settings())
    action = action_of(result, "Service", "nvidia-dcgm")
    assert (action.action, action.reason, action.apply) == ("update", "OwnersChanged", None)
    assert action.json_patch[2] == {
        "op": "replace",
        "path": "/metadata/ownerReferences",
        "value": [foreign_ref()],
    }
    after = apply_plan(world(live), result)
    obj = find(after, "Service", "nvidia-dcgm")
    assert obj is not None and obj["metadata"]["ownerReferences"] == [foreign_ref()]
    assert action_of(plan(after, Settings()), "Service", "nvidia-dcgm").action == "skip"


def test_migration_cluster_policy_to_gpu_cluster_and_back() -> None:
    # CP alone, settled.
    w = settled(world(CP, stack("ClusterPolicy", common=False)))
    cp_uid = find(w, "Service", "nvidia-dcgm")["metadata"]["uid"]  # type: ignore[index]
    # GC arrives (gate closed for GC pods): both own the stable names, CP keeps its selector.
    w = with_objects(w, GC, *stack("GPUCluster", common=False))
    w = settled(w)
    dcgm = find(w, "Service", "nvidia-dcgm")
    assert dcgm is not None and owner_names(dcgm) == [
        "ClusterPolicy/cluster-policy",
        "GPUCluster/gpu-cluster",
    ]
    assert dcgm["spec"]["selector"] == {"app": "nvidia-dcgm"}
    assert dcgm["metadata"]["uid"] == cp_uid  # the same object kept serving
    # CP deleted: the stable names stay (GC needs them) and fall to the DRA label.
    w = without(w, "ClusterPolicy", "cluster-policy")
    result = plan(w, Settings())
    assert action_of(result, "Service", "nvidia-dcgm").reason == "SelectorMigrated"
    assert not any(a.action == "delete" for a in result.actions)
    w = settled(w)
    dcgm = find(w, "Service", "nvidia-dcgm")
    assert dcgm is not None and owner_names(dcgm) == ["GPUCluster/gpu-cluster"]
    assert dcgm["spec"]["selector"] == {"app": "nvidia-dcgm-dra"}
    # And back: a new ClusterPolicy, then the GPUCluster goes; -dra names are deleted.
    cp2 = cluster_policy("cp2", day=9)
    w = settled(with_objects(w, cp2))
    w = settled(without(w, "GPUCluster", "gpu-cluster"))
    assert sorted(s["metadata"]["name"] for s in w.services) == [
        "nvidia-dcgm",
        "nvidia-dcgm-exporter",
    ]
    dcgm = find(w, "Service", "nvidia-dcgm")
    assert dcgm is not None and owner_names(dcgm) == ["ClusterPolicy/cp2"]
    assert dcgm["metadata"]["uid"] == cp_uid


def test_several_cluster_policies_only_the_active_one_owns() -> None:
    old, new = cluster_policy("old", day=1), cluster_policy("new", day=4)
    w = settled(world(new, old))
    assert all(owner_names(s) == ["ClusterPolicy/old"] for s in w.services)
    # The active one is deleted: the next oldest takes over, objects stay.
    w = settled(without(w, "ClusterPolicy", "old"))
    assert len(w.services) == 2
    assert all(owner_names(s) == ["ClusterPolicy/new"] for s in w.services)


def test_cr_recreated_with_a_new_uid_replaces_the_stale_ref() -> None:
    w = settled(world(CP))
    reborn = cluster_policy(uid="uid-cp-reborn")
    w2 = with_objects(w, reborn)
    result = plan(w2, Settings())
    action = action_of(result, "Service", "nvidia-dcgm")
    assert action.reason == "OwnersChanged"
    assert action.json_patch[2]["value"] == [cr_ref(reborn)]
    w2 = settled(w2)
    assert all(s["metadata"]["ownerReferences"] == [cr_ref(reborn)] for s in w2.services)


def test_a_cr_being_deleted_loses_its_refs_the_other_keeps_the_objects() -> None:
    w = settled(world(CP, GC))
    w = with_objects(w, gpu_cluster(deleting=True))
    result = plan(w, Settings())
    assert {a.name for a in result.actions if a.action == "delete"} == {
        "nvidia-dcgm-dra",
        "nvidia-dcgm-exporter-dra",
    }
    w = settled(w)
    assert [owner_names(s) for s in w.services] == [["ClusterPolicy/cluster-policy"]] * 2


def test_both_crs_at_once_from_nothing() -> None:
    w = settled(world(CP, GC, stack("ClusterPolicy"), stack("GPUCluster")))
    assert len(w.services) == 4
    result = plan(w, Settings())
    assert all(a.action == "unchanged" for a in result.actions)


def test_converging_writes_nothing_and_reports_in_sync() -> None:
    w = settled(world(CP, GC))
    result = plan(w, Settings())
    assert result.writes == ()
    assert {a.reason for a in result.actions} == {"InSync"}
    assert not [r for r in result.reports if r.type == "Normal"]


def test_normal_reports_announce_writes_once_after_success() -> None:
    result = plan(world(CP), Settings())
    created = [r for r in result.reports if r.reason == "ServiceCreated"]
    assert {r.after_write for r in created} == {
        ("Service", "nvidia-dcgm"),
        ("Service", "nvidia-dcgm-exporter"),
    }
    assert len({r.key for r in created}) == 2
    again = plan(world(CP), Settings())
    assert [r.key for r in again.reports] == [r.key for r in result.reports]


def test_each_write_carries_the_reports_that_announce_it_and_no_other() -> None:
    created = plan(world(CP), Settings())
    gone = plan(World(services=settled(world(CP)).services), Settings())  # the CR deleted
    for result in (created, gone):
        announcing = [r for r in result.reports if r.after_write is not None]
        assert announcing
        carried = [r for a in result.actions for r in a.announces]
        assert sorted(carried, key=lambda r: r.key) == announcing
        for a in result.actions:
            assert all(r.after_write == (a.kind, a.name) for r in a.announces)
            assert a.action in ("create", "update", "delete") or not a.announces
