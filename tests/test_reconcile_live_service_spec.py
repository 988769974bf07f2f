"""The live Service's spec as the plan reads it: ports other managers added are not ours to
compare, ours changed are repaired, and a spec that is not an object does not stop the plan.
Each test names the contract rule it holds."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from shared_svc.reconcile.model import Settings
from shared_svc.reconcile.planner import plan
from tests.worlds import (
    action_of,
    cluster_policy,
    find,
    gc_spec,
    gpu_cluster,
    settled,
    with_objects,
    world,
)


# Sections 3/5 and the core's promise to take partial objects: a managed Service whose spec
# is not an object gets its selector set (SelectorMigrated) instead of crashing the plan.
@pytest.mark.parametrize("odd_spec", [None, "x", 1, []])
def test_selector_migrated_report_with_odd_live_spec_never_raises(odd_spec: Any) -> None:
    w = settled(world(cluster_policy()))
    svc = copy.deepcopy(find(w, "Service", "nvidia-dcgm"))
    assert svc is not None
    svc["spec"] = odd_spec
    result = plan(with_objects(w, svc), Settings())
    action = action_of(result, "Service", "nvidia-dcgm")
    assert (action.action, action.reason) == ("update", "SelectorMigrated")
    assert any(r.reason == "SelectorMigrated" for r in result.reports)


# Section 5: "Fields set only by the server or other managers are not ours to compare."
# Service ports are a list map keyed by (port, protocol): a port another manager added
# survives our apply, so comparing it would make every reconcile write, forever.
def test_port_added_by_another_manager_is_not_ours_to_compare() -> None:
    w = settled(world(cluster_policy(), gpu_cluster(spec=gc_spec())))
    for name in ("nvidia-dcgm", "nvidia-dcgm-exporter"):
        svc = copy.deepcopy(find(w, "Service", name))
        assert svc is not None
        svc["spec"]["ports"].append(
            {"name": "extra", "port": 9999, "targetPort": 9999, "protocol": "TCP"}
        )
        assert plan(with_objects(w, svc), Settings()).writes == ()


def test_our_port_changed_by_another_manager_is_still_repaired() -> None:
    w = settled(world(cluster_policy()))
    svc = copy.deepcopy(find(w, "Service", "nvidia-dcgm"))
    assert svc is not None
    svc["spec"]["ports"][0]["targetPort"] = 6666
    action = action_of(plan(with_objects(w, svc), Settings()), "Service", "nvidia-dcgm")
    assert action.action == "update" and "spec.ports" in action.changed_fields
    svc["spec"]["ports"] = [
        {"name": "other", "port": 1234, "targetPort": 1234, "protocol": "TCP"}
    ]  # ours is gone
    action = action_of(plan(with_objects(w, svc), Settings()), "Service", "nvidia-dcgm")
    assert action.action == "update" and "spec.ports" in action.changed_fields
