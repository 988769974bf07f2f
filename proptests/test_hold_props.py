"""Property of section 4's hold (``nvidia-dcgm`` only): no world and no sequence of worlds makes
it cover fewer nodes than before, except when the pods themselves go. The exporter name does not
hold; its property is in test_scrape_coverage_props.py."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from proptests.strategies import crs, settings_strategy, workloads, worlds
from shared_svc.k8s.objects import K8sObject
from shared_svc.reconcile.model import Settings, World
from shared_svc.reconcile.planner import plan
from shared_svc.reconcile.selection import covered_nodes, index_workloads, rule_selectors
from tests.worlds import apply_plan, find

HOLDING = ("nvidia-dcgm",)


def _ours(obj: K8sObject | None) -> bool:
    labels = (obj or {}).get("metadata", {}).get("labels", {})
    return bool(labels.get("app.kubernetes.io/managed-by") == "shared-svc")


@given(worlds(), st.lists(st.tuples(crs(), workloads()), min_size=1, max_size=3), settings_strategy)
def test_nvidia_dcgm_never_covers_fewer_nodes_while_its_pods_stay(
    w: World, steps: list[tuple[list[K8sObject], list[K8sObject]]], settings: Settings
) -> None:
    current = apply_plan(w, plan(w, settings))
    for cr_objs, rollout in steps:
        # The CRs and the DaemonSets change (created, deleted, rolled, rolled back); the
        # pods, and so the nodes each selector covers, stay.
        nxt = replace(
            current,
            cluster_policies=tuple(o for o in cr_objs if o["kind"] == "ClusterPolicy"),
            gpu_clusters=tuple(o for o in cr_objs if o["kind"] == "GPUCluster"),
            daemonsets=tuple(o for o in rollout if o["kind"] == "DaemonSet"),
        )
        after = apply_plan(nxt, plan(nxt, settings))
        pods = index_workloads(after, settings.namespace)
        for name in HOLDING:
            before_svc, after_svc = find(current, "Service", name), find(after, "Service", name)
            if not (_ours(before_svc) and _ours(after_svc)):
                continue  # created, deleted or released: no move of ours to judge
            assert before_svc is not None and after_svc is not None
            old, new = before_svc["spec"]["selector"], after_svc["spec"]["selector"]
            if old not in rule_selectors(name):
                continue
            lost = covered_nodes(old, pods) - covered_nodes(new, pods)
            assert not lost, (name, old, new, sorted(lost))
        current = after
