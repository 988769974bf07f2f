"""Planning over the parts of pods that ``pod_fields`` keeps is planning over whole pods."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from proptests.strategies import json_values, set_at, settings_strategy, worlds
from shared_svc.k8s.objects import labels_of, name_of
from shared_svc.reconcile.model import Settings, World
from shared_svc.reconcile.planner import plan
from shared_svc.reconcile.selection import index_workloads, pod_fields
from tests.realistic import api_pod

# Where a pod's read fields live, and what a hostile or odd pod may carry there.
PATHS = (
    ("metadata",),
    ("metadata", "labels"),
    ("metadata", "name"),
    ("metadata", "namespace"),
    ("metadata", "deletionTimestamp"),
    ("spec",),
    ("spec", "nodeName"),
    ("status",),
    ("status", "conditions"),
)


@st.composite
def fleshed_out(draw: st.DrawFn, pod: Any) -> Any:
    """``pod`` with what the API server adds (managedFields, containers...) and maybe one odd value."""
    meta = pod["metadata"]
    full = api_pod(meta["labels"].get("app", "x"), meta["name"], "node")
    out = {**full, **pod}
    out["metadata"] = {**full["metadata"], **meta}
    out["spec"] = {**full["spec"], **pod.get("spec", {})}
    if "nodeName" not in pod.get("spec", {}):
        del out["spec"]["nodeName"]
    out["status"] = {**full["status"], **pod["status"]}
    out["status"]["conditions"] = [
        {**c, "lastTransitionTime": "2024-01-01T00:00:00Z", "reason": "r"}
        for c in pod["status"]["conditions"]
    ] + draw(st.lists(st.fixed_dictionaries({"type": st.text(max_size=5)}), max_size=1))
    if draw(st.booleans()):
        out["metadata"]["deletionTimestamp"] = "2024-01-02T00:00:00Z"  # terminating
    if draw(st.booleans()):
        set_at(out, draw(st.sampled_from(PATHS)), draw(json_values))
    return out


@given(worlds(), settings_strategy, st.data())
def test_a_plan_over_pod_fields_is_the_plan_over_whole_pods(
    w: World, settings: Settings, data: st.DataObject
) -> None:
    whole = replace(w, pods=tuple(data.draw(fleshed_out(p)) for p in w.pods))
    kept = replace(whole, pods=tuple(pod_fields(p) for p in whole.pods))
    assert plan(kept, settings) == plan(whole, settings)
    # And what planning derives from pods, which the plan shows only in some worlds.
    a, b = index_workloads(kept, settings.namespace), index_workloads(whole, settings.namespace)
    assert a.serving == b.serving
    assert {
        app: [(name_of(p), labels_of(p)) for p in pods] for app, pods in a.pods_by_app.items()
    } == {app: [(name_of(p), labels_of(p)) for p in pods] for app, pods in b.pods_by_app.items()}
