"""Which upgrade policy gpu-operator reads, and the gate judged there (issue 42).

gpu-operator v26.7.0 reads the ClusterPolicy's ``spec.driver.upgradePolicy`` in ClusterPolicy
mode only; with ``useNvidiaDriverCRD: true``, or with no ClusterPolicy (a GPUCluster cluster),
each NVIDIADriver's ``spec.upgradePolicy`` governs the nodes labelled
``nvidia.com/gpu-operator.driver.owner=<its name>``. Pure rules (``upgrade/policy.py``,
``upgrade/gate.py``), the planner's "no flow" (``node_plan.node_mode``), configure-gate's plan
per object and the controller's verdicts, metric and Events (the fake API: the live ones are
tests/test_upgrade_libs_nvidiadriver.py).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from shared_svc.config import Config
from shared_svc.controllers.upgrade.reconciler import UpgradeReconciler
from shared_svc.k8s.selectors import parse_selector
from shared_svc.upgrade.gate import plan_gate, review_gate
from shared_svc.upgrade.planner import plan_node
from shared_svc.upgrade.policy import (
    OWNER_LABEL,
    crd_fields,
    policy_of_nvidia_driver,
    policy_sources,
    reads_driver_policy,
)
from shared_svc.upgrade.settings import UpgradeSettings
from testenv import upgrade_examples as ex
from tests.conftest import UPSTREAM_CRDS

LABEL = "nvidia.com/gpu-driver-upgrade.consumer"
WANTED = f"{LABEL}=true"
SEL = parse_selector(WANTED)
PARKED = "nvidia.com/gpu-driver-upgrade.parked"
RECORD = "shared-svc.nvidia.com/gpu-driver-upgrade-freed"
T0 = 1_700_000_000.0
NVD_MODE = ex.cluster_policy(use_nvidia_driver_crd=True)


def upstream_crd(fname: str) -> dict[str, Any]:
    return dict(yaml.safe_load((UPSTREAM_CRDS / fname).read_text()))


def owned(name: str, owner: str | None, state: str = "cordon-required") -> dict[str, Any]:
    node = ex.node(name, state=state)
    if owner is not None:
        node["metadata"]["labels"][OWNER_LABEL] = owner
    return node


# --- the policy source, as gpu-operator decides it ---


def test_the_upstream_nvidiadriver_crd_of_v26_7_gives_each_nvidiadriver_a_policy() -> None:
    crd = upstream_crd("nvidia.com_nvidiadrivers.yaml")
    assert reads_driver_policy(crd)
    assert reads_driver_policy(crd_fields(crd)) and len(str(crd_fields(crd))) < 300
    assert not reads_driver_policy(ex.nvidia_driver_crd(upgrade_policy=False))  # v25.3.4
    assert not reads_driver_policy(None)


@pytest.mark.parametrize(
    ("cluster_policies", "driver_policy", "mode", "sources"),
    [
        # ClusterPolicy mode, with either CRD
        ([ex.cluster_policy()], True, "cluster-policy", ["ClusterPolicy/cluster-policy"]),
        ([ex.cluster_policy()], False, "cluster-policy", ["ClusterPolicy/cluster-policy"]),
        # NVIDIADriver mode on v26.7: each NVIDIADriver
        ([NVD_MODE], True, "nvidia-driver", ["NVIDIADriver/a", "NVIDIADriver/b"]),
        # ... and a GPUCluster cluster: no ClusterPolicy at all
        ([], True, "nvidia-driver", ["NVIDIADriver/a", "NVIDIADriver/b"]),
        # v25.3.4 (the NVIDIADriver CRD without upgradePolicy): the ClusterPolicy in both modes
        ([NVD_MODE], False, "cluster-policy", ["ClusterPolicy/cluster-policy"]),
        ([], False, "none", []),
    ],
)
def test_which_policy_gpu_operator_reads(
    cluster_policies: list[dict[str, Any]], driver_policy: bool, mode: str, sources: list[str]
) -> None:
    drivers = [ex.nvidia_driver("b"), ex.nvidia_driver("a")]
    found = policy_sources(cluster_policies, drivers, driver_policy=driver_policy)
    assert found.mode == mode
    assert [p.where for p in found.policies] == sources


def test_each_nvidiadriver_governs_the_nodes_it_owns_and_a_node_of_none_has_no_flow() -> None:
    found = policy_sources(
        [],
        [ex.nvidia_driver("a"), ex.nvidia_driver("b", auto_upgrade=False)],
        driver_policy=True,
    )
    flow_a = found.flow({OWNER_LABEL: "a"})
    assert flow_a is not None and flow_a.no_flow is None and flow_a.policy is not None
    assert flow_a.policy.where == "NVIDIADriver/a"
    off = found.flow({OWNER_LABEL: "b"})
    assert off is not None and off.no_flow is not None and "auto-upgrade is off" in off.no_flow
    for labels, why in (
        ({}, "no nvidia.com/gpu-operator.driver.owner"),
        ({OWNER_LABEL: "z"}, "'z'"),
    ):
        none = found.flow(labels)
        assert none is not None and none.policy is None and why in str(none.no_flow)
    # No gpu-operator CR at all: the state labels are taken as they are.
    assert policy_sources([], [], driver_policy=False).flow({}) is None


def test_nvidiadriver_defaults_and_sandbox_workloads() -> None:
    bare = policy_of_nvidia_driver(ex.nvidia_driver("a"))  # no upgradePolicy at all
    assert bare.auto_upgrade and bare.pod_selector == "" and bare.timeout_seconds == 0
    assert bare.gate_field == "spec.upgradePolicy.waitForCompletion.podSelector"
    assert not policy_of_nvidia_driver(ex.nvidia_driver("a", auto_upgrade=False)).auto_upgrade
    sandbox = ex.cluster_policy(use_nvidia_driver_crd=True, sandbox=True)
    found = policy_sources([sandbox], [ex.nvidia_driver("a")], driver_policy=True)
    assert [p.auto_upgrade for p in found.policies] == [False]
    flow = found.flow({OWNER_LABEL: "a"})
    assert flow is not None and "sandboxWorkloads" in str(flow.no_flow)


# --- one verdict per source ---


def test_a_gate_set_where_gpu_operator_does_not_read_it_is_never_ok() -> None:
    """The issue's case: configure-gate wrote the ClusterPolicy in NVIDIADriver mode."""
    cp = ex.cluster_policy(use_nvidia_driver_crd=True, pod_selector=WANTED, timeout_seconds=600)
    found = policy_sources([cp], [ex.nvidia_driver("default")], driver_policy=True)
    review = review_gate(found, SEL, [owned("n1", "default"), owned("n2", "default")])
    [verdict] = review.checks
    assert (verdict.state, verdict.policy) == ("missing", "NVIDIADriver/default")
    assert verdict.nodes == ("n1", "n2") and verdict.node_count == 2
    assert "spec.upgradePolicy.waitForCompletion.podSelector" in verdict.message
    assert "does not read the gate of ClusterPolicy/cluster-policy" in verdict.message
    assert review.unread == (f"ClusterPolicy/cluster-policy: {WANTED!r}",)
    [report] = review.reports
    assert report.reason == "GPUConsumerGateMissing"
    assert (report.regarding.kind, report.regarding.name) == ("NVIDIADriver", "default")
    assert report.regarding.api_version == "nvidia.com/v1alpha1"
    # The gate on the NVIDIADriver alone: ok (it used to say missing, on the ClusterPolicy).
    gated = ex.nvidia_driver("default", pod_selector=WANTED, timeout_seconds=600)
    fixed = review_gate(policy_sources([NVD_MODE], [gated], driver_policy=True), SEL)
    assert [c.state for c in fixed.checks] == ["ok"] and fixed.reports == ()


def test_two_nvidiadrivers_with_different_gates_get_two_verdicts() -> None:
    drivers = [
        ex.nvidia_driver("a", pod_selector=WANTED, timeout_seconds=600),
        ex.nvidia_driver("b", pod_selector="app=batch"),
    ]
    nodes = [owned("n1", "a"), owned("n2", "b"), owned("n3", "b"), owned("n4", None)]
    review = review_gate(policy_sources([], drivers, driver_policy=True), SEL, nodes)
    assert review.mode == "nvidia-driver" and review.state == "mismatch"
    a, b = review.checks
    assert (a.policy, a.state, a.nodes) == ("NVIDIADriver/a", "ok", ("n1",))
    assert (b.policy, b.state, b.nodes) == ("NVIDIADriver/b", "mismatch", ("n2", "n3"))
    assert review.ungoverned == ("n4",) and review.ungoverned_count == 1
    assert [(r.regarding.name, r.reason) for r in review.reports] == [
        ("b", "GPUConsumerGateMismatch")
    ]
    # A report series per object: the same finding on two objects is two series.
    both = review_gate(
        policy_sources([], [ex.nvidia_driver("a"), ex.nvidia_driver("b")], driver_policy=True), SEL
    )
    assert len({r.key for r in both.reports}) == 2


def test_a_gpucluster_cluster_whose_drivers_upgrade_through_an_nvidiadriver_is_reviewed() -> None:
    review = review_gate(policy_sources([], [ex.nvidia_driver("a")], driver_policy=True), SEL)
    assert review.state == "missing" and "no upgrade flow" not in review.checks[0].message
    # With no NVIDIADriver there is no flow (host-installed drivers): said so.
    none = review_gate(policy_sources([], [], driver_policy=True), SEL)
    assert none.state == "absent" and "no NVIDIADriver" in none.checks[0].message


# --- configure-gate writes where gpu-operator reads ---


def test_configure_gate_plans_the_nvidiadriver_patch() -> None:
    policy = policy_of_nvidia_driver(ex.nvidia_driver("a"))
    plan = plan_gate(policy, SEL)
    assert plan.action == "set"
    assert plan.patch == {
        "spec": {
            "upgradePolicy": {"waitForCompletion": {"podSelector": WANTED, "timeoutSeconds": 600}}
        }
    }
    after = ex.apply_merge(ex.nvidia_driver("a"), plan.patch)
    again = plan_gate(policy_of_nvidia_driver(after), SEL)
    assert again.action == "nothing"
    review = review_gate(policy_sources([], [after], driver_policy=True), SEL)
    assert review.state == "ok"


# --- freeing keyed by the node's own policy ---

S = UpgradeSettings()


def test_a_node_no_flow_moves_is_not_freed_and_what_was_parked_is_restored() -> None:
    found = policy_sources(
        [], [ex.nvidia_driver("a"), ex.nvidia_driver("off", auto_upgrade=False)], driver_policy=True
    )
    triton = ex.declared_pod("triton")
    freed = plan_node(
        owned("node-1", "a"), [triton], [], S, T0, flow=found.flow({OWNER_LABEL: "a"})
    )
    assert [a.verb for a in freed.pod_actions] == [
        "evict"
    ] and freed.status.policy == "NVIDIADriver/a"
    for owner in (None, "off", "gone"):
        node = owned("node-1", owner)
        flow = found.flow(node["metadata"]["labels"])
        plan = plan_node(node, [triton], [], S, T0, flow=flow)
        assert plan.pod_actions == () and plan.patch is None, owner  # nothing freed, nothing parked
        assert plan.status.mode == "abort" and plan.status.no_flow is not None
        # Parked in an earlier state (its owner turned auto-upgrade off): restored at once.
        parked = ex.apply_patch(node, freed.patch)
        undo = plan_node(parked, [], [], S, T0 + 1, flow=flow)
        assert undo.patch is not None and dict(undo.patch.labels) == {PARKED: None}
        [report] = [r for r in undo.reports if r.reason == "UpgradeAborted"]
        assert "No upgrade flow moves the node" in report.note


# --- the controller: verdicts, metric, Events, per-node flow ---


Recorder = ex.ReportRecorder


async def test_the_controller_judges_each_nvidiadriver_and_plans_nodes_by_their_owner() -> None:
    nodes = [owned("n1", "a"), owned("n2", "b")]
    io = ex.FakeUpgradeIO(
        nodes,
        [ex.declared_pod("t1", node_name="n1"), ex.declared_pod("t2", node_name="n2")],
        cluster_policies=[ex.cluster_policy(pod_selector=WANTED, timeout_seconds=600)],
        nvidia_drivers=[
            ex.nvidia_driver("a", pod_selector=WANTED, timeout_seconds=600),
            ex.nvidia_driver("b", auto_upgrade=False),
        ],
        driver_crd=ex.nvidia_driver_crd(),
    )
    recorder = Recorder()
    controller = UpgradeReconciler(
        Config(upgrade_controller=True), recorder, caches=io.caches, io=io, clock=lambda: T0
    )
    await controller.gate_review.review()
    gate = controller.status()["gate"]
    assert gate["mode"] == "cluster-policy"  # the ClusterPolicy does not set useNvidiaDriverCRD
    assert [v["policy"] for v in gate["verdicts"]] == ["ClusterPolicy/cluster-policy"]
    # Switched to NVIDIADriver mode: the ClusterPolicy's gate is not read any more.
    io.set_cluster_policies(
        [ex.cluster_policy(use_nvidia_driver_crd=True, pod_selector=WANTED, timeout_seconds=600)]
    )
    await controller.gate_review.review()
    gate = controller.status()["gate"]
    assert gate["mode"] == "nvidia-driver" and gate["state"] == "ok"
    assert [(v["policy"], v["state"], v["nodes"]) for v in gate["verdicts"]] == [
        ("NVIDIADriver/a", "ok", ["n1"]),
        ("NVIDIADriver/b", "off", ["n2"]),
    ]
    assert gate["unread"] == [f"ClusterPolicy/cluster-policy: {WANTED!r}"]
    controller._publish()
    sample = controller.metrics.registry.get_sample_value
    assert (
        sample("shared_svc_upgrade_gate", {"kind": "NVIDIADriver", "name": "a", "state": "ok"}) == 1
    )
    assert (
        sample("shared_svc_upgrade_gate", {"kind": "NVIDIADriver", "name": "b", "state": "off"})
        == 1
    )
    assert (
        sample(
            "shared_svc_upgrade_gate",
            {"kind": "ClusterPolicy", "name": "cluster-policy", "state": "ok"},
        )
        is None
    )
    # n1 (NVIDIADriver a) is freed; n2 (b: auto-upgrade off) is left alone.
    await controller.reconcile("n1")
    await controller.reconcile("n2")
    assert [w.name for w in io.writes if hasattr(w, "verb")] == ["t1"]
    shown = controller.status()["nodes"]
    assert shown["n2"]["mode"] == "abort" and "auto-upgrade is off" in shown["n2"]["noFlow"]
    assert shown["n1"]["policy"] == "NVIDIADriver/a"
    # The NVIDIADriver loses its gate: one Warning, on it.
    io.set_nvidia_drivers([ex.nvidia_driver("a"), ex.nvidia_driver("b", auto_upgrade=False)])
    await controller.gate_review.review()
    assert [(r.reason, r.regarding.kind, r.regarding.name) for r in recorder.reports] == [
        ("GPUConsumerGateMissing", "NVIDIADriver", "a")
    ]


async def test_a_change_of_the_sources_plans_every_node_again() -> None:
    io = ex.FakeUpgradeIO(
        [owned("n1", "a")],
        [],
        nvidia_drivers=[ex.nvidia_driver("a")],
        driver_crd=ex.nvidia_driver_crd(),
    )
    controller = UpgradeReconciler(
        Config(upgrade_controller=True), Recorder(), caches=io.caches, io=io, clock=lambda: T0
    )
    triggered: list[bool] = []
    controller.gate_review.on_sources = lambda: triggered.append(True)
    await controller.gate_review.review()
    io.set_nvidia_drivers([copy.deepcopy(ex.nvidia_driver("a", pod_selector=WANTED))])
    await controller.gate_review.review()
    assert triggered == []  # a new gate changes no node's flow
    io.set_nvidia_drivers([ex.nvidia_driver("a", auto_upgrade=False)])
    await controller.gate_review.review()
    assert triggered == [True]


# --- an NVIDIADriver's driver DaemonSet is a driver DaemonSet ---


def test_an_nvidiadrivers_driver_daemonset_tells_the_path_like_the_cluster_policys() -> None:
    """``nvidia-gpu-driver-<os><version>-<hash>``, labelled ``app=<its name>`` and
    ``app.kubernetes.io/component=nvidia-driver``: its old driver pod with the template's
    digest is the restart-only path (nothing freed), a new digest the full path."""
    name = "nvidia-gpu-driver-ubuntu22.04-7c9d8f6b5"
    labels = {"app": name, "app.kubernetes.io/component": "nvidia-driver"}
    for digest, path in (("d1", "restart-only"), ("d2", "full")):
        ds = ex.driver_daemonset(digest, name=name, generation=2)
        ds["metadata"]["labels"] = dict(labels)
        ds["spec"]["template"]["metadata"]["labels"] = dict(labels)
        old = ex.driver_pod(ds, digest="d1", generation=1, terminating=True)
        old["metadata"]["labels"] = {**labels, "pod-template-generation": "1"}
        node = owned("node-1", "default", state="pod-restart-required")
        flow = policy_sources([], [ex.nvidia_driver("default")], driver_policy=True).flow(
            {OWNER_LABEL: "default"}
        )
        p = plan_node(node, [old, ex.declared_pod("triton")], [ds], S, T0, flow=flow)
        assert p.status.path == path
        assert [a.name for a in p.pod_actions] == ([] if path == "restart-only" else ["triton"])
        if path == "restart-only":
            assert p.status.driver_daemonset == f"gpu-operator/{name}"


def test_a_crd_version_not_served_does_not_count() -> None:
    crd = ex.nvidia_driver_crd()
    crd["spec"]["versions"][0]["served"] = False
    assert not reads_driver_policy(crd)


def test_in_cluster_policy_mode_the_state_label_decides() -> None:
    """gpu-operator removes the label from every node when the ClusterPolicy's auto-upgrade
    is off or sandbox workloads are on: that (the label gone) is the abort; a label still
    there is freed on, as before."""
    triton = ex.declared_pod("triton")
    node = ex.node("node-1", state="cordon-required")
    for cp in (
        ex.cluster_policy(),
        ex.cluster_policy(auto_upgrade=False),
        ex.cluster_policy(sandbox=True),
    ):
        flow = policy_sources([cp], [], driver_policy=True).flow({})
        assert flow is not None and flow.no_flow is None and flow.policy is not None
        freed = plan_node(node, [triton], [], S, T0, flow=flow)
        assert [a.name for a in freed.pod_actions] == ["triton"]
        assert freed.status.policy == "ClusterPolicy/cluster-policy"


def test_configure_gate_targets_where_gpu_operator_reads_or_says_why_not() -> None:
    from shared_svc.commands.upgrade.configure_gate import _gate_targets
    from shared_svc.errors import UsageError

    drivers = [ex.nvidia_driver("a"), ex.nvidia_driver("b")]
    nvd = policy_sources([], drivers, driver_policy=True)
    assert [p.where for p in _gate_targets(nvd, [])] == ["NVIDIADriver/a", "NVIDIADriver/b"]
    assert [p.where for p in _gate_targets(nvd, ["b"])] == ["NVIDIADriver/b"]
    cp = policy_sources([ex.cluster_policy()], drivers, driver_policy=True)
    assert [p.where for p in _gate_targets(cp, [])] == ["ClusterPolicy/cluster-policy"]
    for sources, named, says in (
        (nvd, ["z"], "no NVIDIADriver z (there are: a, b)"),
        (cp, ["a"], "not an NVIDIADriver's: run without --nvidia-driver"),
        (policy_sources([], [], driver_policy=True), [], "there is no NVIDIADriver"),
        (policy_sources([], [], driver_policy=False), [], "is gpu-operator installed?"),
    ):
        with pytest.raises(
            UsageError, match=says.replace("?", r"\?").replace("(", r"\(").replace(")", r"\)")
        ):
            _gate_targets(sources, named)


async def test_nodes_planned_before_the_sources_are_known_are_planned_again() -> None:
    """A node planned while the policy caches were still listing is planned from its state
    label; once they synced, the review plans every node again (with its flow)."""
    io = ex.FakeUpgradeIO(
        [owned("n1", None)],
        [ex.declared_pod("t1", node_name="n1")],
        nvidia_drivers=[ex.nvidia_driver("a")],
        driver_crd=ex.nvidia_driver_crd(),
    )
    io.cached.driver_crd._set_synced(False)  # still listing
    controller = UpgradeReconciler(
        Config(upgrade_controller=True), Recorder(), caches=io.caches, io=io, clock=lambda: T0
    )
    triggered: list[bool] = []
    controller.gate_review.on_sources = lambda: triggered.append(True)
    await controller.reconcile("n1")
    assert [w.name for w in io.writes if hasattr(w, "verb")] == ["t1"]  # the label decided
    io.set_driver_crd(ex.nvidia_driver_crd())  # listed
    await controller.gate_review.review()
    assert triggered == [True]
    await controller.reconcile("n1")  # the planned-again pass: no flow moves n1
    shown = controller.status()["nodes"]["n1"]
    assert shown["mode"] == "abort" and "no nvidia.com/gpu-operator.driver.owner" in shown["noFlow"]
    await controller.gate_review.review()
    assert triggered == [True]  # nothing new


async def test_a_fix_seen_as_a_standby_is_forgotten_so_the_finding_is_sent_again() -> None:
    leading = [True]
    io = ex.FakeUpgradeIO(
        [],
        [],
        nvidia_drivers=[ex.nvidia_driver("a"), ex.nvidia_driver("b")],
        driver_crd=ex.nvidia_driver_crd(),
    )
    recorder = Recorder()
    controller = UpgradeReconciler(
        Config(upgrade_controller=True),
        recorder,
        caches=io.caches,
        io=io,
        is_leader=lambda: leading[0],
    )
    await controller.gate_review.review()
    assert sorted(r.regarding.name for r in recorder.reports) == ["a", "b"]
    leading[0] = False  # a standby now: a is fixed meanwhile, b still warns
    io.set_nvidia_drivers([ex.nvidia_driver("a", pod_selector=WANTED), ex.nvidia_driver("b")])
    await controller.gate_review.review()
    io.set_nvidia_drivers([ex.nvidia_driver("a"), ex.nvidia_driver("b")])  # a broken again
    leading[0] = True
    await controller.gate_review.review()
    assert sorted(r.regarding.name for r in recorder.reports) == ["a", "a", "b"]
