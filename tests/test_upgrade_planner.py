"""The planner, state by state: free, keep, restore, nothing, abort; timeouts; restarts."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from shared_svc.upgrade import record, states
from shared_svc.upgrade.node_plan import NodePlan, NodeStatus, deleted_patch
from shared_svc.upgrade.planner import plan_node
from shared_svc.upgrade.settings import UpgradeSettings
from testenv import upgrade_examples as ex

PARKED = "nvidia.com/gpu-driver-upgrade.parked"
RECORD = "shared-svc.nvidia.com/gpu-driver-upgrade-freed"
S = UpgradeSettings()
T0 = 1_700_000_000.0


def plan(node, pods=(), daemonsets=(), settings=S, now=T0) -> NodePlan:
    return plan_node(node, list(pods), list(daemonsets), settings, now)


def step(node, pods, plan_: NodePlan, blocked=frozenset()):
    if plan_.patch is not None:
        node = ex.apply_patch(node, plan_.patch)
    for action in plan_.pod_actions:
        pods = ex.apply_pod_action(pods, action, blocked)
    # The controller's record write after the deletes it saw accepted (every delete here).
    deletes = {a.uid for a in plan_.pod_actions if a.verb == "delete"}
    if (after := deleted_patch(plan_, deletes)) is not None:
        node = ex.apply_patch(node, after)
    return node, pods


def at_state(node, state):
    node = json.loads(json.dumps(node))
    key = states.state_label_key("gpu")
    if state is None:
        node["metadata"]["labels"].pop(key, None)
    else:
        node["metadata"]["labels"][key] = state
    return node


def evicted(plan_: NodePlan) -> set[str]:
    return {a.key for a in plan_.pod_actions if a.verb == "evict"}


def reasons(plan_: NodePlan) -> list[str]:
    return [r.reason for r in plan_.reports]


@pytest.mark.parametrize("state", sorted(states.FREE_STATES))
def test_free_states_evict_declared_park_and_record(state: str) -> None:
    node = ex.node(state=state)
    pods = [ex.declared_pod("triton"), ex.pod("web")]
    p = plan(node, pods)
    assert evicted(p) == {"ml/triton"}
    assert p.patch is not None and dict(p.patch.labels) == {PARKED: "true"}
    rec = record.decode(dict(p.patch.annotations)[RECORD])
    assert rec.parked_label and [x.key for x in rec.pods] == ["ml/triton"]
    assert rec.pods[0].first_attempt == T0
    assert p.status.phase == "freeing" and p.status.pending == ("ml/triton",)
    assert p.patch.resource_version == "1"


@pytest.mark.parametrize(
    "state", sorted(states.KEEP_STATES | states.NOTHING_STATES | {"node-maintenance-required"})
)
def test_other_states_never_free(state: str) -> None:
    p = plan(ex.node(state=state), [ex.declared_pod("triton")])
    assert p.writes == () and p.reports == ()


@pytest.mark.parametrize(
    "state", sorted(states.KEEP_STATES | {"upgrade-required", "node-maintenance-required"})
)
def test_keep_and_nothing_states_keep_what_was_freed(state: str) -> None:
    node, pods = ex.node(state="pod-restart-required"), [ex.declared_pod("triton")]
    node, pods = step(node, pods, plan(node, pods))
    node = at_state(node, state)
    p = plan(node, pods, now=T0 + 10_000)
    assert p.writes == ()
    assert p.status.phase in ("parked", "waiting") and p.status.parked_by_us


def test_keep_state_puts_back_a_parked_label_someone_removed() -> None:
    node, pods = ex.node(state="drain-required"), []
    node, _ = step(node, pods, plan(node, pods))
    node = at_state(node, "validation-required")
    del node["metadata"]["labels"][PARKED]
    p = plan(node)
    assert (
        p.patch is not None
        and dict(p.patch.labels) == {PARKED: "true"}
        and p.patch.annotations == ()
    )


def test_upgrade_done_restores_exactly_and_clears_the_record() -> None:
    node, pods = ex.node(state="cordon-required"), [ex.declared_pod("triton")]
    node, pods = step(node, pods, plan(node, pods))
    node = at_state(node, "upgrade-done")
    p = plan(node, [], now=T0 + 100)
    assert p.patch is not None
    assert dict(p.patch.labels) == {PARKED: None} and dict(p.patch.annotations) == {RECORD: None}
    assert reasons(p) == ["GPUConsumersRestored"] and "ml/triton" in p.reports[0].note
    restored, _ = step(node, [], p)
    assert (
        PARKED not in restored["metadata"]["labels"]
        and RECORD not in restored["metadata"]["annotations"]
    )
    assert plan(restored, []).writes == ()


def test_restore_leaves_a_parked_label_we_did_not_set() -> None:
    node = ex.node(state="cordon-required", parked=True)
    p = plan(node)
    assert p.patch is not None and p.patch.labels == ()
    assert record.decode(dict(p.patch.annotations)[RECORD]).parked_label is False
    node, _ = step(node, [], p)
    p = plan(at_state(node, "upgrade-done"))
    assert (
        p.patch is not None and p.patch.labels == () and dict(p.patch.annotations) == {RECORD: None}
    )


def test_upgrade_done_without_record_does_nothing() -> None:
    assert plan(ex.node(state="upgrade-done", parked=True)).writes == ()


def test_label_vanished_is_an_abort_that_restores() -> None:
    node, pods = ex.node(state="pod-deletion-required"), [ex.declared_pod("triton")]
    node, pods = step(node, pods, plan(node, pods))
    p = plan(at_state(node, None), pods)
    assert reasons(p) == ["UpgradeAborted"] and p.reports[0].type == "Warning"
    assert p.patch is not None and dict(p.patch.labels) == {PARKED: None}
    assert p.status.mode == "abort" and p.pod_actions == ()


def test_no_label_no_record_nothing() -> None:
    assert plan(ex.node(state=None), [ex.declared_pod("a")]).writes == ()


def test_record_survives_restart_and_second_plan_writes_nothing() -> None:
    node, pods = ex.node(state="cordon-required"), [ex.declared_pod("triton")]
    node, pods = step(node, pods, plan(node, pods))
    # A new process plans from the node alone: same answer, nothing left to write.
    again = plan(node, pods, now=T0 + 1)
    assert again.writes == () and again.reports == ()
    assert again.status.pending == ("ml/triton",)  # terminating, waiting to go


def test_freed_is_reported_once_when_every_consumer_is_gone() -> None:
    node, pods = ex.node(state="cordon-required"), [ex.declared_pod("triton")]
    node, pods = step(node, pods, plan(node, pods))
    p = plan(node, [], now=T0 + 3)  # the pod is gone
    assert reasons(p) == ["GPUConsumersFreed"] and p.status.phase == "freed"
    node, _ = step(node, [], p)
    assert record.decode(node["metadata"]["annotations"][RECORD]).freed_at == T0 + 3
    assert plan(node, [], now=T0 + 4).writes == ()
    assert plan(node, [], now=T0 + 4).reports == ()


def test_declared_daemonset_pods_hold_the_node_until_gone() -> None:
    ds = ex.daemonset("dcgm-exporter", declared=True)
    node = ex.node(state="pod-restart-required")
    dspod = ex.daemonset_pod(ds)
    p = plan(node, [dspod], [ds])
    assert p.pod_actions == ()  # DaemonSet pods are never evicted: the label parks them
    assert (
        p.status.daemonset_pods == ("monitoring/dcgm-exporter-node-1",)
        and p.status.phase == "freeing"
    )
    assert p.requeue_after == S.poll_seconds
    node, _ = step(node, [dspod], p)
    assert reasons(plan(node, [], [ds])) == ["GPUConsumersFreed"]


def test_operator_hook_daemonsets_are_only_reported() -> None:
    ds = ex.daemonset("standalone", node_selector={"nvidia.com/gpu.deploy.client": "true"})
    p = plan(ex.node(state="pod-restart-required"), [ex.daemonset_pod(ds)], [ds])
    assert p.pod_actions == () and p.status.operator_hook_pods == ("monitoring/standalone-node-1",)
    assert p.status.phase == "freed"


def test_detected_report_mode_reports_once_and_evicts_nothing() -> None:
    node, pods = ex.node(state="cordon-required"), [ex.pod("vst", runtime_class="nvidia")]
    p = plan(node, pods)
    assert p.pod_actions == () and reasons(p) == ["GPUConsumersDetected", "GPUConsumersFreed"]
    assert "ml/vst" in p.reports[0].note and p.status.detected == ("ml/vst",)
    node, pods = step(node, pods, p)
    assert plan(node, pods, now=T0 + 5).writes == ()


def test_detected_evict_mode_evicts() -> None:
    p = plan(
        ex.node(state="cordon-required"),
        [ex.pod("vst", runtime_class="nvidia")],
        settings=replace(S, detection="evict"),
    )
    assert evicted(p) == {"ml/vst"}


def test_detection_off_ignores_undeclared() -> None:
    p = plan(
        ex.node(state="cordon-required"),
        [ex.pod("vst", runtime_class="nvidia")],
        settings=replace(S, detection="off"),
    )
    assert p.pod_actions == () and p.status.detected == ()


def test_refused_eviction_is_retried_then_reported_after_the_timeout() -> None:
    settings = replace(S, eviction_timeout_seconds=60)
    blocked = frozenset({"ml/triton"})
    node, pods = ex.node(state="cordon-required"), [ex.declared_pod("triton")]
    node, pods = step(node, pods, plan(node, pods, settings=settings), blocked)
    p = plan(node, pods, settings=settings, now=T0 + 30)
    assert evicted(p) == {"ml/triton"} and p.patch is None and p.reports == ()
    assert p.requeue_after == pytest.approx(5.0)
    p = plan(node, pods, settings=replace(settings, poll_seconds=100), now=T0 + 30)
    assert p.requeue_after == pytest.approx(30.0)  # wake up exactly at the timeout
    p = plan(node, pods, settings=settings, now=T0 + 60)
    assert reasons(p) == ["GPUConsumerEvictionBlocked"] and p.reports[0].type == "Warning"
    assert [a.verb for a in p.pod_actions] == ["evict"]  # no delete unless configured
    assert p.status.blocked == ("ml/triton",)
    node, pods = step(node, pods, p, blocked)
    later = plan(node, pods, settings=settings, now=T0 + 90)
    assert later.reports == () and later.patch is None  # reported once


def test_timeout_clock_survives_restart_through_the_record() -> None:
    settings = replace(S, eviction_timeout_seconds=60, delete_after_timeout=True)
    node, pods = ex.node(state="cordon-required"), [ex.declared_pod("triton")]
    node, pods = step(node, pods, plan(node, pods, settings=settings), frozenset({"ml/triton"}))
    # A fresh planner 61 s later knows the first attempt from the annotation alone.
    p = plan(node, pods, settings=settings, now=T0 + 61)
    assert [(a.verb, a.uid) for a in p.pod_actions] == [("delete", "uid-ml-triton")]
    assert reasons(p) == ["GPUConsumerEvictionBlocked"]
    rec = record.decode(dict(p.patch.annotations)[RECORD]) if p.patch else None
    # Blocked (the Warning rides with this patch); deleted only once the delete is accepted.
    assert rec is not None and rec.pods[0].blocked and not rec.pods[0].deleted
    after = deleted_patch(p, {"uid-ml-triton"})
    assert after is not None and after.resource_version is None and after.labels == ()
    assert record.decode(dict(after.annotations)[RECORD]).pods[0].deleted
    assert deleted_patch(p, set()) is None  # refused (403, a 500): the record says not deleted


def test_a_refused_delete_is_planned_again_and_never_recorded_deleted_or_reported_twice() -> None:
    settings = replace(S, eviction_timeout_seconds=60, delete_after_timeout=True)
    node, pods = ex.node(state="cordon-required"), [ex.declared_pod("triton")]
    refused = frozenset({"ml/triton"})
    node, pods = step(node, pods, plan(node, pods, settings=settings), refused)
    first = plan(node, pods, settings=settings, now=T0 + 61)
    assert reasons(first) == ["GPUConsumerEvictionBlocked"] and first.patch is not None
    node = ex.apply_patch(node, first.patch)  # the delete is refused: pods unchanged
    again = plan(node, pods, settings=settings, now=T0 + 70)
    assert [a.verb for a in again.pod_actions] == ["delete"] and again.reports == ()
    assert again.patch is None and again.status.blocked == ("ml/triton",)
    assert not record.decode(node["metadata"]["annotations"][RECORD]).pods[0].deleted
    node, pods = step(node, pods, again)  # accepted this time
    assert record.decode(node["metadata"]["annotations"][RECORD]).pods[0].deleted


def test_successor_pod_with_new_uid_restarts_the_clock() -> None:
    node, pods = ex.node(state="cordon-required"), [ex.declared_pod("db-0")]
    node, _ = step(node, pods, plan(node, pods))
    successor = [ex.declared_pod("db-0", uid="uid-new")]
    p = plan(node, successor, now=T0 + 1000)
    assert [(a.verb, a.uid) for a in p.pod_actions] == [("evict", "uid-new")] and p.reports == ()


def test_invalid_record_is_replaced_and_the_label_not_claimed() -> None:
    node = ex.node(state="cordon-required", parked=True, annotations={RECORD: "{oops"})
    p = plan(node)
    assert "UpgradeRecordInvalid" in reasons(p) and p.status.record_error
    assert (
        record.decode(dict(p.patch.annotations)[RECORD]).parked_label is False if p.patch else False
    )
    done = plan(ex.node(state="upgrade-done", parked=True, annotations={RECORD: "[]"}))
    assert (
        done.patch is not None
        and done.patch.labels == ()
        and dict(done.patch.annotations) == {RECORD: None}
    )
    # In a keep state an unreadable record is left alone and not reported again and again.
    assert plan(ex.node(state="validation-required", annotations={RECORD: "x"})).writes == ()


def test_other_driver_names_use_their_own_keys() -> None:
    settings = replace(S, driver_name="ofed")
    node = ex.node(state="cordon-required", driver="ofed")
    p = plan(node, settings=settings)
    assert p.patch is not None
    assert dict(p.patch.labels) == {"nvidia.com/ofed-driver-upgrade.parked": "true"}
    assert [k for k, _ in p.patch.annotations] == [
        "shared-svc.nvidia.com/ofed-driver-upgrade-freed"
    ]
    assert (
        plan(ex.node(state="cordon-required"), settings=settings).writes == ()
    )  # gpu label: not ours


def test_reports_regard_the_node_with_stable_keys() -> None:
    node = ex.node(state="cordon-required")
    p1, p2 = (
        plan(node, [ex.pod("v", runtime_class="nvidia")]),
        plan(node, [ex.pod("v", runtime_class="nvidia")], now=T0 + 1),
    )
    ref = p1.reports[0].regarding
    assert (ref.api_version, ref.kind, ref.name, ref.uid) == ("v1", "Node", "node-1", "uid-node-1")
    assert p1.reports[0].key == p2.reports[0].key


def test_patch_body_touches_only_our_keys_and_carries_resource_version() -> None:
    p = plan(ex.node(state="cordon-required", resource_version="42"))
    assert p.patch is not None
    body = p.patch.body()
    assert body["metadata"]["resourceVersion"] == "42"
    assert set(body["metadata"]["labels"]) == {PARKED} and set(body["metadata"]["annotations"]) == {
        RECORD
    }


def test_status_is_json_serialisable() -> None:
    p = plan(ex.node(state="cordon-required"), [ex.declared_pod("a")])
    json.dumps(p.status.as_dict())


# --- issue 10, items 15-19 ---

CONSUMER = {"nvidia.com/gpu-driver-upgrade.consumer": "true"}


@pytest.mark.parametrize(
    "ds",
    [
        ex.daemonset("exporter"),  # never prepared
        ex.daemonset(  # partly: the second ORed term lacks the expression, the pod may stay
            "exporter",
            terms=[
                {"matchExpressions": [{"key": PARKED, "operator": "DoesNotExist"}]},
                {"matchExpressions": [{"key": "zone", "operator": "Exists"}]},
            ],
        ),
    ],
    ids=["unprepared", "partial"],
)
def test_unprepared_daemonset_consumer_blocks_the_node_and_is_reported_once(ds) -> None:
    node = ex.node(state="pod-restart-required")
    dspod = ex.daemonset_pod(ds, labels=CONSUMER)
    p = plan(node, [dspod], [ds])
    assert p.status.phase == "freeing" and "GPUConsumersFreed" not in reasons(p)
    assert p.status.unprepared_daemonsets == ("monitoring/exporter",)
    assert p.pod_actions == ()  # evicting a DaemonSet's pod is useless: it comes back at once
    (warning,) = [r for r in p.reports if r.reason == "GPUConsumerDaemonSetNotPrepared"]
    assert warning.type == "Warning"
    assert "monitoring/exporter" in warning.note and "prepare-daemonset" in warning.note
    assert p.requeue_after == S.poll_seconds  # look again: it may be prepared and leave
    node, pods = step(node, [dspod], p)
    again = plan(node, pods, [ds], now=T0 + 10)
    assert again.reports == () and again.writes == () and again.status.phase == "freeing"
    # Prepared, the DaemonSet controller removes its pod from the parked node: freed.
    freed = plan(node, [], [ex.daemonset("exporter", declared=True)], now=T0 + 20)
    assert reasons(freed) == ["GPUConsumersFreed"] and freed.status.phase == "freed"


def test_daemonset_pod_without_the_consumer_label_does_not_hold_the_node() -> None:
    ds = ex.daemonset("exporter")
    p = plan(ex.node(state="pod-restart-required"), [ex.daemonset_pod(ds)], [ds])
    assert p.status.phase == "freed" and p.status.unprepared_daemonsets == ()


def test_refused_pending_and_evicted_are_apart() -> None:
    settings = replace(S, eviction_timeout_seconds=60)
    blocked = frozenset({"ml/guarded"})
    node = ex.node(state="cordon-required")
    pods = [ex.declared_pod("guarded"), ex.declared_pod("leaving")]
    p = plan(node, pods, settings=settings)
    assert p.status.pending == ("ml/guarded", "ml/leaving")  # asked now: no outcome yet
    assert p.status.evicted == p.status.refused == p.status.blocked == ()
    node, pods = step(node, pods, p, blocked)
    p = plan(node, pods, settings=settings, now=T0 + 5)
    assert p.status.pending == ("ml/guarded", "ml/leaving")  # both still on the node
    assert p.status.evicted == ("ml/leaving",)  # accepted, terminating
    assert p.status.refused == ("ml/guarded",)  # a PodDisruptionBudget said no: retried
    assert p.status.blocked == ()
    p = plan(node, pods, settings=settings, now=T0 + 60)
    assert p.status.blocked == ("ml/guarded",) and p.status.refused == ()
    assert p.status.evicted == ("ml/leaving",)


def test_evicted_pod_stuck_terminating_past_the_timeout_is_reported_once() -> None:
    settings = replace(S, eviction_timeout_seconds=60)
    node, pods = ex.node(state="cordon-required"), [ex.declared_pod("slow")]
    node, pods = step(node, pods, plan(node, pods, settings=settings))
    # The API server marks an accepted eviction: deletionTimestamp = asked + grace.
    pods[0]["metadata"]["deletionTimestamp"] = record.format_time(T0 + 1 + 30)
    pods[0]["metadata"]["deletionGracePeriodSeconds"] = 30
    p = plan(node, pods, settings=settings, now=T0 + 40)
    assert p.reports == () and p.status.stuck == () and p.status.evicted == ("ml/slow",)
    p = plan(node, pods, settings=replace(settings, poll_seconds=100), now=T0 + 40)
    assert p.requeue_after == pytest.approx(21.0)  # wake up when it becomes stuck
    p = plan(node, pods, settings=settings, now=T0 + 61)
    (warning,) = p.reports
    assert (warning.reason, warning.type) == ("GPUConsumerStuckTerminating", "Warning")
    assert "ml/slow" in warning.note and p.status.stuck == ("ml/slow",)
    assert p.pod_actions == ()  # not evicted again
    node, pods = step(node, pods, p)
    later = plan(node, pods, settings=settings, now=T0 + 200)
    assert later.reports == () and later.writes == () and later.status.stuck == ("ml/slow",)


@pytest.mark.parametrize("state", ["another-future-state", "some-future-state"])
def test_unknown_state_keeps_and_gives_a_notice_not_tied_to_a_write(state: str) -> None:
    node, pods = ex.node(state="pod-restart-required"), [ex.declared_pod("triton")]
    node, pods = step(node, pods, plan(node, pods))
    p = plan(at_state(node, state), pods, now=T0 + 5)
    assert p.status.mode == "keep" and p.status.unknown_state and p.writes == ()
    assert p.reports == ()  # nothing to write, so no record keeps it from repeating...
    (notice,) = p.notices  # ...the shell sends it once per node and value
    assert (notice.reason, notice.type) == ("UpgradeStateUnknown", "Warning")
    assert state in notice.note
    other = plan(at_state(node, "other-state"), pods, now=T0 + 5).notices[0]
    assert other.key != notice.key
    assert plan(at_state(node, "validation-required"), pods).notices == ()


def test_the_per_pod_step_evicts_retries_reports_and_deletes_after_the_timeout() -> None:
    from shared_svc.upgrade.pods import pod_step
    from shared_svc.upgrade.record import FreedPod

    pod = ex.declared_pod("triton")
    s = replace(S, eviction_timeout_seconds=60)
    first = pod_step(pod, None, "declared: x", s, T0)
    assert first.fresh and first.action is not None and first.action.verb == "evict"
    assert first.entry == FreedPod("ml", "triton", "uid-ml-triton", T0) and first.deadline == 60
    entry = first.entry
    retry = pod_step(pod, entry, "declared: x", s, T0 + 20)
    assert (retry.action.verb if retry.action else None, retry.deadline) == ("evict", 40)
    assert retry.entry == entry and retry.finding is None and not retry.fresh
    late = pod_step(pod, entry, "declared: x", s, T0 + 61)
    assert late.finding is not None and late.finding.reason == "GPUConsumerEvictionBlocked"
    assert late.entry == replace(entry, blocked=True) and late.action is not None
    assert late.action.why == "retry after timeout"
    deleting = pod_step(pod, entry, "x", replace(s, delete_after_timeout=True), T0 + 61)
    assert deleting.action is not None and deleting.action.verb == "delete"
    assert deleting.entry == replace(entry, blocked=True)  # deleted once it was accepted
    again = pod_step(pod, late.entry, "x", s, T0 + 70)
    assert again.finding is None and again.entry == late.entry  # reported once
    leaving = ex.declared_pod("triton", terminating=True)
    assert pod_step(leaving, None, "x", s, T0) == type(first)(None)  # not ours: nothing


def test_the_planner_settings_take_their_defaults_from_config() -> None:
    from shared_svc.config import Config

    assert UpgradeSettings() == UpgradeSettings.from_config(Config.model_construct())


# --- issue 22: which pods a pass reads ---


def _index(*daemonsets):
    from shared_svc.upgrade.daemonsets import index_daemonsets

    return index_daemonsets(daemonsets, PARKED)


def test_a_node_being_freed_reads_its_pods_but_the_operator_namespace_s() -> None:
    from shared_svc.upgrade.pods import pods_read

    operand = ex.daemonset("nvidia-dcgm-exporter", namespace="gpu-operator")
    read = pods_read(ex.node(state="cordon-required"), _index(operand), S)
    assert (read.needed, read.skip_namespace) == (True, "gpu-operator")
    assert not read.admits(ex.daemonset_pod(operand))
    assert read.admits(ex.declared_pod("job"))


def test_a_node_neither_freed_nor_recorded_reads_no_pod() -> None:
    from shared_svc.upgrade.pods import pods_read

    for state in (None, "upgrade-required", "upgrade-done", "validation-required"):
        assert not pods_read(ex.node(state=state), {}, S).needed, state
    freed, _ = step(ex.node(state="cordon-required"), [], plan(ex.node(state="cordon-required")))
    for state in ("upgrade-done", "validation-required", None):  # a record of ours: read
        assert pods_read(at_state(freed, state), {}, S).needed, state


@pytest.mark.parametrize("hook", [False, True])
def test_a_declared_or_hook_daemonset_in_the_operator_namespace_makes_the_pass_read_it(
    hook: bool,
) -> None:
    from shared_svc.upgrade.pods import pods_read

    ds = ex.daemonset(
        "exporter",
        namespace="gpu-operator",
        declared=not hook,
        node_selector={"nvidia.com/gpu.deploy.client": "true"} if hook else None,
    )
    node = ex.node(state="cordon-required")
    read = pods_read(node, _index(ds), S)
    assert read.skip_namespace is None
    # ... as its pod holds the node (declared) or is shown (hook):
    shown = plan(node, [ex.daemonset_pod(ds)], [ds]).status
    assert (shown.operator_hook_pods if hook else shown.daemonset_pods) == (
        "gpu-operator/exporter-node-1",
    )


def test_a_record_naming_a_pod_of_the_operator_namespace_makes_the_pass_read_it() -> None:
    """A record written under another ``namespace`` setting: its pod's outcome is read."""
    from shared_svc.upgrade.pods import pods_read

    node = ex.node(state="cordon-required")
    pods = [ex.declared_pod("job", namespace="ml")]
    node, pods = step(node, pods, plan(node, pods), blocked=frozenset({"ml/job"}))
    moved = replace(S, operator_namespace="ml")
    assert pods_read(node, {}, moved).skip_namespace is None
    assert plan(node, pods, settings=moved, now=T0 + 1).status.refused == ("ml/job",)


def test_a_node_status_as_a_dict_is_every_field_with_tuples_as_lists() -> None:
    """``/status`` serializes hundreds of node statuses on every call: ``as_dict`` reads the
    fields flat instead of ``dataclasses.asdict``'s deep copy, and says the same."""
    import dataclasses

    status = NodeStatus(
        node="n",
        state="upgrade-required",
        mode="free",
        phase="freeing",
        parked_label=False,
        parked_by_us=False,
        since="2026-12-01T00:00:00Z",
        freed_at=None,
        pending=("ns/a", "ns/b"),
        record_error="x",
    )
    expected = {
        k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(status).items()
    }
    assert status.as_dict() == expected
    assert list(status.as_dict()) == [f.name for f in dataclasses.fields(NodeStatus)]
