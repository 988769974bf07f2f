"""Declared DaemonSets and the one-time affinity opt-in."""

from __future__ import annotations

import copy

from shared_svc.upgrade.daemonsets import (
    classify_daemonset,
    index_daemonsets,
    owning_daemonset,
    parked_label_key,
    with_parked_requirement,
)
from testenv import upgrade_examples as ex

KEY = "nvidia.com/gpu-driver-upgrade.parked"
ZONE = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
GPU = {
    "matchExpressions": [{"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}]
}


def test_parked_label_key_for_drivers() -> None:
    assert parked_label_key("gpu") == KEY
    assert parked_label_key("ofed") == "nvidia.com/ofed-driver-upgrade.parked"


def test_classification() -> None:
    assert classify_daemonset(ex.daemonset("a", declared=True), KEY) == "declared"
    assert (
        classify_daemonset(ex.daemonset("a", declared=True, terms=[ZONE, GPU]), KEY) == "declared"
    )
    partial = ex.daemonset("a", declared=True, terms=[ZONE])
    partial["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"].append(GPU)
    assert classify_daemonset(partial, KEY) == "partial"
    hook = ex.daemonset("a", node_selector={"nvidia.com/gpu.deploy.client": "true"})
    assert classify_daemonset(hook, KEY) == "operator-hook"
    assert classify_daemonset(ex.daemonset("a"), KEY) == "other"
    assert (
        classify_daemonset(
            ex.daemonset("a", declared=True), "nvidia.com/ofed-driver-upgrade.parked"
        )
        == "other"
    )


def test_in_operator_is_not_a_declaration() -> None:
    ds = ex.daemonset(
        "a", terms=[{"matchExpressions": [{"key": KEY, "operator": "NotIn", "values": ["true"]}]}]
    )
    assert classify_daemonset(ds, KEY) == "other"


def _terms(ds):
    return ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]


def test_prepare_adds_to_every_term_and_is_idempotent() -> None:
    ds = ex.daemonset("a", terms=[ZONE, GPU])
    before = copy.deepcopy(ds)
    once = with_parked_requirement(ds, KEY)
    assert ds == before  # the input is not changed
    assert classify_daemonset(once, KEY) == "declared"
    assert [t["matchExpressions"][0] for t in _terms(once)] == [
        ZONE["matchExpressions"][0],
        GPU["matchExpressions"][0],
    ]
    assert all(
        t["matchExpressions"][-1] == {"key": KEY, "operator": "DoesNotExist"} for t in _terms(once)
    )
    assert with_parked_requirement(once, KEY) == once


def test_prepare_without_affinity_creates_one_term_and_keeps_other_affinity() -> None:
    ds = ex.daemonset("a")
    ds["spec"]["template"]["spec"]["affinity"] = {
        "podAntiAffinity": {"x": 1},
        "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [1]},
    }
    out = with_parked_requirement(ds, KEY)
    assert _terms(out) == [{"matchExpressions": [{"key": KEY, "operator": "DoesNotExist"}]}]
    affinity = out["spec"]["template"]["spec"]["affinity"]
    assert affinity["podAntiAffinity"] == {"x": 1}
    assert affinity["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == [1]


def test_prepare_keeps_match_fields() -> None:
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}
    out = with_parked_requirement(ex.daemonset("a", terms=[term]), KEY)
    assert _terms(out)[0]["matchFields"] == term["matchFields"]


def test_pods_are_matched_to_their_daemonset_by_uid() -> None:
    declared, other = ex.daemonset("dcgm", declared=True), ex.daemonset("fluentd")
    index = index_daemonsets([declared, other], KEY)
    ref = owning_daemonset(ex.daemonset_pod(declared), index)
    assert ref is not None and ref.key == "monitoring/dcgm" and ref.kind == "declared"
    assert owning_daemonset(ex.daemonset_pod(other), index) is None
    assert owning_daemonset(ex.pod("p"), index) is None


def test_client_hook_use_left_to_gpu_operator_never_scheduled_or_prepared_both_ways() -> None:
    from shared_svc.upgrade.daemonsets import client_hook_use, client_hook_uses

    hook = {"nvidia.com/gpu.deploy.client": "true"}
    plain = ex.daemonset("plain")
    hooked = ex.daemonset("hooked", node_selector=hook)
    both = ex.daemonset("both", node_selector=hook, declared=True)
    other = ex.daemonset("other", node_selector={"nvidia.com/gpu.deploy.client": "false"})
    assert client_hook_use(plain, KEY, True) is None
    assert client_hook_use(other, KEY, True) is None
    left = client_hook_use(hooked, KEY, True)
    assert left is not None and left.finding == "left-to-operator" and not left.warns
    assert "leaves it to gpu-operator" in left.message
    nowhere = client_hook_use(hooked, KEY, False)
    assert nowhere is not None and nowhere.finding == "never-schedules" and nowhere.warns
    assert "prepare-daemonset monitoring/hooked" in nowhere.message
    twice = client_hook_use(both, KEY, True)
    assert twice is not None and twice.finding == "both" and twice.warns
    assert [u.daemonset for u in client_hook_uses([plain, both, hooked], KEY, True)] == [
        "monitoring/both",
        "monitoring/hooked",
    ]
    assert client_hook_use(both, KEY, False).finding == "never-schedules"  # type: ignore[union-attr]
