"""Scrape targets: which ServiceMonitors count as duplicates of an exporter Service
(DuplicateScrapeTarget), and the selector of our ServiceMonitor when it has nothing to select.
Each test names the contract rule it holds."""

from __future__ import annotations

from typing import Any

import pytest

from shared_svc.k8s.selectors import SelectorError, label_selector
from shared_svc.reconcile.model import Plan, Settings
from shared_svc.reconcile.planner import plan
from tests.worlds import (
    action_of,
    cluster_policy,
    foreign_ref,
    gpu_cluster,
    manifest,
    service,
    service_monitor,
    settled,
    stack,
    world,
)

SM_ON = {"enabled": True}


def duplicates(result: Plan) -> list[str]:
    return sorted(p.object for p in result.pending if p.reason == "DuplicateScrapeTarget")


# Section 7: "A ServiceMonitor in the namespace ... that selects ... an exporter Service with
# scrape "false", is reported as DuplicateScrapeTarget". prometheus-operator reads a
# namespaceSelector with any=false and no matchNames (or an empty matchNames list) as "the
# ServiceMonitor's own namespace", exactly like an empty namespaceSelector.
@pytest.mark.parametrize(
    "namespace_selector",
    [{"any": False}, {"matchNames": []}, {"any": False, "matchNames": None}, {}],
)
def test_duplicate_scrape_target_namespace_selector_defaults_to_own_namespace(
    namespace_selector: dict[str, Any],
) -> None:
    leftover = service_monitor("dra-exporter", match_labels={"app": "nvidia-dcgm-exporter-dra"})
    leftover["spec"]["namespaceSelector"] = namespace_selector
    w = world(gpu_cluster(), stack("GPUCluster"), leftover)
    result = plan(w, Settings())
    assert (
        manifest(result, "Service", "nvidia-dcgm-exporter-dra")["metadata"]["annotations"][
            "prometheus.io/scrape"
        ]
        == "false"
    )
    assert duplicates(result) == ["ServiceMonitor/dra-exporter"]


def test_duplicate_scrape_target_other_namespace_only_is_not_reported() -> None:
    leftover = service_monitor("dra-exporter", match_labels={"app": "nvidia-dcgm-exporter-dra"})
    leftover["spec"]["namespaceSelector"] = {"matchNames": ["elsewhere"]}
    result = plan(world(gpu_cluster(), stack("GPUCluster"), leftover), Settings())
    assert duplicates(result) == []


# The core is total over partial dicts (objects.py): an odd selector in somebody else's
# ServiceMonitor must not stop the reconcile of the whole namespace.
@pytest.mark.parametrize(
    "selector",
    [
        {"matchExpressions": 1},
        {"matchExpressions": [{"key": "app", "operator": "In", "values": 5}]},
        {"matchExpressions": [{"key": "app", "operator": "NotIn", "values": True}]},
        {"matchLabels": {"app": "nvidia-dcgm-exporter"}, "matchExpressions": {"a": 1}},
    ],
)
def test_odd_unmanaged_service_monitor_selector_never_raises(selector: dict[str, Any]) -> None:
    odd = service_monitor("odd")
    odd["spec"]["selector"] = selector
    result = plan(world(gpu_cluster(), stack("GPUCluster"), odd), Settings())
    assert duplicates(result) == []
    with pytest.raises(SelectorError):  # invalid: it selects nothing (the plan skips it)
        label_selector(selector)


# Section 7: the ServiceMonitor "selects ... exactly the exporter Services that will carry
# prometheus.io/scrape "true" after the plan". When none of them is ours (the canonical one
# is not adopted), that is the empty set, written as a selector prometheus-operator accepts:
# `In` with an empty value list is an invalid label selector (LabelSelectorAsSelector fails)
# and prometheus-operator rejects the whole ServiceMonitor.
@pytest.mark.parametrize("adopt", [True, False])
def test_service_monitor_with_nothing_to_select_has_a_valid_selector(adopt: bool) -> None:
    cp = cluster_policy(spec={"dcgmExporter": {"serviceMonitor": SM_ON}})
    foreign = service(
        "nvidia-dcgm-exporter",
        owners=[foreign_ref()] if adopt else [],
        annotations={"prometheus.io/scrape": "true"},
    )
    result = plan(world(cp, stack("ClusterPolicy"), foreign), Settings(adopt=adopt))
    assert action_of(result, "Service", "nvidia-dcgm-exporter").action == "skip"
    sm = manifest(result, "ServiceMonitor", "nvidia-dcgm-exporter")
    selector = sm["spec"]["selector"]
    for expr in selector.get("matchExpressions", []):
        if expr["operator"] in ("In", "NotIn"):
            assert expr["values"], "In/NotIn with no values is an invalid label selector"
        else:
            assert "values" not in expr or not expr["values"]
    # It selects none of the exporter Services, ours or not, whatever labels they carry.
    for labels in (
        {"app": "nvidia-dcgm-exporter"},
        {"app": "nvidia-dcgm-exporter", "app.kubernetes.io/managed-by": "shared-svc"},
        {"app": "nvidia-dcgm-exporter-dra", "app.kubernetes.io/managed-by": "shared-svc"},
        {"app.kubernetes.io/managed-by": "shared-svc"},
    ):
        assert not label_selector(selector).matches(labels)
    # And a settled world stays settled: the same plan again writes nothing new.
    after = settled(world(cp, stack("ClusterPolicy"), foreign), Settings(adopt=adopt))
    assert plan(after, Settings(adopt=adopt)).writes == ()


def test_service_monitor_with_nothing_to_select_reports_no_duplicates() -> None:
    cp = cluster_policy(spec={"dcgmExporter": {"serviceMonitor": SM_ON}})
    foreign = service("nvidia-dcgm-exporter", owners=[foreign_ref()])
    other = service_monitor("other", match_labels={"app": "nvidia-dcgm-exporter"})
    result = plan(world(cp, stack("ClusterPolicy"), foreign, other), Settings())
    assert duplicates(result) == []
