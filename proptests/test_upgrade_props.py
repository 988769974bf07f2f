"""Properties of the driver-upgrade planner over any sequence of states and restarts.

The planner is re-run from the node alone at every step (a restart at every step), and
its writes are applied fully, partly (a crash after the node patch) or not at all.
- Every change is undone: after upgrade-done (or the label vanishing), the node's labels
  and annotations are what they were before, apart from the state label.
- Nothing outside the declared/detected set is touched, and only our keys are written.
- Idempotent: applying a plan and planning again gives no new writes (save retried
  evictions of pods a PodDisruptionBudget still protects).
- Evicted, refused and blocked pods are shown apart; a node where a declared consumer of
  a DaemonSet that was never prepared still runs is never reported freed.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from proptests.strategies import json_values, set_at
from shared_svc.controllers.upgrade.io import PASS_PODS
from shared_svc.upgrade import daemonsets as daemonsets_module
from shared_svc.upgrade import record, states
from shared_svc.upgrade.consumers import POD_READS
from shared_svc.upgrade.node_plan import NodePlan, deleted_patch
from shared_svc.upgrade.planner import plan_node
from shared_svc.upgrade.pods import pods_read
from shared_svc.upgrade.resync import at_rest, resync_keys, settled
from shared_svc.upgrade.settings import UpgradeSettings
from testenv import upgrade_examples as ex
from tests.realistic import api_pod

PARKED = "nvidia.com/gpu-driver-upgrade.parked"
RECORD = "shared-svc.nvidia.com/gpu-driver-upgrade-freed"
STATE = states.state_label_key("gpu")
OURS = {PARKED, RECORD}

EXCLUSIONS = ("gpu_resource", "operator_ns", "daemonset", "mirror", "finished", "operand", "claims")
SIGNALS = ("runtime", "env", "host_path", "void_runtime")


@dataclass(frozen=True)
class Traits:
    declared: bool
    signal: str | None
    exclusion: str | None
    blocked: bool


traits = st.builds(
    Traits,
    declared=st.booleans(),
    signal=st.none() | st.sampled_from(SIGNALS),
    exclusion=st.none() | st.sampled_from(EXCLUSIONS),
    blocked=st.booleans(),
)


def build_pod(i: int, t: Traits) -> dict:
    kw: dict = {"labels": {"nvidia.com/gpu-driver-upgrade.consumer": "true"} if t.declared else {}}
    if t.signal == "runtime":
        kw["runtime_class"] = "nvidia"
    elif t.signal == "void_runtime":
        kw.update(runtime_class="nvidia", env={"NVIDIA_VISIBLE_DEVICES": "void"})
    elif t.signal == "env":
        kw["env"] = {"NVIDIA_VISIBLE_DEVICES": "all"}
    elif t.signal == "host_path":
        kw["host_paths"] = ("/dev/nvidia0",)
    extra = {
        "gpu_resource": {"resources": {"limits": {"nvidia.com/gpu": 1}}},
        "operator_ns": {"namespace": "gpu-operator"},
        "daemonset": {"owner_kind": "DaemonSet"},
        "mirror": {"annotations": {"kubernetes.io/config.mirror": "x"}},
        "finished": {"phase": "Succeeded"},
        "operand": {"node_selector": {"nvidia.com/gpu.deploy.dcgm": "true"}},
        "claims": {"resource_claims": True},
    }.get(t.exclusion or "", {})
    return ex.pod(f"p{i}", **kw, **extra)


def may_touch(t: Traits, detection: str) -> bool:
    if t.exclusion is not None:
        return False
    detected = t.signal in ("runtime", "env", "host_path")
    return t.declared or (detection == "evict" and detected)


step = st.tuples(
    st.sampled_from([*sorted(states.ALL_STATES), None, "node-maintenance-required"]),
    st.integers(0, 400),  # seconds until this step
    st.sampled_from(["all", "patch-only", "none"]),  # how much of the plan lands (crashes)
    st.booleans(),  # the kubelet finishes terminating pods before this step
)


def apply(
    node: dict, pods: list[dict], plan: NodePlan, how: str, blocked: frozenset[str]
) -> tuple[dict, list[dict]]:
    if how != "none" and plan.patch is not None:
        node = ex.apply_patch(node, plan.patch)
    if how == "all":
        for action in plan.pod_actions:
            pods = ex.apply_pod_action(pods, action, blocked)
    return node, pods


def with_state(node: dict, state: str | None) -> dict:
    node = copy.deepcopy(node)
    node["metadata"]["labels"].pop(STATE, None)
    if state is not None:
        node["metadata"]["labels"][STATE] = state
    return node


def comparable(node: dict) -> tuple[dict, dict]:
    meta = node["metadata"]
    return (
        {k: v for k, v in meta["labels"].items() if k != STATE},
        dict(meta.get("annotations") or {}),
    )


@given(
    pod_traits=st.lists(traits, max_size=6),
    steps=st.lists(step, min_size=1, max_size=12),
    detection=st.sampled_from(["off", "report", "evict"]),
    delete_after_timeout=st.booleans(),
    parked_before=st.booleans(),
    final=st.sampled_from(["upgrade-done", None]),
)
def test_any_sequence_is_undone_touches_only_consumers_and_is_idempotent(
    pod_traits: list[Traits],
    steps: list[tuple[str | None, int, str, bool]],
    detection: str,
    delete_after_timeout: bool,
    parked_before: bool,
    final: str | None,
) -> None:
    settings = UpgradeSettings(detection=detection, delete_after_timeout=delete_after_timeout)  # type: ignore[arg-type]
    others = {"nvidia.com/gpu.deploy.dcgm-exporter": "true", "kubernetes.io/hostname": "node-1"}
    annotations = {"nvidia.com/gpu-driver-upgrade-enabled": "true"}
    node = ex.node(state=None, labels=others, annotations=annotations, parked=parked_before)
    before = comparable(node)
    pods = [build_pod(i, t) for i, t in enumerate(pod_traits)]
    allowed = {f"ml/p{i}" for i, t in enumerate(pod_traits) if may_touch(t, detection)}
    allowed |= {f"gpu-operator/p{i}" for i, t in enumerate(pod_traits) if may_touch(t, detection)}
    blocked = frozenset(f"ml/p{i}" for i, t in enumerate(pod_traits) if t.blocked)
    now = 1_700_000_000.0
    unprepared_consumer = any(t.declared and t.exclusion == "daemonset" for t in pod_traits)

    for state, dt, how, kubelet in [*steps, (final, 1, "all", False)]:
        now += dt
        if kubelet:
            pods = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        node = with_state(node, state)
        plan = plan_node(node, pods, [], settings, now)
        if plan.patch is not None:
            touched = {k for k, _ in plan.patch.labels} | {k for k, _ in plan.patch.annotations}
            assert touched <= OURS
        assert {a.key for a in plan.pod_actions} <= allowed
        status = plan.status
        outcomes = [set(status.evicted), set(status.refused), set(status.blocked)]
        assert sum(map(len, outcomes)) == len(set().union(*outcomes))  # shown apart
        assert set(status.stuck) <= set(status.evicted)
        if state in states.FREE_STATES and unprepared_consumer:
            # A declared consumer of a DaemonSet never prepared stays: never freed.
            assert status.phase == "freeing" and status.unprepared_daemonsets
            assert "GPUConsumersFreed" not in [r.reason for r in plan.reports]
        node, pods = apply(node, pods, plan, how, blocked)
        if how == "all":
            again = plan_node(node, pods, [], settings, now)
            assert again.patch is None, again.patch
            assert all(a.key in blocked and a.verb == "evict" for a in again.pod_actions)
            assert again.reports == ()

    assert comparable(node) == before


# --- issue 33: the resync leaves out only the nodes a pass cannot change ---


@given(
    pod_traits=st.lists(traits, max_size=5),
    steps=st.lists(step, min_size=1, max_size=10),
    detection=st.sampled_from(["off", "report", "evict"]),
    parked_before=st.booleans(),
    later=st.integers(0, 10_000),
    kubelet_later=st.booleans(),
)
def test_a_node_the_resync_leaves_out_would_plan_nothing_and_show_the_same(
    pod_traits: list[Traits],
    steps: list[tuple[str | None, int, str, bool]],
    detection: str,
    parked_before: bool,
    later: int,
    kubelet_later: bool,
) -> None:
    """After any step (its plan landed fully, partly or not at all), the controller holds
    the status of that pass and the cache the node as it is now. If ``resync_keys`` leaves
    the node out, a pass on it at any later time, whatever the pods did meanwhile, plans no
    write, no Event and no notice, and shows what is shown."""
    settings = UpgradeSettings(detection=detection)  # type: ignore[arg-type]
    node = ex.node(state=None, parked=parked_before)
    pods = [build_pod(i, t) for i, t in enumerate(pod_traits)]
    blocked = frozenset(f"ml/p{i}" for i, t in enumerate(pod_traits) if t.blocked)
    now = 1_700_000_000.0
    for state, dt, how, kubelet in steps:
        now += dt
        if kubelet:
            pods = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        node = with_state(node, state)
        plan = plan_node(node, pods, [], settings, now)
        node, pods = apply(node, pods, plan, how, blocked)
        shown = {"node-1": plan.status}
        if "node-1" in resync_keys([node], shown, "gpu"):
            continue
        assert at_rest(node, "gpu") and settled(plan.status)
        if kubelet_later:
            pods = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        again = plan_node(node, pods, [], settings, now + later)
        assert (again.patch, again.pod_actions, again.reports, again.notices) == (None, (), (), ())
        assert again.status == plan.status
        assert not pods_read(node, {}, settings).needed
    # A node shown that is no longer cached is always looked at again (its pass drops it).
    assert resync_keys([], {"node-1": plan.status}, "gpu") == {"node-1"}


# --- issue 19: a failed delete after the eviction timeout ---

BLOCKED = "GPUConsumerEvictionBlocked"
DELETE_FATES = ("accepted", "refused", "refused-once")  # a 403 for good, or one transient 500

shell_step = st.tuples(
    st.integers(0, 120),  # seconds until this step (the eviction timeout is 60 s)
    st.booleans(),  # the node patch lands (else 409: the pass ends before its pod actions)
    st.booleans(),  # the kubelet finishes terminating pods before this step
)


@given(
    fates=st.lists(st.tuples(st.sampled_from(DELETE_FATES), st.booleans()), max_size=4),
    steps=st.lists(shell_step, min_size=1, max_size=10),
    delete_after_timeout=st.booleans(),
)
def test_a_record_never_says_deleted_for_a_pod_whose_delete_did_not_succeed_and_a_blocked_report_is_planned_until_sent(
    fates: list[tuple[str, bool]],
    steps: list[tuple[int, bool, bool]],
    delete_after_timeout: bool,
) -> None:
    """The controller's rules, played on the pure planner: a plan's reports are sent once
    its node patch is written, whatever its pod actions do; ``deleted_patch`` is written
    for the deletes the API server accepted."""
    settings = UpgradeSettings(
        eviction_timeout_seconds=60.0, delete_after_timeout=delete_after_timeout
    )
    node = ex.node(state="cordon-required")
    pods = [ex.declared_pod(f"p{i}") for i in range(len(fates))]
    pdb = frozenset(f"ml/p{i}" for i, (_, guarded) in enumerate(fates) if guarded)
    fate = {f"uid-ml-p{i}": f for i, (f, _) in enumerate(fates)}
    refusals: dict[str, int] = {}
    accepted: set[str] = set()  # uids whose delete the API server accepted
    sent: list[str] = []  # keys of the blocked Warnings sent
    now = 1_700_000_000.0
    for dt, lands, kubelet in [*steps, (61, True, False), (61, True, False)]:
        now += dt
        if kubelet:
            pods = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        plan = plan_node(node, pods, [], settings, now)
        before = (
            record.decode(node["metadata"]["annotations"][RECORD]) if has_record(node) else None
        )
        live = {p["metadata"]["uid"]: p for p in pods if not p["metadata"].get("deletionTimestamp")}
        for entry in before.pods if before else ():
            due = entry.uid in live and now - entry.first_attempt >= 60.0
            if due and not any(k.endswith(f"{entry.key}/{entry.uid}") for k in sent):
                assert any(
                    r.reason == BLOCKED and r.key.endswith(f"{entry.key}/{entry.uid}")
                    for r in plan.reports
                ), (entry, plan.reports)  # not sent yet: planned again
        if plan.patch is not None and not lands:
            continue
        if plan.patch is not None:
            node = ex.apply_patch(node, plan.patch)
        sent += [r.key for r in plan.reports if r.reason == BLOCKED]
        done: set[str] = set()
        for action in plan.pod_actions:
            if action.verb == "delete":
                refusals[action.uid] = refusals.get(action.uid, 0) + 1
                verdict = fate[action.uid]
                if verdict == "refused" or (
                    verdict == "refused-once" and refusals[action.uid] == 1
                ):
                    continue
                done.add(action.uid)
            pods = ex.apply_pod_action(pods, action, pdb)
        accepted |= done
        if (after := deleted_patch(plan, done)) is not None:
            node = ex.apply_patch(node, after)
        rec = record.decode(node["metadata"]["annotations"][RECORD]) if has_record(node) else None
        for entry in rec.pods if rec else ():
            assert not entry.deleted or entry.uid in accepted, entry
            reported = [k for k in sent if k.endswith(f"{entry.key}/{entry.uid}")]
            assert len(reported) == (1 if entry.blocked else 0), (entry, sent)
    assert len(sent) == len(set(sent))  # each Warning once


def has_record(node: dict) -> bool:
    return RECORD in (node["metadata"].get("annotations") or {})


# --- issue 22: a pass reads only the pods its plan depends on ---

DS_KINDS = ("declared", "hook", "partial", "other")
NAMESPACES = ("ml", "gpu-operator")


def build_daemonset(kind: str, namespace: str) -> dict:
    if kind == "declared":
        return ex.daemonset(f"ds-{kind}", namespace=namespace, declared=True)
    if kind == "hook":
        return ex.daemonset(
            f"ds-{kind}",
            namespace=namespace,
            node_selector={"nvidia.com/gpu.deploy.client": "true"},
        )
    if kind == "partial":
        plain = {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}
        ds = ex.daemonset(f"ds-{kind}", namespace=namespace, declared=True, terms=[plain])
        terms = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]["nodeSelectorTerms"]
        terms.append(plain)  # one term without the parked requirement
        return ds
    return ex.daemonset(f"ds-{kind}", namespace=namespace)


@given(
    pod_traits=st.lists(st.tuples(traits, st.sampled_from(NAMESPACES)), max_size=5),
    daemonsets=st.lists(
        st.tuples(
            st.sampled_from(DS_KINDS),
            st.sampled_from(NAMESPACES),
            st.booleans(),  # its pod carries the consumer label
            st.sampled_from(["Running", "Succeeded"]),
        ),
        max_size=4,
        unique_by=lambda d: (d[0], d[1]),
    ),
    steps=st.lists(
        st.tuples(
            st.sampled_from([*sorted(states.ALL_STATES), None]),
            st.integers(0, 400),
            st.booleans(),  # the kubelet finishes terminating pods before this step
            st.sampled_from(NAMESPACES),  # the operator namespace setting of this pass
        ),
        min_size=1,
        max_size=8,
    ),
    detection=st.sampled_from(["off", "report", "evict"]),
    driver=st.none()
    | st.tuples(
        st.sampled_from(["d1", "d2", None]),  # the driver pod's digest
        st.sampled_from(["d1", None]),  # the template's
        st.booleans(),  # the driver pod is terminating
        st.sampled_from([1, 2]),  # its pod-template-generation (the DaemonSet's is 2)
    ),
    bumps=st.lists(st.booleans(), max_size=8),  # the driver's digest changes before a step
)
def test_a_plan_over_the_pods_the_pass_reads_is_the_plan_over_every_pod_of_the_node(
    pod_traits: list[tuple[Traits, str]],
    daemonsets: list[tuple[str, str, bool, str]],
    steps: list[tuple[str | None, int, bool, str]],
    detection: str,
    driver: tuple[str | None, str | None, bool, int] | None,
    bumps: list[bool],
) -> None:
    """``pods_read`` decides before the list which pods a pass reads (none, or all but the
    operator namespace's, and maybe its driver pods); whatever the node, its record (the
    restart-only verdict too), the DaemonSets (the driver's too) and the operator namespace
    setting, the plan on those pods equals the plan on every pod bound to it."""
    ds_objects = [build_daemonset(kind, ns) for kind, ns, _, _ in daemonsets]
    driver_pods = []
    if driver is not None:
        pod_digest, template_digest, terminating, generation = driver
        ds_objects.append(ex.driver_daemonset(template_digest, generation=2))
        driver_pods.append(
            ex.driver_pod(
                ds_objects[-1], digest=pod_digest, generation=generation, terminating=terminating
            )
        )
    pods = []
    for i, (t, ns) in enumerate(pod_traits):
        pod = build_pod(i, t)
        if t.exclusion != "operator_ns":
            pod["metadata"]["namespace"] = ns
            pod["metadata"]["uid"] = f"uid-{ns}-p{i}"
        pods.append(pod)
    for ds, (_, _, labelled, phase) in zip(ds_objects[: len(daemonsets)], daemonsets, strict=True):
        labels = {"nvidia.com/gpu-driver-upgrade.consumer": "true"} if labelled else {}
        pods.append(ex.daemonset_pod(ds, labels=labels, phase=phase))
    pods += driver_pods
    blocked = frozenset(  # a PodDisruptionBudget refuses their evictions
        f"{p['metadata']['namespace']}/{p['metadata']['name']}"
        for p, (t, _) in zip(pods, pod_traits, strict=False)
        if t.blocked
    )
    node = ex.node(state=None)
    now = 1_700_000_000.0
    for (state, dt, kubelet, operator_ns), bump in zip(steps, [*bumps, *[False] * 8], strict=False):
        now += dt
        if kubelet:
            pods = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        if bump and driver is not None:
            ds_objects[-1] = ex.driver_daemonset(f"d{now:.0f}", generation=3)
        node = with_state(node, state)
        settings = UpgradeSettings(detection=detection, operator_namespace=operator_ns)  # type: ignore[arg-type]
        index = daemonsets_module.index_daemonsets(ds_objects, PARKED)
        read = pods_read(node, index, settings, ds_objects)
        everything = plan_node(node, pods, ds_objects, settings, now)
        assert plan_node(node, [p for p in pods if read.admits(p)], ds_objects, settings, now) == (
            everything
        )
        node, pods = apply(node, pods, everything, "all", blocked)


# --- issue 28: the restart-only path and the full path, shared-svc down at any step ---

# (state, the driver pod on the node): "old" of the template before the change, "leaving"
# that pod terminating (the libs deleted it), "new" of the current template.
RESTART_ONLY_FLOW = (
    ("upgrade-done", "old"),
    ("upgrade-required", "old"),
    ("pod-restart-required", "old"),
    ("pod-restart-required", "leaving"),
    ("pod-restart-required", "new"),
    ("validation-required", "new"),
    ("uncordon-required", "new"),
    ("upgrade-done", "new"),
)
FULL_FLOW = (
    ("upgrade-done", "old"),
    ("upgrade-required", "old"),
    ("cordon-required", "old"),
    ("wait-for-jobs-required", "old"),
    ("pod-deletion-required", "old"),
    ("pod-restart-required", "old"),
    ("pod-restart-required", "leaving"),
    ("pod-restart-required", "new"),
    ("validation-required", "new"),
    ("uncordon-required", "new"),
    ("upgrade-done", "new"),
)


@given(
    restart_only=st.booleans(),
    looks=st.lists(st.sampled_from(["all", "patch-only", "none", "down"]), min_size=11),
)
def test_the_restart_only_path_frees_nothing_and_the_full_path_frees_whatever_shared_svc_missed(
    restart_only: bool, looks: list[str]
) -> None:
    """The libs' two paths, step by step, with shared-svc down (``down``: no plan), or
    crashing after the node patch (``patch-only``) or before it (``none``), at any step; it
    always sees the last. On the restart-only path nothing is evicted or parked once a
    verdict was written while the old driver pod was there; otherwise it guessed, frees,
    and said so once. On the full path it never takes the restart-only side. Either way
    the node ends as it began."""
    flow = RESTART_ONLY_FLOW if restart_only else FULL_FLOW
    driver = ex.driver_daemonset("d1" if restart_only else "d2", generation=2)
    exporter = ex.daemonset("dcgm-exporter", declared=True)
    node = ex.node(state=None, labels={"kubernetes.io/hostname": "node-1"})
    before = comparable(node)
    consumer = ex.declared_pod("triton")
    driver_pods = {
        "old": ex.driver_pod(driver, digest="d1", generation=1),
        "leaving": ex.driver_pod(driver, digest="d1", generation=1, terminating=True),
        "new": new_pod(driver),
    }
    now = 1_700_000_000.0
    sent: list[str] = []  # the reasons of the reports of plans whose patch landed
    evicted = parked = False
    decided: str | None = None  # what the first landed plan in pod-restart-required saw
    steps = list(zip(flow, [*looks[: len(flow) - 1], "all"], strict=True))
    for (state, driver_pod), look in steps:
        now += 10
        node = with_state(node, state)
        parked_now = PARKED in node["metadata"]["labels"]
        pods = [driver_pods[driver_pod]]
        if not evicted:
            pods.append(consumer)
        if not parked_now:
            pods.append(ex.daemonset_pod(exporter))  # the DaemonSet controller's
        if look == "down":
            continue
        plan = plan_node(node, pods, [driver, exporter], UpgradeSettings(), now)
        assert plan.record is None or plan.record.restart_only is None or restart_only
        if look == "none" or (plan.patch is None and look != "all"):
            continue
        if plan.patch is not None:
            node = ex.apply_patch(node, plan.patch)
            parked = parked or PARKED in dict(plan.patch.labels)
            if state == "pod-restart-required" and decided is None:
                decided = driver_pod
        sent += [r.reason for r in plan.reports]
        if look == "all":
            evicted = evicted or any(a.key == "ml/triton" for a in plan.pod_actions)
    if restart_only and decided in ("old", "leaving"):
        assert not evicted and not parked, sent
        assert sent.count("UpgradeRestartOnly") == 1 and "UpgradePathGuessed" not in sent
    elif restart_only and decided == "new":  # the old driver pod was gone: no evidence
        assert parked and sent.count("UpgradePathGuessed") == 1, sent
        assert "UpgradeRestartOnly" not in sent and "GPUConsumersRestored" in sent, sent
    elif restart_only:  # never saw pod-restart-required: nothing to do
        assert not evicted and not parked and sent == [], sent
    else:
        assert "UpgradeRestartOnly" not in sent, sent
        assert "UpgradePathGuessed" not in sent or decided == "new", sent
        assert parked == ("GPUConsumersRestored" in sent), sent
    assert comparable(node) == before


def new_pod(driver: dict) -> dict:
    digest = driver["spec"]["template"]["spec"]["containers"][0]["env"][-1]["value"]
    return ex.driver_pod(driver, digest=digest, generation=2, suffix="new")


# --- the wave: a pass decodes only the fields of its pods the planner reads ---

# Where an odd value (any JSON) may sit: fields the planner reads and fields it does not.
POD_PATHS = (
    ("metadata",),
    ("metadata", "labels"),
    ("metadata", "annotations"),
    ("metadata", "ownerReferences"),
    ("metadata", "deletionTimestamp"),
    ("metadata", "deletionGracePeriodSeconds"),
    ("metadata", "uid"),
    ("metadata", "managedFields"),
    ("spec",),
    ("spec", "containers"),
    ("spec", "initContainers"),
    ("spec", "volumes"),
    ("spec", "runtimeClassName"),
    ("spec", "nodeSelector"),
    ("spec", "resourceClaims"),
    ("spec", "tolerations"),
    ("status",),
    ("status", "phase"),
    ("status", "conditions"),
    ("zzz",),
)


def fleshed(pod: dict, i: int) -> dict:
    """``pod`` with the fields the API server adds to a workload's pod that a pass does not
    read (``tests/realistic``: managedFields, images, mounts, probes, conditions...), and
    none of the ones it reads (those stay the example's)."""
    full = api_pod("gpu-job", f"p{i}", "node-1", common=False)

    def extra(part: dict, read: dict) -> dict:
        return {k: v for k, v in part.items() if k not in read}

    out = {**extra(full, POD_READS), **pod}
    out["metadata"] = {**extra(full["metadata"], POD_READS["metadata"]), **pod["metadata"]}
    out["spec"] = {**extra(full["spec"], POD_READS["spec"]), **pod["spec"]}
    container = extra(full["spec"]["containers"][0], POD_READS["spec"]["containers"][0])
    out["spec"]["containers"] = [{**container, **c} for c in pod["spec"]["containers"]]
    out["status"] = {**extra(full["status"], POD_READS["status"]), **pod["status"]}
    return out


def planned(node: dict, pods: Any, settings: UpgradeSettings, now: float) -> Any:
    """The plan, or the error it raises (an odd value may break a read: then it must
    break the same way on both)."""
    try:
        return plan_node(node, pods, [], settings, now)
    except Exception as exc:  # compared, not hidden
        return type(exc)


# What a pod may carry besides its traits, in fields the planner reads.
POD_EXTRAS = {
    "init-signal": ("spec", "initContainers"),
    "terminating": ("metadata", "deletionTimestamp"),
    "grace": ("metadata", "deletionGracePeriodSeconds"),
}


def with_extra(pod: dict, extra: str) -> None:
    if extra == "init-signal":
        env = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
        pod["spec"]["initContainers"] = [{"name": "init", "image": "x", "env": env}]
    elif extra == "terminating":
        pod["metadata"]["deletionTimestamp"] = "2025-12-31T23:50:00Z"
    else:
        pod["metadata"]["deletionGracePeriodSeconds"] = 3600


@example(  # a detected consumer by its init container's env alone
    pod_traits=[Traits(False, None, None, False)],
    extras=[(0, "init-signal")],
    odd=[],
    states_seen=[],
    steps_apart=60,
    detection="evict",
    indent=None,
)
@example(  # evicted, then terminating past the timeout by its grace period alone
    pod_traits=[Traits(True, None, None, False)],
    extras=[(0, "grace")],
    odd=[],
    states_seen=["cordon-required", "cordon-required"],
    steps_apart=60,
    detection="off",
    indent=None,
)
@given(
    pod_traits=st.lists(traits, min_size=1, max_size=5),
    extras=st.lists(st.tuples(st.integers(0, 4), st.sampled_from(sorted(POD_EXTRAS))), max_size=3),
    odd=st.lists(st.tuples(st.integers(0, 4), st.sampled_from(POD_PATHS), json_values), max_size=2),
    states_seen=st.lists(st.sampled_from([*sorted(states.ALL_STATES), None]), max_size=6),
    steps_apart=st.sampled_from([60, 4000]),  # seconds: within the eviction timeout, or past it
    detection=st.sampled_from(["off", "report", "evict"]),
    indent=st.sampled_from([None, 2]),
)
def test_a_plan_over_the_fields_a_pass_decodes_is_the_plan_over_whole_pods(
    pod_traits: list[Traits],
    extras: list[tuple[int, str]],
    odd: list[tuple[int, tuple[str, ...], Any]],
    states_seen: list[str | None],
    steps_apart: int,
    detection: str,
    indent: int | None,
) -> None:
    """``io.PASS_PODS`` (msgspec, ``consumers.POD_READS``) decodes of a pass's pod list
    only what the planner reads, or leaves the text to ``json.loads``: whatever the pods
    (realistic, with odd values in read and unread fields) and the node's states and
    record, each pass (the pods listed again, as the API server writes them) plans what
    it plans over the whole pods."""
    pods = [fleshed(build_pod(i, t), i) for i, t in enumerate(pod_traits)]
    for i, extra in extras:
        if i < len(pods):
            with_extra(pods[i], extra)
    for i, path, value in odd:
        if i < len(pods):
            set_at(pods[i], path, value)
    settings = UpgradeSettings(detection=detection, delete_after_timeout=True)  # type: ignore[arg-type]
    # Just before the deletionTimestamp an accepted eviction sets (``ex.apply_pod_action``).
    node, now = ex.node(state=None), 1_767_225_500.0
    for state in ["cordon-required", *states_seen]:  # freeing first: every pod is read
        now += steps_apart
        node = with_state(node, state)
        text = json.dumps({"kind": "PodList", "items": pods}, indent=indent).encode()
        decoded = PASS_PODS.page(text)
        plan = planned(node, json.loads(text)["items"], settings, now)
        if decoded is not None:
            assert planned(node, decoded["items"], settings, now) == plan
        if isinstance(plan, NodePlan):
            node = ex.apply_patch(node, plan.patch) if plan.patch is not None else node
            pods = [terminated(p, plan) for p in pods]


def terminated(pod: Any, plan: NodePlan) -> Any:
    """``pod`` after the plan's evictions and deletes are accepted (odd pods as they are)."""
    meta = pod.get("metadata") if isinstance(pod, dict) else None
    if not isinstance(meta, dict):
        return pod
    hit = any(
        (meta.get("namespace"), meta.get("name"), meta.get("uid")) == (a.namespace, a.name, a.uid)
        for a in plan.pod_actions
    )
    return (
        {**pod, "metadata": {**meta, "deletionTimestamp": "2026-01-01T00:00:00Z"}} if hit else pod
    )


def test_a_realistic_pod_list_is_decoded_by_the_pass_not_left_to_json() -> None:
    """So the property above does not hold by always reading the exact way; and the
    decoded pods keep nothing the planner does not read."""
    pods = [fleshed(build_pod(i, Traits(True, "runtime", None, False)), i) for i in range(3)]
    decoded = PASS_PODS.page(json.dumps({"items": pods}).encode())
    assert decoded is not None and len(decoded["items"]) == 3
    assert "managedFields" not in decoded["items"][0]["metadata"]
    assert "image" not in decoded["items"][0]["spec"]["containers"][0]
