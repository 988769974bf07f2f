"""Contract section 9: a CR whose spec cannot be understood keeps exactly its ownership."""

from __future__ import annotations

from typing import Any

import pytest

from shared_svc.reconcile.model import Settings
from shared_svc.reconcile.planner import plan
from tests.worlds import (
    cluster_policy,
    cr_ref,
    find,
    gc_spec,
    gpu_cluster,
    manifest,
    owner_names,
    settled,
    with_objects,
    world,
)

BAD_SPECS: list[Any] = [
    5,
    "yes",
    [],
    {"dcgm": "yes"},
    {"dcgm": {"enabled": "true"}},
    {"dcgmExporter": {"service": {"type": "ExternalName"}}},
    {"dcgmExporter": {"service": {"internalTrafficPolicy": "local"}}},
    {"dcgmExporter": {"serviceMonitor": {"interval": "15 seconds"}}},
    {"dcgmExporter": {"serviceMonitor": {"scrapeTimeout": ""}}},
    {"dcgmExporter": {"serviceMonitor": {"honorLabels": "false"}}},
    {"dcgmExporter": {"serviceMonitor": {"additionalLabels": {"bad key!": "x"}}}},
    {"dcgmExporter": {"serviceMonitor": {"additionalLabels": {"k": "v" * 64}}}},
    # A trailing newline is no label (a regex's "$" used to let it through).
    {"dcgmExporter": {"serviceMonitor": {"additionalLabels": {"release\n": "x"}}}},
    {"dcgmExporter": {"serviceMonitor": {"additionalLabels": {"release": "x\n"}}}},
    {"dcgmExporter": {"serviceMonitor": {"relabelings": [1]}}},
    {"dcgmExporter": {"serviceMonitor": {"relabelings": {"a": 1}}}},
]


@pytest.mark.parametrize("bad", BAD_SPECS)
def test_invalid_spec_is_reported_and_keeps_ownership(bad: Any) -> None:
    cp = cluster_policy(
        spec={
            "dcgmExporter": {"service": {"type": "NodePort"}, "serviceMonitor": {"enabled": True}}
        }
    )
    w = settled(world(cp))
    broken = cluster_policy(spec=bad)
    result = plan(with_objects(w, broken), Settings())
    [error] = result.errors
    assert (error.kind, error.name, error.reason) == (
        "ClusterPolicy",
        "cluster-policy",
        "InvalidSpec",
    )
    assert any(
        r.reason == "InvalidSpec" and r.regarding.kind == "ClusterPolicy" for r in result.reports
    )
    assert not any(a.action == "delete" for a in result.actions)
    assert result.writes == ()  # nothing added, removed or changed on its account
    assert [o["metadata"]["name"] for o in result.objects] == [
        "nvidia-dcgm",
        "nvidia-dcgm-exporter",
        "nvidia-dcgm-exporter",
    ]
    assert (
        manifest(result, "Service", "nvidia-dcgm-exporter")["spec"]["type"] == "NodePort"
    )  # live value kept


def test_invalid_cr_owning_nothing_gains_nothing_while_the_other_is_reconciled() -> None:
    broken = cluster_policy(spec={"dcgm": 1})
    result = plan(world(broken, gpu_cluster()), Settings())
    assert [e.reason for e in result.errors] == ["InvalidSpec"]
    assert all(owner_names(o) == ["GPUCluster/gpu-cluster"] for o in result.objects)
    assert len(result.objects) == 4


def test_invalid_cr_still_counts_for_selectors_and_scrape() -> None:
    # The GPUCluster is broken but owns the alias: the canonical keeps the legacy label
    # and the alias keeps being scraped, as while it was valid.
    cp = cluster_policy()
    gc = gpu_cluster(spec=gc_spec(monitor={"enabled": True, "interval": "30s"}))
    w = settled(world(cp, gc))
    broken = gpu_cluster(spec={"dcgmExporter": {"enabled": "maybe"}})
    w2 = with_objects(w, broken)
    result = plan(w2, Settings())
    assert result.writes == ()
    alias = manifest(result, "Service", "nvidia-dcgm-exporter-dra")
    assert alias["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    sm = manifest(result, "ServiceMonitor", "nvidia-dcgm-exporter")
    assert sm["spec"]["endpoints"][0]["interval"] == "30s"
    assert sm["metadata"]["ownerReferences"] == [cr_ref(gc)]


def test_invalid_cr_keeps_its_ref_when_the_other_cr_leaves() -> None:
    cp, gc = cluster_policy(), gpu_cluster()
    w = settled(world(cp, gc))
    w = settled(with_objects(world(cluster_policy(spec=7)), *w.services))  # GC gone, CP broken
    dcgm = find(w, "Service", "nvidia-dcgm")
    assert dcgm is not None and owner_names(dcgm) == ["ClusterPolicy/cluster-policy"]
    assert find(w, "Service", "nvidia-dcgm-dra") is None  # GC's own objects go as usual
