"""A projected cache never changes a plan: planning over ``daemonset_fields`` (what the
shared DaemonSet cache keeps) is planning over whole DaemonSets, for the Services planner
and for the driver-upgrade planner's DaemonSet index. Pods: test_pod_fields_props.py."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from proptests.strategies import json_values, set_at, settings_strategy, worlds
from proptests.test_pod_fields_props import fleshed_out
from shared_svc.k8s.projections import daemonset_fields
from shared_svc.reconcile.model import Settings, World
from shared_svc.reconcile.planner import plan
from shared_svc.reconcile.selectors import pod_fields
from shared_svc.upgrade.daemonsets import (
    CLIENT_HOOK_KEY,
    classify_daemonset,
    index_daemonsets,
    parked_label_key,
)

PARKED = parked_label_key("gpu")
# Where a DaemonSet's read fields live, and what a hostile or odd one may carry there.
PATHS = (
    ("metadata",),
    ("metadata", "name"),
    ("metadata", "namespace"),
    ("metadata", "uid"),
    ("metadata", "generation"),
    ("spec",),
    ("spec", "template"),
    ("spec", "template", "metadata"),
    ("spec", "template", "metadata", "labels"),
    ("spec", "template", "spec"),
    ("spec", "template", "spec", "affinity"),
    ("spec", "template", "spec", "nodeSelector"),
    ("status",),
    ("status", "observedGeneration"),
    ("status", "numberAvailable"),
    ("status", "desiredNumberScheduled"),
    ("status", "updatedNumberScheduled"),
)

terms = st.lists(
    st.fixed_dictionaries(
        {
            "matchExpressions": st.lists(
                st.fixed_dictionaries(
                    {
                        "key": st.sampled_from([PARKED, "other"]),
                        "operator": st.sampled_from(["DoesNotExist", "Exists"]),
                    }
                ),
                max_size=2,
            )
        }
    ),
    max_size=2,
)


@st.composite
def whole_daemonset(draw: st.DrawFn, ds: dict[str, Any]) -> dict[str, Any]:
    """``ds`` with what the API server and its controller add, a template spec the
    upgrade planner classifies, and maybe one odd value where planning reads."""
    out = copy.deepcopy(ds)
    meta = out.setdefault("metadata", {})
    meta.update(
        resourceVersion="42",
        creationTimestamp="2024-01-01T00:00:00Z",
        annotations={"deprecated.daemonset.template.generation": "1"},
        managedFields=[{"manager": "gpu-operator", "fieldsV1": {"f:spec": {}}}],
    )
    template = out.setdefault("spec", {}).setdefault("template", {})
    tspec = template.setdefault("spec", {})
    tspec["containers"] = [{"name": "c", "image": "i", "env": [{"name": "A", "value": "b"}]}]
    required = draw(terms)
    if required:
        tspec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": required}
            }
        }
    if draw(st.booleans()):
        tspec["nodeSelector"] = {CLIENT_HOOK_KEY: draw(st.sampled_from(["true", "false"]))}
    out.setdefault("status", {}).update(numberMisscheduled=0, currentNumberScheduled=1)
    if draw(st.booleans()):
        set_at(out, draw(st.sampled_from(PATHS)), draw(json_values))
    return out


@given(worlds(), settings_strategy, st.data())
def test_a_plan_over_projected_caches_is_the_plan_over_whole_objects(
    w: World, settings: Settings, data: st.DataObject
) -> None:
    whole = replace(
        w,
        daemonsets=tuple(data.draw(whole_daemonset(d)) for d in w.daemonsets),
        pods=tuple(data.draw(fleshed_out(p)) for p in w.pods),
    )
    cached = replace(
        whole,
        daemonsets=tuple(daemonset_fields(d) for d in whole.daemonsets),
        pods=tuple(pod_fields(p) for p in whole.pods),
    )
    assert plan(cached, settings) == plan(whole, settings)


@given(worlds(), st.data())
def test_the_upgrade_daemonset_index_over_projected_daemonsets_is_the_same(
    w: World, data: st.DataObject
) -> None:
    whole = [data.draw(whole_daemonset(d)) for d in w.daemonsets]
    # The upgrade planner reads well-typed DaemonSets (the API server validates them).
    whole = [d for d in whole if _well_typed(d)]
    cached = [daemonset_fields(d) for d in whole]
    assert [classify_daemonset(d, PARKED) for d in cached] == [
        classify_daemonset(d, PARKED) for d in whole
    ]
    assert index_daemonsets(cached, PARKED) == index_daemonsets(whole, PARKED)


def _well_typed(ds: dict[str, Any]) -> bool:
    try:
        index_daemonsets([ds], PARKED)
    except (AttributeError, TypeError):
        return False
    return True
