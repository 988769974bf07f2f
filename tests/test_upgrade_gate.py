"""The upgrade flow's gate (``waitForCompletion.podSelector``), pure rules and the controller.

- The check: missing, mismatch (AND-only), invalid, ok, off (autoUpgrade off, sandbox),
  absent; the Warning on the ClusterPolicy and its stable key.
- configure-gate's plan: set, nothing to do, refuse an existing foreign selector unless
  --replace; a property: the patch it plans always makes the check pass.
- prepare-daemonset's template label; the per-node Warning when a freed consumer is still
  on the node at pod-restart-required (once per upgrade, remembered in the record).
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import logging
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared_svc.config import Config
from shared_svc.controllers.upgrade.reconciler import UpgradeReconciler
from shared_svc.k8s.events import NOTE_LIMIT, Report
from shared_svc.k8s.selectors import parse_selector
from shared_svc.kube.recorder import event_body
from shared_svc.upgrade import daemonsets, record
from shared_svc.upgrade.gate import (
    DEFAULT_GATE_TIMEOUT_SECONDS,
    NoConsumerLabel,
    consumer_labels,
    plan_gate,
    review_gate,
)
from shared_svc.upgrade.node_plan import NodePlan
from shared_svc.upgrade.planner import plan_node
from shared_svc.upgrade.policy import policy_of_cluster_policy, policy_sources
from shared_svc.upgrade.settings import UpgradeSettings
from testenv import upgrade_examples as ex

LABEL = "nvidia.com/gpu-driver-upgrade.consumer"
WANTED = f"{LABEL}=true"
SEL = parse_selector(WANTED)
RECORD = "shared-svc.nvidia.com/gpu-driver-upgrade-freed"
T0 = 1_700_000_000.0


def check(*policies: dict[str, Any], selector: str = WANTED) -> Any:
    """The one verdict on the ClusterPolicies' gate (gpu-operator before v26.7.0: no
    NVIDIADriver policy), and its Warning."""
    sources = policy_sources(list(policies), [], driver_policy=False)
    verdicts = review_gate(sources, parse_selector(selector))
    [verdict] = verdicts.checks
    return verdict, (verdicts.reports[0] if verdicts.reports else None)


# --- the check ---


def test_missing_gate_warns_on_the_cluster_policy() -> None:
    verdict, report = check(ex.cluster_policy(timeout_seconds=0))
    assert verdict.state == "missing" and verdict.wanted == WANTED
    assert report is not None and report.type == "Warning"
    assert report.reason == "GPUConsumerGateMissing"
    assert (report.regarding.kind, report.regarding.name) == ("ClusterPolicy", "cluster-policy")
    assert report.regarding.namespace is None  # cluster-scoped: the Event goes to default
    assert "races the driver restart" in report.note
    assert "waitForCompletion.podSelector" in report.note and repr(WANTED) in report.note
    assert "configure-gate" in report.note and "prepare-daemonset" in report.note


@pytest.mark.parametrize(
    ("selector", "state"),
    [
        (WANTED, "ok"),
        (LABEL, "ok"),  # exists
        (f"{LABEL} in (true,yes)", "ok"),
        (f"{LABEL}=true,!other", "ok"),  # every requirement holds on the consumer label
        ("app=batch", "mismatch"),
        (f"{LABEL}=true,app=batch", "mismatch"),  # AND-only: consumers lack app=batch
        (f"{LABEL}=false", "mismatch"),
        (f"{LABEL} notin (true)", "mismatch"),
        ("a in (b", "invalid"),
        ("", "missing"),
        ("  ", "missing"),
    ],
)
def test_gate_selects_the_consumers_only_when_every_requirement_holds(
    selector: str, state: str
) -> None:
    verdict, report = check(ex.cluster_policy(pod_selector=selector, timeout_seconds=300))
    assert verdict.state == state
    assert (report is None) == (state == "ok")
    if report is not None:
        assert "races the driver restart" in report.note


def test_a_long_gate_warning_is_cut_once_in_bytes_by_the_event() -> None:
    """The report carries the whole message; the Event note cuts it to 1024 bytes (between
    characters), not the report to 1000 characters first."""
    foreign = "app in (" + ",".join(f"gpu-é{i}" for i in range(150)) + ")"
    verdict, report = check(ex.cluster_policy(pod_selector=foreign, timeout_seconds=300))
    assert report is not None and len(verdict.message) > 1000
    assert report.note == verdict.message
    sent = event_body(report, "pod-0", dt.datetime(2026, 1, 1, tzinfo=dt.UTC))["note"]
    assert len(sent.encode()) <= NOTE_LIMIT and verdict.message.startswith(sent[:-3])


def test_no_flow_no_warning() -> None:
    for policy in (
        ex.cluster_policy(auto_upgrade=False),
        ex.cluster_policy(auto_upgrade=None),  # the CRD default is false
    ):
        verdict, report = check(policy)
        assert verdict.state == "off" and report is None
    sandbox = ex.cluster_policy()
    sandbox["spec"]["sandboxWorkloads"] = {"enabled": True}  # the flow is disabled then
    assert check(sandbox)[0].state == "off"
    assert check() == (check()[0], None) and check()[0].state == "absent"


def test_the_active_cluster_policy_decides() -> None:
    old = ex.cluster_policy("old", pod_selector=WANTED, created="2025-01-01T00:00:00Z")
    new = ex.cluster_policy("new", created="2026-01-01T00:00:00Z")
    assert check(new, old)[0].state == "ok"
    old["metadata"]["deletionTimestamp"] = "2026-02-01T00:00:00Z"
    verdict, report = check(new, old)
    assert verdict.state == "missing" and report is not None and report.regarding.name == "new"


def test_report_key_is_one_series_per_finding() -> None:
    a = check(ex.cluster_policy(pod_selector="app=batch"))[1]
    b = check(ex.cluster_policy(pod_selector="app=batch"))[1]
    c = check(ex.cluster_policy(pod_selector="app=other"))[1]
    assert a is not None and b is not None and c is not None
    assert a.key == b.key != c.key


def test_ok_gate_without_timeout_says_so() -> None:
    verdict, report = check(ex.cluster_policy(pod_selector=WANTED, timeout_seconds=0))
    assert verdict.state == "ok" and report is None and "timeoutSeconds > 0" in verdict.message


def test_consumer_labels() -> None:
    assert consumer_labels(SEL) == {LABEL: "true"}
    assert consumer_labels(parse_selector("a")) == {"a": "true"}
    assert consumer_labels(parse_selector("a in (y,x),!b")) == {"a": "x"}
    for bad in ("", "!a", "a notin (x)"):
        with pytest.raises(NoConsumerLabel):
            consumer_labels(parse_selector(bad))


# --- configure-gate's plan ---


def gate_plan(**kw: Any) -> Any:
    replace = kw.pop("replace", False)
    return plan_gate(policy_of_cluster_policy(ex.cluster_policy(**kw)), SEL, replace=replace)


def test_plan_sets_selector_and_timeout_when_missing() -> None:
    plan = gate_plan()
    assert plan.action == "set"
    assert plan.patch == {
        "spec": {
            "driver": {
                "upgradePolicy": {
                    "waitForCompletion": {
                        "podSelector": WANTED,
                        "timeoutSeconds": DEFAULT_GATE_TIMEOUT_SECONDS,
                    }
                }
            }
        }
    }
    kept = gate_plan(timeout_seconds=900)  # a positive timeout is the user's: kept
    assert kept.patch["spec"]["driver"]["upgradePolicy"]["waitForCompletion"] == {
        "podSelector": WANTED
    }


def test_plan_keeps_a_selector_that_already_selects() -> None:
    assert gate_plan(pod_selector=LABEL, timeout_seconds=300).action == "nothing"
    only_timeout = gate_plan(pod_selector=LABEL, timeout_seconds=0)
    assert only_timeout.action == "set"
    assert only_timeout.patch["spec"]["driver"]["upgradePolicy"]["waitForCompletion"] == {
        "timeoutSeconds": DEFAULT_GATE_TIMEOUT_SECONDS
    }


def test_plan_never_replaces_a_foreign_selector_silently() -> None:
    refused = gate_plan(pod_selector="app=batch", timeout_seconds=300)
    assert refused.action == "refuse" and refused.patch == {}
    assert "AND-only" in refused.message and "--replace" in refused.message
    assert f"add the label {WANTED}" in refused.message
    replaced = gate_plan(pod_selector="app=batch", timeout_seconds=300, replace=True)
    assert replaced.action == "set"
    assert replaced.patch["spec"]["driver"]["upgradePolicy"]["waitForCompletion"] == {
        "podSelector": WANTED
    }


keys = st.sampled_from(["a", "b", "example.com/c", LABEL])
values = st.sampled_from(["true", "x", "y"])
requirement = st.one_of(
    st.builds(lambda k, v: f"{k}={v}", keys, values),
    st.builds(lambda k, v: f"{k}!={v}", keys, values),
    keys,
    st.builds(lambda k: f"!{k}", keys),
    st.builds(lambda k, v, w: f"{k} in ({v},{w})", keys, values, values),
)
selectors = st.lists(requirement, min_size=0, max_size=3).map(",".join)


@given(consumer=selectors, existing=st.none() | selectors, timeout=st.none() | st.integers(0, 900))
def test_configure_gate_makes_the_check_pass(
    consumer: str, existing: str | None, timeout: int | None
) -> None:
    """Whatever the policy holds, the patch configure-gate plans (with --replace) makes the
    gate hold for the declared consumers, with a positive timeout; without --replace it
    never changes a selector that gates other pods."""
    sel = parse_selector(consumer)
    try:
        consumer_labels(sel)
    except NoConsumerLabel:
        return
    cp = ex.cluster_policy(pod_selector=existing, timeout_seconds=timeout)
    policy = policy_of_cluster_policy(cp)
    for replace in (False, True):
        plan = plan_gate(policy, sel, replace=replace)
        after = ex.apply_merge(cp, plan.patch)
        verdict, report = check(after, selector=consumer)
        if plan.action == "refuse":
            assert not replace and after == cp
            continue
        assert verdict.state == "ok" and report is None, (plan, verdict)
        assert policy_of_cluster_policy(after).timeout_seconds > 0
        if existing and not replace and plan.action == "set":
            assert "podSelector" not in json.dumps(plan.patch)  # only the timeout


# --- prepare-daemonset's template label ---


def test_template_labels_added_once_and_kept() -> None:
    ds = ex.daemonset("exporter", declared=True)
    assert daemonsets.missing_template_labels(ds, {LABEL: "true"}) == {LABEL: "true"}
    labelled = daemonsets.with_template_labels(ds, {LABEL: "true"})
    assert daemonsets.template_labels(labelled) == {"app": "exporter", LABEL: "true"}
    assert daemonsets.missing_template_labels(labelled, {LABEL: "true"}) == {}
    assert daemonsets.with_template_labels(labelled, {LABEL: "true"}) == labelled
    assert daemonsets.template_labels(ds) == {"app": "exporter"}  # the input is untouched


# --- the per-node Warning at pod-restart-required ---

S = UpgradeSettings()


def plan(
    node: dict[str, Any], pods: list[dict[str, Any]], dss: tuple = (), now: float = T0
) -> NodePlan:
    return plan_node(node, pods, list(dss), S, now)


def apply(node: dict[str, Any], p: NodePlan) -> dict[str, Any]:
    return ex.apply_patch(node, p.patch) if p.patch is not None else node


def at(node: dict[str, Any], state: str) -> dict[str, Any]:
    node = copy.deepcopy(node)
    node["metadata"]["labels"]["nvidia.com/gpu-driver-upgrade-state"] = state
    return node


def warnings(p: NodePlan) -> list[Report]:
    return [r for r in p.reports if r.reason == "GPUConsumersAtDriverRestart"]


def test_freed_consumer_still_there_at_pod_restart_required_is_reported_once() -> None:
    ds = ex.daemonset("exporter", declared=True)
    ds_pod = ex.daemonset_pod(ds, labels={LABEL: "true"})
    triton = ex.declared_pod("triton")
    node = ex.node(state="cordon-required")
    first = plan(node, [triton, ds_pod], (ds,))
    assert not warnings(first)  # freeing in cordon-required: no race yet
    node = apply(node, first)
    terminating = {**triton, "metadata": {**triton["metadata"], "deletionTimestamp": "x"}}
    restart = plan(at(node, "pod-restart-required"), [terminating, ds_pod], (ds,), T0 + 1)
    [warning] = warnings(restart)
    assert warning.type == "Warning" and warning.regarding.kind == "Node"
    assert "ml/triton" in warning.note and "monitoring/exporter-node-1" in warning.note
    assert "configure-gate" in warning.note and WANTED in warning.note
    node = apply(at(node, "pod-restart-required"), restart)
    rec = record.decode(node["metadata"]["annotations"][RECORD])
    assert rec.restart_race == ("ml/triton", "monitoring/exporter-node-1")
    assert restart.status.restart_race == rec.restart_race
    again = plan(node, [terminating, ds_pod], (ds,), T0 + 2)
    assert not warnings(again)  # remembered in the record: once per node and upgrade
    # Restored at upgrade-done: the next upgrade may report again.
    done = plan(at(node, "upgrade-done"), [], (ds,), T0 + 3)
    assert RECORD not in apply(at(node, "upgrade-done"), done)["metadata"]["annotations"]


def test_no_restart_warning_when_the_freed_consumers_are_gone() -> None:
    node = ex.node(state="cordon-required")
    triton = ex.declared_pod("triton")
    node = apply(node, plan(node, [triton]))
    # Gone before the driver restart (the gate held), or never ours (a pod not declared).
    p = plan(at(node, "pod-restart-required"), [ex.pod("web")], (), T0 + 1)
    assert not warnings(p) and p.status.restart_race == ()


def test_first_look_at_pod_restart_required_reports_what_it_must_still_free() -> None:
    p = plan(ex.node(state="pod-restart-required"), [ex.declared_pod("triton")])
    [warning] = warnings(p)
    assert "ml/triton" in warning.note


def test_record_restart_race_round_trips_and_old_records_stay_byte_for_byte() -> None:
    old = record.encode(record.Record.new(T0, parked_label=True))
    assert "restartRace" not in old and record.encode(record.decode(old)) == old
    raced = record.Record(since=T0, parked_label=True, restart_race=("ml/a",))
    assert record.decode(record.encode(raced)) == raced
    with pytest.raises(record.RecordError):
        record.decode(old.replace('"version"', '"restartRace":"x","version"'))


# --- the controller: the gate Warning and /status ---


Recorder = ex.ReportRecorder


async def test_controller_warns_once_about_a_missing_gate_and_shows_it() -> None:
    io = ex.FakeUpgradeIO([], [], cluster_policies=[ex.cluster_policy()])
    recorder = Recorder()
    controller = UpgradeReconciler(
        Config(upgrade_controller=True), recorder, caches=io.caches, io=io, clock=lambda: T0
    )
    await controller.gate_review.review()
    await controller.gate_review.review()
    assert [r.reason for r in recorder.reports] == ["GPUConsumerGateMissing"]
    gate = controller.status()["gate"]
    assert gate["state"] == "missing" and gate["mode"] == "cluster-policy"
    [verdict] = gate["verdicts"]
    assert verdict["policy"] == "ClusterPolicy/cluster-policy"
    assert "races the driver restart" in verdict["message"]
    io.set_cluster_policies([ex.cluster_policy(pod_selector=WANTED, timeout_seconds=600)])
    await controller.gate_review.review()
    assert controller.status()["gate"]["state"] == "ok" and len(recorder.reports) == 1
    io.set_cluster_policies([ex.cluster_policy()])  # broken again: reported again (one series)
    await controller.gate_review.review()
    assert [r.reason for r in recorder.reports] == ["GPUConsumerGateMissing"] * 2
    assert recorder.reports[0].key == recorder.reports[1].key


async def test_follower_logs_but_does_not_send_the_gate_warning() -> None:
    io = ex.FakeUpgradeIO([], [], cluster_policies=[ex.cluster_policy()])
    recorder = Recorder()
    controller = UpgradeReconciler(
        Config(upgrade_controller=True), recorder, caches=io.caches, io=io, is_leader=lambda: False
    )
    await controller.gate_review.review()
    assert recorder.reports == [] and controller.status()["gate"]["state"] == "missing"


async def test_every_replica_logs_the_gate_warning_once_per_finding(
    caplog: pytest.LogCaptureFixture,
) -> None:
    io = ex.FakeUpgradeIO([], [], cluster_policies=[ex.cluster_policy()])
    controller = UpgradeReconciler(
        Config(upgrade_controller=True),
        Recorder(),
        caches=io.caches,
        io=io,
        is_leader=lambda: False,
    )

    def warned() -> int:
        return sum(
            r.levelno == logging.WARNING and "GPUConsumerGateMissing" in r.getMessage()
            for r in caplog.records
        )

    with caplog.at_level(logging.WARNING, logger="shared_svc.upgrade.controller"):
        await controller.gate_review.review()
        await controller.gate_review.review()
        assert warned() == 1
        io.set_cluster_policies([ex.cluster_policy(pod_selector=WANTED, timeout_seconds=600)])
        await controller.gate_review.review()
        io.set_cluster_policies([ex.cluster_policy()])  # broken again: said again
        await controller.gate_review.review()
        await controller.gate_review.review()
    assert warned() == 2
