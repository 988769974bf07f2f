"""Contract sections 1 and 2: which CRs count, and which Services each stack needs."""

from __future__ import annotations

import pytest

from shared_svc.reconcile.model import Settings
from shared_svc.reconcile.planner import plan
from shared_svc.reconcile.specs import parse_cr
from tests.worlds import cluster_policy, gc_spec, gpu_cluster, manifest, owner_names, world

ALL4 = ["nvidia-dcgm", "nvidia-dcgm-dra", "nvidia-dcgm-exporter", "nvidia-dcgm-exporter-dra"]


def names(world_, **settings: object) -> list[str]:
    result = plan(world_, Settings(**settings))  # type: ignore[arg-type]
    return [o["metadata"]["name"] for o in result.objects if o["kind"] == "Service"]


def test_legacy_stack_never_exposes_dra_names() -> None:
    assert names(world(cluster_policy())) == ["nvidia-dcgm", "nvidia-dcgm-exporter"]


def test_dra_deployment_exposes_both_established_and_dra_names() -> None:
    assert names(world(gpu_cluster())) == ALL4


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({}, []),  # GPUCluster defaults: DCGM off, no exporter block = no exporter
        ({"dcgm": {"enabled": True}}, ["nvidia-dcgm", "nvidia-dcgm-dra"]),
        ({"dcgmExporter": {}}, ["nvidia-dcgm-exporter", "nvidia-dcgm-exporter-dra"]),
        ({"dcgm": {}, "dcgmExporter": {"enabled": False}}, []),
    ],
)
def test_gpu_cluster_defaults(spec: dict[str, object], expected: list[str]) -> None:
    assert names(world(gpu_cluster(spec=spec))) == expected


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({}, ["nvidia-dcgm", "nvidia-dcgm-exporter"]),  # ClusterPolicy defaults: both on
        ({"dcgm": {"enabled": False}}, ["nvidia-dcgm-exporter"]),
        ({"dcgmExporter": {"enabled": False}}, ["nvidia-dcgm"]),
        ({"dcgm": {}, "dcgmExporter": {"service": {}}}, ["nvidia-dcgm", "nvidia-dcgm-exporter"]),
    ],
)
def test_cluster_policy_defaults(spec: dict[str, object], expected: list[str]) -> None:
    assert names(world(cluster_policy(spec=spec))) == expected


def test_service_monitor_is_off_unless_enabled_in_both_stacks() -> None:
    cp = parse_cr("ClusterPolicy", cluster_policy())
    gc = parse_cr("GPUCluster", gpu_cluster())
    assert not cp.service_monitor_on and not gc.service_monitor_on
    on = parse_cr(
        "GPUCluster", gpu_cluster(spec=gc_spec(exporter=False, monitor={"enabled": True}))
    )
    assert not on.service_monitor_on  # the exporter itself is off


def test_active_cluster_policy_is_the_oldest_then_lowest_name() -> None:
    older = cluster_policy("zeta", day=1)
    younger = cluster_policy("alpha", day=5)
    tie = cluster_policy("beta", day=1)
    result = plan(world(younger, older, tie), Settings())
    assert owner_names(manifest(result, "Service", "nvidia-dcgm")) == ["ClusterPolicy/beta"]


def test_a_deleting_cluster_policy_needs_nothing_and_is_not_chosen() -> None:
    dying = cluster_policy("a-old", day=1, deleting=True)
    alive = cluster_policy("b-new", day=3, spec={"dcgm": {"enabled": False}})
    result = plan(world(dying, alive), Settings())
    assert [o["metadata"]["name"] for o in result.objects] == ["nvidia-dcgm-exporter"]
    assert owner_names(result.objects[0]) == ["ClusterPolicy/b-new"]


def test_only_the_gpu_cluster_named_gpu_cluster_counts() -> None:
    assert names(world(gpu_cluster("other"))) == []


def test_a_deleting_gpu_cluster_needs_nothing() -> None:
    assert names(world(gpu_cluster(deleting=True))) == []


def test_parse_never_raises_on_odd_metadata() -> None:
    cr = parse_cr("ClusterPolicy", {"metadata": 5, "spec": None, "apiVersion": 3})
    assert cr.valid and cr.name == "" and cr.api_version == "nvidia.com/v1"
