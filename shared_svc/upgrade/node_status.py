"""What status reports of a node: the status of a plan (``plan_status``, the service's
``/status``) and the status recorded on a node (``recorded_status``, ``upgrade status``),
and which nodes it lists. Pure, as ``planner.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from shared_svc.k8s import objects
from shared_svc.k8s.objects import K8sObject
from shared_svc.upgrade import consumers, daemonsets, record, states
from shared_svc.upgrade.node_plan import Builder, NodeStatus, Phase, node_mode, read_record
from shared_svc.upgrade.pods import Freeing, NodePods, pod_identity, pod_outcomes
from shared_svc.upgrade.policy import NodeFlow
from shared_svc.upgrade.record import Record


def plan_status(
    b: Builder,
    pods: list[K8sObject],
    ds_index: Mapping[str, daemonsets.DaemonSetRef],
    current: Record | None,
    record_error: str | None,
    freeing: Freeing | None,
) -> NodeStatus:
    driver = b.settings.driver_name
    labels = objects.labels_of(b.node)
    state = labels.get(states.state_label_key(driver))
    mode = node_mode(state, b.flow)
    shown = b.record or current
    found = freeing.pods if freeing else NodePods()
    return NodeStatus(
        node=b.name,
        mode=mode,
        phase=freeing.phase if freeing else _phase(mode, shown),
        parked_label=daemonsets.parked_label_key(driver) in labels,
        pending=freeing.pending if freeing else (),
        detected=found.detected,
        daemonset_pods=found.daemonset_pods,
        operator_hook_pods=found.operator_hook_pods,
        unprepared_daemonsets=tuple(sorted(found.unprepared)),
        **_of_record(
            shown,
            state,
            ds_index,
            record_error,
            b.flow,
            pod_outcomes(shown, pods, freeing.fresh if freeing else frozenset()),
        ),
    )


def _of_record(
    rec: Record | None,
    state: str | None,
    ds_index: Mapping[str, daemonsets.DaemonSetRef],
    record_error: str | None,
    flow: NodeFlow | None,
    outcomes: Mapping[str, tuple[str, ...]],
) -> dict[str, Any]:
    """The fields of a ``NodeStatus`` that both statuses take alike from the record, the
    state, the DaemonSets and the flow, and the record's pods' ``outcomes``."""
    path, evidence, driver_ds = _path(rec)
    return {
        "state": state,
        "parked_by_us": bool(rec and rec.parked_label),
        "since": record.format_time(rec.since) if rec else None,
        "freed_at": record.format_time(rec.freed_at) if rec and rec.freed_at is not None else None,
        "partial_daemonsets": _partial(ds_index),
        "restart_race": rec.restart_race if rec else (),
        "path": path,
        "path_evidence": evidence,
        "driver_daemonset": driver_ds,
        "unknown_state": states.is_unknown(state),
        "record_error": record_error,
        "policy": _policy_of(flow),
        "no_flow": flow.no_flow if flow else None,
        **outcomes,
    }


def _policy_of(flow: NodeFlow | None) -> str | None:
    """``NodeStatus.policy``: the policy source that governs the node, if known."""
    return flow.policy.where if flow is not None and flow.policy is not None else None


def _path(rec: Record | None) -> tuple[str | None, str | None, str | None]:
    """The path our record shows, what told it when it was decided (``paths.Evidence``: a
    restart-only verdict is told by the driver pod; a freeing record without
    ``pathEvidence`` was started in a state before ``pod-restart-required``) and the driver
    DaemonSet of a restart-only verdict."""
    if rec is None:
        return None, None, None
    if rec.restart_only is not None:
        return "restart-only", "driver-pod", rec.restart_only.daemonset
    return "full", rec.path_evidence or "state", None


def _partial(ds_index: Mapping[str, daemonsets.DaemonSetRef]) -> tuple[str, ...]:
    return tuple(sorted(ref.key for ref in ds_index.values() if ref.kind == "partial"))


def _phase(mode: states.Mode, rec: Record | None) -> Phase:
    """The phase of a node that a plan does not free (``_free`` decides that one)."""
    if rec is None:
        return "idle"
    if rec.restart_only is not None:
        return "restart-only"
    return {
        "free": "freed" if rec.freed_at is not None else "freeing",
        "keep": "parked",
        "nothing": "waiting",
        "restore": "restoring",
        "abort": "aborting",
    }[mode]


def recorded_status(
    node: K8sObject,
    pods: Iterable[K8sObject],
    daemonset_objects: Iterable[K8sObject],
    driver_name: str,
    flow: NodeFlow | None = None,
) -> NodeStatus:
    """What the service recorded on the node, next to the pods on it now (``upgrade status``).

    Nothing is re-derived from settings (eviction timeout, consumer selector, detection):
    those are the service's, and the command does not know them. Blocked, stuck,
    detected and unprepared come from the record's flags; ``pending`` are the recorded
    pods still on the node and, while freeing, the pods of declared and unprepared
    DaemonSets.
    """
    labels = objects.labels_of(node)
    raw = objects.annotation(node, record.record_annotation_key(driver_name))
    rec, record_error = read_record(raw)
    state = labels.get(states.state_label_key(driver_name))
    mode = node_mode(state, flow)
    parked_key = daemonsets.parked_label_key(driver_name)
    ds_index = daemonsets.index_daemonsets(daemonset_objects, parked_key)
    pods = [p for p in pods if not consumers.is_finished(p)]
    live = {consumers.pod_key(p): p for p in pods}
    still = [  # recorded pods still here (terminating ones too: they hold the GPU until gone)
        e.key for e in (rec.pods if rec else ()) if pod_identity(live.get(e.key, {}))[2] == e.uid
    ]
    ds_pods: list[str] = []
    hook_pods: list[str] = []
    unprepared: set[str] = set()
    if mode == "free" and not (rec and rec.restart_only):
        reported = set(rec.unprepared_reported) if rec else set()
        for key, pod in live.items():
            owner = daemonsets.owning_daemonset(pod, ds_index)
            if owner is not None and owner.kind == "declared":
                ds_pods.append(key)
            elif owner is not None and owner.kind == "operator-hook":
                hook_pods.append(key)
            elif (ds_key := daemonsets.owner_key(pod)) in reported:
                unprepared.add(str(ds_key))
    return NodeStatus(
        node=objects.name_of(node),
        mode=mode,
        phase=_phase(mode, rec) if rec is not None or mode != "free" else "freeing",
        parked_label=parked_key in labels,
        pending=tuple(sorted(still)),
        detected=tuple(k for k in (rec.detected_reported if rec else ()) if k in live),
        daemonset_pods=tuple(sorted(ds_pods)),
        operator_hook_pods=tuple(sorted(hook_pods)),
        unprepared_daemonsets=tuple(sorted(unprepared)),
        **_of_record(rec, state, ds_index, record_error, flow, pod_outcomes(rec, pods)),
    )


def listed(status: NodeStatus) -> bool:
    """Upgrading (a freeing or keep state) or still parked / recorded: what ``upgrade status`` shows."""
    return (
        status.mode in ("free", "keep")
        or status.since is not None
        or status.parked_label
        or status.record_error is not None
    )
