"""The restart-only path (issue 28): gpu-operator >= v26.7.0 restarts the driver pod in place
when its ``DRIVER_CONFIG_DIGEST`` equals the DaemonSet template's; the node goes
``upgrade-required`` -> ``pod-restart-required`` and shared-svc frees nothing there. The
evidence that survives a restart of shared-svc: its record, the states, the old driver pod."""

from __future__ import annotations

import pytest

from shared_svc.upgrade import paths, record, states
from shared_svc.upgrade.node_plan import NodePlan
from shared_svc.upgrade.pods import pods_read
from shared_svc.upgrade.record import RestartOnly
from shared_svc.upgrade.settings import UpgradeSettings
from testenv import upgrade_examples as ex
from tests.test_upgrade_planner import at_state, plan, reasons

PARKED = "nvidia.com/gpu-driver-upgrade.parked"
RECORD = "shared-svc.nvidia.com/gpu-driver-upgrade-freed"
STATE = states.state_label_key("gpu")
S = UpgradeSettings()
T0 = 1_700_000_000.0


def applied(node, p: NodePlan):
    return ex.apply_patch(node, p.patch) if p.patch is not None else node


def recorded(node) -> record.Record | None:
    raw = node["metadata"]["annotations"].get(RECORD)
    return None if raw is None else record.decode(raw)


def world(*, old_digest="d1", new_digest="d1", terminating=True):
    """A driver DaemonSet at generation 2 (template digest ``new_digest``), the old driver pod
    of generation 1 (``old_digest``) on the node, a declared consumer and a prepared
    DaemonSet's pod."""
    driver = ex.driver_daemonset(new_digest, generation=2)
    exporter = ex.daemonset("dcgm-exporter", declared=True)
    pods = [
        ex.driver_pod(driver, digest=old_digest, generation=1, terminating=terminating),
        ex.declared_pod("triton"),
        ex.daemonset_pod(exporter),
    ]
    return [driver, exporter], pods


def new_driver_pod(driver, digest="d1"):
    return ex.driver_pod(driver, digest=digest, generation=2, suffix="new")


# --- the rule ---


def test_the_restart_only_rule_is_equal_non_empty_digests() -> None:
    def spec(*, containers=(), init=()):
        return {
            "containers": [{"name": "c", "env": list(e)} for e in containers],
            "initContainers": [{"name": "i", "env": list(e)} for e in init],
        }

    digest = [{"name": "DRIVER_CONFIG_DIGEST", "value": "abc"}]
    other = [{"name": "DRIVER_CONFIG_DIGEST", "value": "xyz"}]
    assert paths.restart_only(spec(containers=[digest]), spec(containers=[digest]))
    assert paths.restart_only(spec(init=[digest]), spec(containers=[[], digest]))
    assert not paths.restart_only(spec(containers=[digest]), spec(containers=[other]))
    assert not paths.restart_only(spec(), spec())  # none, as before gpu-operator v26.7.0
    assert not paths.restart_only(spec(containers=[digest]), spec())
    empty = [{"name": "DRIVER_CONFIG_DIGEST", "value": ""}]
    assert not paths.restart_only(spec(containers=[empty]), spec(containers=[empty]))
    ref = [{"name": "DRIVER_CONFIG_DIGEST", "valueFrom": {"configMapKeyRef": {"name": "x"}}}]
    assert not paths.restart_only(spec(containers=[ref]), spec(containers=[ref]))
    # The first literal counts: the driver container's before the init container's.
    assert paths.config_digest(spec(containers=[digest], init=[other])) == "abc"
    assert paths.config_digest("not a spec") is None


# --- the restart-only path ---


def test_restart_only_path_frees_nothing_records_the_verdict_and_reports_once() -> None:
    daemonsets, pods = world()
    node = ex.node(state="pod-restart-required")
    p = plan(node, pods, daemonsets)
    assert p.pod_actions == ()
    assert p.patch is not None and p.patch.labels == ()  # no parked label
    rec = record.decode(dict(p.patch.annotations)[RECORD])
    assert rec.restart_only == RestartOnly("gpu-operator/nvidia-driver-daemonset", "d1")
    assert rec.pods == () and not rec.parked_label
    assert reasons(p) == ["UpgradeRestartOnly"]
    assert p.reports[0].type == "Normal" and "gpu-operator/nvidia-driver-daemonset-old" in (
        p.reports[0].note
    )
    s = p.status
    assert (s.path, s.path_evidence, s.phase) == ("restart-only", "driver-pod", "restart-only")
    assert s.driver_daemonset == "gpu-operator/nvidia-driver-daemonset"
    node = applied(node, p)
    # A restart of shared-svc later: the old driver pod is gone, the new one in sync. The
    # record decides; nothing to write, nothing said again.
    pods = [new_driver_pod(daemonsets[0]), *pods[1:]]
    again = plan(node, pods, daemonsets, now=T0 + 30)
    assert again.writes == () and again.reports == ()
    assert (again.status.path, again.status.path_evidence) == ("restart-only", "driver-pod")
    for state in ("validation-required", "uncordon-required", "upgrade-failed"):
        kept = plan(at_state(node, state), pods, daemonsets)
        assert kept.writes == () and kept.reports == () and kept.status.phase == "restart-only"
    done = plan(at_state(node, "upgrade-done"), pods, daemonsets)
    assert done.pod_actions == () and done.reports == ()  # nothing to restore, nothing said
    assert done.patch is not None and dict(done.patch.annotations) == {RECORD: None}
    assert done.patch.labels == ()
    node = applied(at_state(node, "upgrade-done"), done)
    assert plan(node, pods, daemonsets).writes == ()


def test_an_old_driver_pod_not_deleted_yet_is_told_by_its_template_generation() -> None:
    daemonsets, pods = world(terminating=False)
    p = plan(ex.node(state="pod-restart-required"), pods, daemonsets)
    assert p.status.path == "restart-only" and p.pod_actions == ()


def test_an_abort_drops_the_verdict_without_a_word() -> None:
    daemonsets, pods = world()
    node = applied(
        ex.node(state="pod-restart-required"),
        plan(ex.node(state="pod-restart-required"), pods, daemonsets),
    )
    p = plan(at_state(node, None), pods, daemonsets)
    assert p.reports == () and p.patch is not None
    assert dict(p.patch.annotations) == {RECORD: None} and p.patch.labels == ()


def test_a_parked_label_not_ours_is_left_on_the_restart_only_path() -> None:
    daemonsets, pods = world()
    node = ex.node(state="pod-restart-required", parked=True)
    p = plan(node, pods, daemonsets)
    assert p.patch is not None and p.patch.labels == ()
    done = plan(at_state(applied(node, p), "upgrade-done"), pods, daemonsets)
    assert done.patch is not None and done.patch.labels == ()


# --- the full path ---


@pytest.mark.parametrize("old", ["d0", None])
def test_digests_that_differ_are_the_full_path_and_free_as_before(old: str | None) -> None:
    daemonsets, pods = world(old_digest=old)
    p = plan(ex.node(state="pod-restart-required"), pods, daemonsets)
    assert {a.key for a in p.pod_actions} == {"ml/triton"}
    assert p.patch is not None and dict(p.patch.labels) == {PARKED: "true"}
    rec = record.decode(dict(p.patch.annotations)[RECORD])
    assert rec.path_evidence == "driver-pod" and rec.restart_only is None
    assert "UpgradePathGuessed" not in reasons(p)
    assert (p.status.path, p.status.path_evidence) == ("full", "driver-pod")


def test_no_digest_on_either_side_is_the_full_path() -> None:
    """gpu-operator before v26.7.0 sets no digest: the libs take the full path."""
    daemonsets, pods = world(old_digest=None, new_digest=None)
    p = plan(ex.node(state="pod-restart-required"), pods, daemonsets)
    assert p.status.path == "full" and {a.key for a in p.pod_actions} == {"ml/triton"}


def test_an_orphaned_driver_pod_is_the_full_path() -> None:
    daemonsets, pods = world()
    del pods[0]["metadata"]["ownerReferences"]
    p = plan(ex.node(state="pod-restart-required"), pods, daemonsets)
    assert (p.status.path, p.status.path_evidence) == ("full", "driver-pod")


def test_a_record_of_freeing_in_this_upgrade_is_the_full_path() -> None:
    """Freed in cordon-required, then shared-svc restarted: in pod-restart-required the
    record says full, whatever the driver pods show."""
    daemonsets, pods = world()
    node = ex.node(state="cordon-required")
    first = plan(node, pods, daemonsets)
    assert first.status.path_evidence == "state" and first.pod_actions
    node = at_state(applied(node, first), "pod-restart-required")
    p = plan(node, pods, daemonsets, now=T0 + 5)
    assert (p.status.path, p.status.path_evidence) == ("full", "state")
    assert p.status.phase == "freeing" and recorded(applied(node, p)).restart_only is None


def test_no_evidence_frees_and_says_it_guessed_once() -> None:
    daemonsets, pods = world()
    pods = [new_driver_pod(daemonsets[0]), *pods[1:]]  # the old driver pod is gone
    node = ex.node(state="pod-restart-required")
    p = plan(node, pods, daemonsets)
    assert {a.key for a in p.pod_actions} == {"ml/triton"}
    # (and the prepared DaemonSet's pod is still there at the driver restart: that Warning too)
    assert reasons(p) == ["UpgradePathGuessed", "GPUConsumersAtDriverRestart"]
    assert p.reports[0].type == "Warning" and "no record" in p.reports[0].note
    assert (p.status.path, p.status.path_evidence) == ("full", "guess")
    node = applied(node, p)
    assert recorded(node).path_evidence == "guess"
    again = plan(node, pods, daemonsets, now=T0 + 1)
    assert "UpgradePathGuessed" not in reasons(again)
    assert (again.status.path, again.status.path_evidence) == ("full", "guess")


def test_a_driver_change_during_the_restart_revokes_the_verdict() -> None:
    daemonsets, pods = world()
    node = ex.node(state="pod-restart-required")
    node = applied(node, plan(node, pods, daemonsets))
    changed = [ex.driver_daemonset("d2", generation=3), daemonsets[1]]
    p = plan(node, pods, changed, now=T0 + 20)
    assert {a.key for a in p.pod_actions} == {"ml/triton"}
    assert dict(p.patch.labels) == {PARKED: "true"}
    assert reasons(p) == ["UpgradePathChanged", "GPUConsumersAtDriverRestart"]
    rec = record.decode(dict(p.patch.annotations)[RECORD])
    assert rec.restart_only is None and rec.path_evidence == "changed" and rec.since == T0 + 20


def test_a_later_upgrade_on_the_full_path_replaces_a_restart_only_verdict() -> None:
    """upgrade-failed after a restart-only restart, then relabelled: the flow takes the full
    path (cordon-required): freed as any full upgrade."""
    daemonsets, pods = world()
    node = ex.node(state="pod-restart-required")
    node = at_state(applied(node, plan(node, pods, daemonsets)), "cordon-required")
    p = plan(node, pods, daemonsets, now=T0 + 60)
    assert {a.key for a in p.pod_actions} == {"ml/triton"}
    rec = record.decode(dict(p.patch.annotations)[RECORD])
    assert rec.restart_only is None and rec.parked_label and rec.since == T0 + 60


# --- what a pass reads ---


def test_a_pass_reads_the_driver_pods_only_to_decide_and_nothing_once_decided() -> None:
    daemonsets, pods = world()
    index = {}
    node = ex.node(state="pod-restart-required")
    read = pods_read(node, index, S, daemonsets)
    assert read.needed and read.skip_namespace == "gpu-operator" and read.driver_pods
    assert read.driver_namespace == "gpu-operator"
    assert read.admits(pods[0]) and not read.admits(ex.pod("operand", namespace="gpu-operator"))
    node = applied(node, plan(node, pods, daemonsets))
    assert not pods_read(node, index, S, daemonsets).needed  # the verdict holds
    changed = [ex.driver_daemonset("d2", generation=3)]
    assert pods_read(node, index, S, changed).needed  # revoked: the consumers are read
    for state in ("validation-required", "upgrade-done", None):
        assert not pods_read(at_state(node, state), index, S, daemonsets).needed
    # Earlier freeing states and a freeing record need no driver pod.
    assert not pods_read(ex.node(state="cordon-required"), index, S, daemonsets).driver_pods


# --- the requestor-mode states ---


@pytest.mark.parametrize("state", sorted(states.REQUESTOR_STATES))
def test_requestor_mode_states_keep_what_was_freed_and_free_nothing_new(state: str) -> None:
    node, pods = ex.node(state="drain-required"), [ex.declared_pod("triton")]
    node = applied(node, plan(node, pods))
    p = plan(at_state(node, state), [*pods, ex.declared_pod("new")], now=T0 + 5)
    assert p.status.mode == "keep" and not p.status.unknown_state
    assert p.pod_actions == () and p.notices == () and p.reports == ()
    assert p.status.parked_by_us and p.status.phase == "parked"
