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
from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from shared_svc.upgrade import states
from shared_svc.upgrade.planner import NodePlan, plan_node
from shared_svc.upgrade.settings import UpgradeSettings
from testenv import upgrade_examples as ex

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
