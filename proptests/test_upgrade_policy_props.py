"""Properties of the upgrade policy's source (``upgrade/policy.py``) and of the gate judged
where gpu-operator reads it (``upgrade/gate.py``), over any world of ClusterPolicies (either
mode, sandbox or not), NVIDIADrivers (any policy, or none), either NVIDIADriver CRD (v26.7's
with ``upgradePolicy``, v25.3.4's without) and nodes with any owner label (issue 42):

- the mode is gpu-operator's: ClusterPolicy mode exactly when the active ClusterPolicy does not
  set ``useNvidiaDriverCRD`` or the CRD has no policy (v25.3.4); NVIDIADriver mode otherwise,
  with or without a ClusterPolicy; no policy source only with neither;
- in NVIDIADriver mode a node is governed by the NVIDIADriver its owner label names, and by
  none without one;
- a verdict is ``ok`` only where the object gpu-operator reads in that mode selects the
  consumers: a gate written anywhere else changes no verdict;
- one verdict per source, each naming exactly the nodes it governs;
- ``configure-gate`` (its plan for every target, with --replace) makes every verdict ``ok``
  or ``off``, and planning again finds nothing to do;
- a node no flow moves is never freed.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from shared_svc.k8s.selectors import parse_selector
from shared_svc.upgrade.gate import plan_gate, review_gate
from shared_svc.upgrade.planner import plan_node
from shared_svc.upgrade.policy import OWNER_LABEL, policy_sources
from shared_svc.upgrade.settings import UpgradeSettings
from testenv import upgrade_examples as ex

LABEL = "nvidia.com/gpu-driver-upgrade.consumer"
WANTED = f"{LABEL}=true"
SEL = parse_selector(WANTED)
NAMES = ("a", "b", "c")
gates = st.none() | st.sampled_from([WANTED, LABEL, "app=batch", "", "a in (b"])
timeouts = st.none() | st.sampled_from([0, 300])
autos = st.none() | st.booleans()


@st.composite
def worlds(draw: st.DrawFn) -> dict[str, Any]:
    cluster_policies = [
        ex.cluster_policy(
            name,
            auto_upgrade=draw(autos),
            pod_selector=draw(gates),
            timeout_seconds=draw(timeouts),
            created=f"2026-01-0{i + 1}T00:00:00Z",
            use_nvidia_driver_crd=draw(st.booleans()),
            sandbox=draw(st.booleans()),
        )
        for i, name in enumerate(draw(st.lists(st.sampled_from(["cp1", "cp2"]), unique=True)))
    ]
    drivers = [
        ex.nvidia_driver(
            name,
            auto_upgrade=draw(autos),
            pod_selector=draw(gates),
            timeout_seconds=draw(timeouts),
        )
        for name in draw(st.lists(st.sampled_from(NAMES), unique=True))
    ]
    nodes = [
        ex.node(f"n{i}", "cordon-required", labels={OWNER_LABEL: owner} if owner else {})
        for i, owner in enumerate(draw(st.lists(st.none() | st.sampled_from(NAMES), max_size=6)))
    ]
    return {
        "cluster_policies": cluster_policies,
        "drivers": drivers,
        "nodes": nodes,
        "driver_policy": draw(st.booleans()),
    }


def _sources(w: dict[str, Any]) -> Any:
    return policy_sources(w["cluster_policies"], w["drivers"], driver_policy=w["driver_policy"])


@given(worlds())
def test_the_mode_and_each_nodes_source_are_gpu_operators(w: dict[str, Any]) -> None:
    sources = _sources(w)
    active = w["cluster_policies"][0] if w["cluster_policies"] else None  # the oldest
    nvd_mode = active is None or active["spec"]["driver"].get("useNvidiaDriverCRD") is True
    if active is not None and not (w["driver_policy"] and nvd_mode):
        assert sources.mode == "cluster-policy"
        assert [p.where for p in sources.policies] == [
            f"ClusterPolicy/{active['metadata']['name']}"
        ]
    elif w["driver_policy"]:
        assert sources.mode == "nvidia-driver"
        assert sorted(p.name for p in sources.policies) == sorted(
            d["metadata"]["name"] for d in w["drivers"]
        )
    else:
        assert sources.mode == "none" and sources.policies == ()
    for node in w["nodes"]:
        labels = node["metadata"]["labels"]
        governing = sources.governing(labels)
        flow = sources.flow(labels)
        if sources.mode == "none":
            assert flow is None  # the state label is taken as it is
        elif sources.mode == "cluster-policy":  # the state label decides
            assert flow is not None and flow.no_flow is None
        else:
            assert flow is not None
            assert (flow.no_flow is None) == (governing is not None and governing.auto_upgrade)
        if sources.mode == "nvidia-driver":
            assert (governing.name if governing else None) == (
                labels.get(OWNER_LABEL)
                if labels.get(OWNER_LABEL) in {d["metadata"]["name"] for d in w["drivers"]}
                else None
            )


@given(worlds(), st.data())
def test_a_verdict_is_ok_only_where_gpu_operator_reads_the_gate(
    w: dict[str, Any], data: st.DataObject
) -> None:
    sources = _sources(w)
    review = review_gate(sources, SEL, w["nodes"])
    assert len(review.checks) == max(1, len(sources.policies))
    read = {p.where: p for p in sources.policies}
    for check in review.checks:
        if check.state == "ok":
            policy = read[str(check.policy)]
            assert policy.auto_upgrade and parse_selector(policy.pod_selector).matches(
                {LABEL: "true"}
            )
    # Each source names exactly the nodes it governs.
    for check in review.checks:
        if check.policy is not None:
            governed = [
                n["metadata"]["name"]
                for n in sorted(w["nodes"], key=lambda n: n["metadata"]["name"])
                if (g := sources.governing(n["metadata"]["labels"])) and g.where == check.policy
            ]
            assert list(check.nodes) == governed and check.node_count == len(governed)
    # A gate written on an object gpu-operator does not read changes no verdict.
    unread = {p.where for p in sources.unread}
    if unread:
        gated = {
            "cluster_policies": [
                ex.apply_merge(cp, _gate_patch("spec", "driver"))
                if f"ClusterPolicy/{cp['metadata']['name']}" in unread
                else cp
                for cp in w["cluster_policies"]
            ],
            "drivers": [
                ex.apply_merge(d, _gate_patch("spec"))
                if f"NVIDIADriver/{d['metadata']['name']}" in unread
                else d
                for d in w["drivers"]
            ],
        }
        again = review_gate(_sources({**w, **gated}), SEL, w["nodes"])
        assert [c.state for c in again.checks] == [c.state for c in review.checks]


def _gate_patch(*path: str) -> dict[str, Any]:
    patch: dict[str, Any] = {
        "upgradePolicy": {"waitForCompletion": {"podSelector": WANTED, "timeoutSeconds": 600}}
    }
    for key in reversed(path):
        patch = {key: patch}
    return patch


@given(worlds())
def test_configure_gate_makes_every_verdict_hold_and_is_idempotent(w: dict[str, Any]) -> None:
    sources = _sources(w)
    by_where = {
        **{f"ClusterPolicy/{o['metadata']['name']}": o for o in w["cluster_policies"]},
        **{f"NVIDIADriver/{o['metadata']['name']}": o for o in w["drivers"]},
    }
    for policy in sources.policies:
        plan = plan_gate(policy, SEL, replace=True)
        by_where[policy.where] = ex.apply_merge(by_where[policy.where], plan.patch)
    after = {
        **w,
        "cluster_policies": [
            by_where[f"ClusterPolicy/{o['metadata']['name']}"] for o in w["cluster_policies"]
        ],
        "drivers": [by_where[f"NVIDIADriver/{o['metadata']['name']}"] for o in w["drivers"]],
    }
    fixed = _sources(after)
    assert fixed.mode == sources.mode
    assert {c.state for c in review_gate(fixed, SEL).checks} <= {"ok", "off", "absent"}
    assert all(plan_gate(p, SEL).action == "nothing" for p in fixed.policies)


@given(worlds())
def test_a_node_no_flow_moves_is_never_freed(w: dict[str, Any]) -> None:
    sources = _sources(w)
    for node in w["nodes"]:
        flow = sources.flow(node["metadata"]["labels"])
        plan = plan_node(
            node,
            [ex.declared_pod("t", node_name=node["metadata"]["name"])],
            [],
            UpgradeSettings(),
            0.0,
            flow=flow,
        )
        if flow is not None and flow.no_flow:
            assert plan.pod_actions == () and plan.patch is None
        else:
            assert [a.name for a in plan.pod_actions] == ["t"]
