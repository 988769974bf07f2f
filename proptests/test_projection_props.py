"""A projected cache never changes a plan: planning over ``daemonset_fields`` (what the
shared DaemonSet cache keeps) is planning over whole DaemonSets, for the Services planner
and for the driver-upgrade planner's DaemonSet index. Pods: test_pod_fields_props.py."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from proptests.strategies import json_values, set_at, settings_strategy, worlds
from proptests.test_pod_fields_props import fleshed_out
from shared_svc.controllers.services.caches import dcgm_pod_selectors
from shared_svc.k8s.objects import key_of, labels_of
from shared_svc.k8s.projections import DRIVER_CONFIG_DIGEST, daemonset_fields
from shared_svc.k8s.selectors import parse_selector
from shared_svc.kube.store import SharedValues
from shared_svc.reconcile.model import Settings, World
from shared_svc.reconcile.names import DRA_APP, LEGACY_APP, SERVICE_NAMES
from shared_svc.reconcile.planner import plan
from shared_svc.reconcile.selection import (
    covered_nodes,
    index_workloads,
    pod_fields,
    rule_selectors,
)
from shared_svc.upgrade.daemonsets import (
    CLIENT_HOOK_KEY,
    classify_daemonset,
    index_daemonsets,
    parked_label_key,
    template_spec,
)
from shared_svc.upgrade.paths import config_digest, verdict_holds
from shared_svc.upgrade.record import Record, RestartOnly

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
    ("spec", "template", "spec", "containers"),
    ("spec", "template", "spec", "initContainers"),
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


digest_entries = st.one_of(
    st.fixed_dictionaries(
        {"name": st.just(DRIVER_CONFIG_DIGEST), "value": st.sampled_from(["", "abc", "xyz"])}
    ),
    st.just({"name": DRIVER_CONFIG_DIGEST, "valueFrom": {"fieldRef": {"fieldPath": "x"}}}),
    st.just({"name": "OTHER", "value": "abc"}),
    st.just({"name": DRIVER_CONFIG_DIGEST}),
    json_values,
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
    for key in draw(st.lists(st.sampled_from(["containers", "initContainers"]), max_size=2)):
        # gpu-operator's driver template: the digest on its containers, maybe several forms
        env = draw(st.lists(digest_entries, max_size=3))
        tspec.setdefault(key, []).insert(draw(st.integers(0, 1)), {"name": "d", "env": env})
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


@given(worlds(), st.data())
def test_the_restart_only_rule_over_projected_daemonsets_is_the_same(
    w: World, data: st.DataObject
) -> None:
    """The digest of a cached DaemonSet's template is the whole one's (any container
    layout, any form of the env entry, odd values where planning reads)."""
    whole = [data.draw(whole_daemonset(d)) for d in w.daemonsets]
    for ds in whole:
        cached = daemonset_fields(ds)
        assert config_digest(template_spec(cached)) == config_digest(template_spec(ds))
        rec = replace(
            Record.new(0.0, parked_label=False),
            restart_only=RestartOnly(key_of(ds), config_digest(template_spec(ds)) or "abc"),
        )
        assert verdict_holds(rec, [cached]) == verdict_holds(rec, [ds])


def _well_typed(ds: dict[str, Any]) -> bool:
    try:
        index_daemonsets([ds], PARKED)
    except (AttributeError, TypeError):
        return False
    return True


# --- issue 22: the operator-pod cache holds only the DCGM pods (shared_svc.controllers.services.caches) ---

DCGM_SELECTORS = tuple(parse_selector(s) for s in dcgm_pod_selectors())
DCGM_LABEL_KEYS = ("app", "nvidia.com/gpu-operator.dcgm", "nvidia.com/gpu-operator.dcgm-exporter")
label_sets = st.dictionaries(
    st.sampled_from(DCGM_LABEL_KEYS),
    st.sampled_from(["true", "false", "nvidia-dcgm", "nvidia-dcgm-exporter-dra", "nvidia-driver"]),
)


def _watched(pod: Any) -> bool:
    labels = labels_of(pod)
    return any(s.matches(labels) for s in DCGM_SELECTORS)


@given(worlds(), settings_strategy, st.data())
def test_a_plan_over_the_dcgm_pods_is_the_plan_over_every_pod_of_the_namespace(
    w: World, settings: Settings, data: st.DataObject
) -> None:
    """Planning reads the pods of the four DCGM apps (the gate) and the pods a rule
    selector (an ``app`` or a common label) selects (the hold): the cache of the union of
    the six selectors plans as the whole namespace does, other operands included."""
    # Each pod again as another operand's (another ``app``, or none), with its common
    # labels or others drawn: the pods of the namespace a DCGM-only cache must not miss
    # (a common label alone) and those it must not need (neither).
    others = tuple(
        {
            **p,
            "metadata": {
                **p["metadata"],
                "name": f"other-{p['metadata']['name']}",
                "labels": {
                    **{k: v for k, v in labels_of(p).items() if k != "app"},
                    **data.draw(label_sets),
                    **data.draw(st.sampled_from([{}, {"app": "nvidia-driver-daemonset"}])),
                },
            },
        }
        for p in w.pods
    )
    whole = replace(w, pods=w.pods + others)
    watched = replace(whole, pods=tuple(p for p in whole.pods if _watched(p)))
    assert plan(watched, settings) == plan(whole, settings)
    # What planning derives from pods, for every selector the rules can give a stable
    # name (the hold's coverage) and every DCGM app (the gate), in worlds whose plans
    # may not show it.
    a = index_workloads(watched, settings.namespace)
    b = index_workloads(whole, settings.namespace)
    for name in SERVICE_NAMES:
        for selector in rule_selectors(name):
            assert covered_nodes(selector, a) == covered_nodes(selector, b), selector
    for app in {*LEGACY_APP.values(), *DRA_APP.values()}:
        assert a.pods_by_app.get(app) == b.pods_by_app.get(app)


@given(label_sets)
def test_each_pod_is_selected_by_at_most_one_dcgm_selector(labels: dict[str, str]) -> None:
    """Disjoint: one list+watch, one copy in memory per pod."""
    assert sum(s.matches(labels) for s in DCGM_SELECTORS) <= 1


# --- issue 22: the compact store (kube.store.SharedValues) ---


@given(st.lists(json_values, max_size=6))
def test_shared_values_are_the_values_they_replace_to_the_type(values: list[Any]) -> None:
    """Sharing never changes a value: equal, and of the same JSON (``True == 1`` in
    Python, but a shared ``1`` must not become ``True``)."""
    shared = SharedValues()
    objects = [
        {"metadata": {"name": str(i)}, "spec": v, "status": [v, {"x": v}]}
        for i, v in enumerate(values)
    ]
    for obj, out in zip(objects, [shared(copy.deepcopy(o)) for o in objects], strict=True):
        assert out == obj
        assert json.dumps(out, sort_keys=True) == json.dumps(obj, sort_keys=True)


@given(worlds(), settings_strategy, st.data())
def test_a_plan_over_the_compact_pod_store_is_the_plan_over_whole_pods(
    w: World, settings: Settings, data: st.DataObject
) -> None:
    """The pods as the cache keeps them (``pod_fields``, repeated subtrees shared by one
    ``SharedValues`` across the store) plan as the whole pods do."""
    whole = replace(w, pods=tuple(data.draw(fleshed_out(p)) for p in w.pods))
    shared = SharedValues(limit=data.draw(st.sampled_from([2, 65_536])))
    kept = replace(whole, pods=tuple(shared(pod_fields(copy.deepcopy(p))) for p in whole.pods))
    assert plan(kept, settings) == plan(whole, settings)
