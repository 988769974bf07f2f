"""Contract sections 3 and 6: the shape of each Service and conflicts between the CRs."""

from __future__ import annotations

from shared_svc.reconcile.model import ConflictValue, Settings
from shared_svc.reconcile.planner import plan
from tests.worlds import cluster_policy, gc_spec, gpu_cluster, manifest, world


def exporter_cfg(**service: str) -> dict[str, object]:
    return {"dcgmExporter": {"service": service}}


def test_dcgm_services_are_cluster_ip_local_on_port_5555() -> None:
    result = plan(world(gpu_cluster()), Settings())
    for name in ("nvidia-dcgm", "nvidia-dcgm-dra"):
        svc = manifest(result, "Service", name)
        assert svc["spec"]["type"] == "ClusterIP"
        assert svc["spec"]["internalTrafficPolicy"] == "Local"
        assert svc["spec"]["ports"] == [
            {"name": "dcgm", "port": 5555, "targetPort": 5555, "protocol": "TCP"}
        ]
        assert "prometheus.io/scrape" not in svc["metadata"]["annotations"]


def test_labels_are_app_and_managed_by_never_the_state_label() -> None:
    result = plan(world(gpu_cluster()), Settings())
    for obj in result.objects:
        assert obj["metadata"]["labels"] == {
            "app": obj["metadata"]["name"],
            "app.kubernetes.io/managed-by": "shared-svc",
        }


def test_exporter_settings_unset_are_left_out() -> None:
    svc = manifest(plan(world(cluster_policy()), Settings()), "Service", "nvidia-dcgm-exporter")
    assert "type" not in svc["spec"] and "internalTrafficPolicy" not in svc["spec"]
    assert svc["spec"]["ports"] == [
        {"name": "gpu-metrics", "port": 9400, "targetPort": 9400, "protocol": "TCP"}
    ]


def test_exporter_aliases_preserve_the_supported_service_configuration() -> None:
    gc = gpu_cluster(spec=gc_spec(service={"type": "NodePort", "internalTrafficPolicy": "Local"}))
    result = plan(world(gc), Settings())
    for name in ("nvidia-dcgm-exporter", "nvidia-dcgm-exporter-dra"):
        spec = manifest(result, "Service", name)["spec"]
        assert (spec["type"], spec["internalTrafficPolicy"]) == ("NodePort", "Local")


def test_no_api_assigned_fields_in_manifests() -> None:
    result = plan(world(cluster_policy(spec=exporter_cfg(type="LoadBalancer"))), Settings())
    for obj in result.objects:
        assert not {
            "clusterIP",
            "clusterIPs",
            "ipFamilies",
            "ipFamilyPolicy",
            "healthCheckNodePort",
        } & set(obj["spec"])
        assert all("nodePort" not in p for p in obj["spec"].get("ports", []))
        assert not {"uid", "resourceVersion", "creationTimestamp", "managedFields"} & set(
            obj["metadata"]
        )


def test_conflicting_exporter_type_oldest_wins_and_loser_is_reported() -> None:
    cp = cluster_policy(day=1, spec=exporter_cfg(type="NodePort"))
    gc = gpu_cluster(day=5, spec=gc_spec(service={"type": "LoadBalancer"}))
    result = plan(world(gc, cp), Settings())
    assert manifest(result, "Service", "nvidia-dcgm-exporter")["spec"]["type"] == "NodePort"
    # The -dra alias is needed by GPUCluster alone: its own setting, no conflict.
    assert manifest(result, "Service", "nvidia-dcgm-exporter-dra")["spec"]["type"] == "LoadBalancer"
    [conflict] = result.conflicts
    assert (conflict.object, conflict.field) == ("Service/nvidia-dcgm-exporter", "spec.type")
    assert conflict.winner == ConflictValue("ClusterPolicy", "cluster-policy", "NodePort")
    assert conflict.losers == (ConflictValue("GPUCluster", "gpu-cluster", "LoadBalancer"),)
    [report] = [r for r in result.reports if r.reason == "ServiceConfigConflict"]
    assert report.type == "Warning"
    assert (report.regarding.kind, report.regarding.name, report.regarding.namespace) == (
        "GPUCluster",
        "gpu-cluster",
        None,
    )
    assert (
        "spec.type" in report.note and "LoadBalancer" in report.note and "NodePort" in report.note
    )
    assert len(report.note.encode()) <= 1024


def test_the_younger_cr_wins_nothing_even_when_listed_first() -> None:
    cp = cluster_policy(day=9, spec=exporter_cfg(internalTrafficPolicy="Local"))
    gc = gpu_cluster(day=2, spec=gc_spec(service={"internalTrafficPolicy": "Cluster"}))
    for order in ((cp, gc), (gc, cp)):
        result = plan(world(*order), Settings())
        assert (
            manifest(result, "Service", "nvidia-dcgm-exporter")["spec"]["internalTrafficPolicy"]
            == "Cluster"
        )
        assert result.conflicts[0].winner.kind == "GPUCluster"


def test_an_unset_value_never_conflicts() -> None:
    cp = cluster_policy(day=1)
    gc = gpu_cluster(day=5, spec=gc_spec(service={"type": "NodePort"}))
    result = plan(world(cp, gc), Settings())
    assert result.conflicts == ()
    assert manifest(result, "Service", "nvidia-dcgm-exporter")["spec"]["type"] == "NodePort"


def test_equal_values_do_not_conflict() -> None:
    cp = cluster_policy(spec=exporter_cfg(type="NodePort"))
    gc = gpu_cluster(spec=gc_spec(service={"type": "NodePort"}))
    assert plan(world(cp, gc), Settings()).conflicts == ()


def test_timestamp_ties_break_by_api_version() -> None:
    cp = cluster_policy(day=3, spec=exporter_cfg(type="NodePort"))
    gc = gpu_cluster(day=3, spec=gc_spec(service={"type": "LoadBalancer"}))
    # nvidia.com/v1 < nvidia.com/v1alpha1
    assert plan(world(gc, cp), Settings()).conflicts[0].winner.kind == "ClusterPolicy"
