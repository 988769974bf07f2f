"""Contract section 4: the gate, the selector of each name, upgrade safety."""

from __future__ import annotations

from shared_svc.reconcile.model import Plan, Settings, World
from shared_svc.reconcile.planner import plan
from shared_svc.reconcile.selection import gate_open, index_workloads
from tests.worlds import (
    cluster_policy,
    daemonset,
    gpu_cluster,
    manifest,
    pod,
    stack,
    world,
)

COMMON_DCGM = {"nvidia.com/gpu-operator.dcgm": "true"}


def selector(result: Plan, name: str) -> dict[str, str]:
    selected: dict[str, str] = manifest(result, "Service", name)["spec"]["selector"]
    return selected


def selected_pods(w: World, result: Plan, name: str) -> list[str]:
    chosen = selector(result, name)
    return sorted(
        p["metadata"]["name"]
        for p in w.pods
        if all(p["metadata"]["labels"].get(k) == v for k, v in chosen.items())
    )


def cp_dcgm_world(*workloads: object) -> World:
    return world(cluster_policy(spec={"dcgmExporter": {"enabled": False}}), *workloads)  # type: ignore[arg-type]


def test_old_pods_with_the_new_operator_keep_the_app_selector() -> None:
    w = cp_dcgm_world(stack("ClusterPolicy", common=False, components=["dcgm"]))
    result = plan(w, Settings())
    assert selector(result, "nvidia-dcgm") == {"app": "nvidia-dcgm"}
    assert selected_pods(w, result, "nvidia-dcgm") == ["nvidia-dcgm-0", "nvidia-dcgm-1"]
    assert result.pending == ()  # one stack waiting for its own rollout is not reported


def test_rollout_half_done_keeps_the_app_selector() -> None:
    w = cp_dcgm_world(
        daemonset(
            "nvidia-dcgm", common=True, desired=2, updated=1, available=2, generation=2, observed=2
        ),
        pod("nvidia-dcgm", "new", common=True),
        pod("nvidia-dcgm", "old", common=False),
    )
    result = plan(w, Settings())
    assert selector(result, "nvidia-dcgm") == {"app": "nvidia-dcgm"}
    assert selected_pods(w, result, "nvidia-dcgm") == ["new", "old"]


def test_all_pods_new_switches_to_the_common_label() -> None:
    w = cp_dcgm_world(stack("ClusterPolicy", common=True, components=["dcgm"]))
    result = plan(w, Settings())
    assert selector(result, "nvidia-dcgm") == COMMON_DCGM
    assert selected_pods(w, result, "nvidia-dcgm") == ["nvidia-dcgm-0", "nvidia-dcgm-1"]


def test_on_delete_with_stragglers_keeps_the_app_selector() -> None:
    # OnDelete: the DaemonSet status looks complete, but an old pod was never replaced.
    w = cp_dcgm_world(
        daemonset("nvidia-dcgm", common=True, desired=2, on_delete=True),
        pod("nvidia-dcgm", "replaced", common=True),
        pod("nvidia-dcgm", "straggler", common=False),
    )
    result = plan(w, Settings())
    assert selector(result, "nvidia-dcgm") == {"app": "nvidia-dcgm"}
    gate = next(s for s in result.status if s.name == "nvidia-dcgm").gates[0]
    assert not gate.open
    assert any("straggler" in c for c in gate.failing)


def test_unobserved_generation_closes_the_gate() -> None:
    workloads = index_workloads(
        world(daemonset("nvidia-dcgm", generation=3, observed=2)), "gpu-operator"
    )
    gate = gate_open("ClusterPolicy", "dcgm", workloads)
    assert not gate.open and "observedGeneration 2 < generation 3" in gate.failing[0]


def test_missing_daemonset_or_status_closes_the_gate() -> None:
    assert gate_open(
        "GPUCluster", "exporter", index_workloads(world(), "gpu-operator")
    ).failing == ("DaemonSet nvidia-dcgm-exporter-dra not found",)
    ds = daemonset("nvidia-dcgm-dra")
    ds["metadata"]["generation"] = 2
    del ds["status"]
    gate = gate_open("GPUCluster", "dcgm", index_workloads(world(ds), "gpu-operator"))
    assert not gate.open


def test_a_terminating_unlabelled_pod_still_holds_the_gate() -> None:
    w = cp_dcgm_world(
        stack("ClusterPolicy", common=True, components=["dcgm"]),
        pod("nvidia-dcgm", "leaving", common=False, deleting=True),
    )
    assert selector(plan(w, Settings()), "nvidia-dcgm") == {"app": "nvidia-dcgm"}


def test_a_rollback_that_removes_the_labels_falls_back() -> None:
    migrated = cp_dcgm_world(stack("ClusterPolicy", common=True, components=["dcgm"]))
    assert selector(plan(migrated, Settings()), "nvidia-dcgm") == COMMON_DCGM
    rolled_back = cp_dcgm_world(
        daemonset("nvidia-dcgm", common=False, desired=2, updated=1, generation=3, observed=3),
        pod("nvidia-dcgm", "nvidia-dcgm-0", common=True),
        pod("nvidia-dcgm", "nvidia-dcgm-1", common=False),
    )
    result = plan(rolled_back, Settings())
    assert selector(result, "nvidia-dcgm") == {"app": "nvidia-dcgm"}
    assert selected_pods(rolled_back, result, "nvidia-dcgm") == ["nvidia-dcgm-0", "nvidia-dcgm-1"]


def test_selector_mode_app_never_uses_the_common_label() -> None:
    w = cp_dcgm_world(stack("ClusterPolicy", common=True, components=["dcgm"]))
    assert selector(plan(w, Settings(selector_mode="app")), "nvidia-dcgm") == {"app": "nvidia-dcgm"}


def test_dra_names_always_select_the_dra_app_label() -> None:
    w = world(gpu_cluster(), stack("GPUCluster", common=True))
    result = plan(w, Settings())
    assert selector(result, "nvidia-dcgm-dra") == {"app": "nvidia-dcgm-dra"}
    assert selector(result, "nvidia-dcgm-exporter-dra") == {"app": "nvidia-dcgm-exporter-dra"}
    assert selector(result, "nvidia-dcgm") == COMMON_DCGM


def test_dra_aliases_of_stable_names_start_on_the_dra_label() -> None:
    w = world(gpu_cluster(), stack("GPUCluster", common=False))
    result = plan(w, Settings())
    assert selector(result, "nvidia-dcgm") == {"app": "nvidia-dcgm-dra"}
    assert selector(result, "nvidia-dcgm-exporter") == {"app": "nvidia-dcgm-exporter-dra"}


def test_both_stacks_with_gate_closed_prefer_the_legacy_label_and_report_pending() -> None:
    w = world(
        cluster_policy(),
        gpu_cluster(),
        stack("ClusterPolicy", common=True),
        stack("GPUCluster", common=False),
    )
    result = plan(w, Settings())
    assert selector(result, "nvidia-dcgm") == {"app": "nvidia-dcgm"}
    pending = {p.object: p for p in result.pending}
    assert set(pending) == {"Service/nvidia-dcgm", "Service/nvidia-dcgm-exporter"}
    message = pending["Service/nvidia-dcgm"].message
    assert "GPUCluster (DRA)" in message and "nvidia-dcgm-dra-0" in message
    assert any(
        r.reason == "SelectorMigrationPending" and r.type == "Warning" for r in result.reports
    )
    # Every ready pod of both stacks stays selected: legacy ones by the stable name,
    # DRA ones by their -dra name.
    assert selected_pods(w, result, "nvidia-dcgm") == ["nvidia-dcgm-0", "nvidia-dcgm-1"]
    assert selected_pods(w, result, "nvidia-dcgm-dra") == ["nvidia-dcgm-dra-0", "nvidia-dcgm-dra-1"]


def test_both_stacks_with_gate_open_select_the_pods_of_both() -> None:
    w = world(cluster_policy(), gpu_cluster(), stack("ClusterPolicy"), stack("GPUCluster"))
    result = plan(w, Settings())
    assert selected_pods(w, result, "nvidia-dcgm") == [
        "nvidia-dcgm-0",
        "nvidia-dcgm-1",
        "nvidia-dcgm-dra-0",
        "nvidia-dcgm-dra-1",
    ]
    assert result.pending == ()


def test_app_mode_reports_no_pending_migration() -> None:
    w = world(
        cluster_policy(), gpu_cluster(), stack("ClusterPolicy"), stack("GPUCluster", common=False)
    )
    assert plan(w, Settings(selector_mode="app")).pending == ()


def test_status_shows_selector_needers_and_gates() -> None:
    w = world(
        cluster_policy(), gpu_cluster(), stack("ClusterPolicy"), stack("GPUCluster", common=False)
    )
    status = {s.name: s for s in plan(w, Settings()).status}
    dcgm = status["nvidia-dcgm"]
    assert dcgm.needed_by == ("ClusterPolicy/cluster-policy", "GPUCluster/gpu-cluster")
    assert dcgm.selector == {"app": "nvidia-dcgm"}
    assert [(g.stack, g.open) for g in dcgm.gates] == [
        ("ClusterPolicy", True),
        ("GPUCluster", False),
    ]
