"""The per-node plan: node, its pods, DaemonSets, settings and ``now`` in; writes out.

``plan_node`` is pure. Its only memory is our record annotation on the node, so running
it again after a restart, or after its writes were applied, gives the same answer: a
plan whose writes are already done has none left (``NodePlan.writes`` is empty).
Every Report goes with the record write that keeps it from repeating. The plan and its
types are ``node_plan.py``; the pods, ``pods.py``; what status reports, ``node_status.py``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import replace

from shared_svc.k8s import objects
from shared_svc.k8s.events import Report
from shared_svc.k8s.objects import K8sObject
from shared_svc.upgrade import consumers, daemonsets, gate, paths, record, states
from shared_svc.upgrade.node_plan import (
    PARKED_VALUE,
    Builder,
    NodePatch,
    NodePlan,
    node_mode,
    read_record,
)
from shared_svc.upgrade.node_status import plan_status
from shared_svc.upgrade.paths import RESTART_STATE, Verdict
from shared_svc.upgrade.pods import Freeing, pod_identity, pod_step, sort_pods
from shared_svc.upgrade.policy import NodeFlow
from shared_svc.upgrade.record import Record, RestartOnly
from shared_svc.upgrade.settings import UpgradeSettings


def _names(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:10])
    return shown + (f" and {len(keys) - 10} more" if len(keys) > 10 else "")


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def _free(
    b: Builder,
    pods: list[K8sObject],
    ds_index: Mapping[str, daemonsets.DaemonSetRef],
    label_present: bool,
    state: str | None,
    verdict: Verdict,
) -> Freeing:
    s = b.settings
    if b.record is not None and b.record.restart_only is not None:
        b.record = None  # the verdict was revoked, or a new upgrade takes the full path
    rec = b.record or _new_freeing_record(b, label_present, verdict)
    if not label_present:
        b.labels[daemonsets.parked_label_key(s.driver_name)] = PARKED_VALUE
        rec = replace(rec, parked_label=True)
    found = sort_pods(pods, ds_index, s)
    fresh: set[str] = set()
    deadlines: list[float] = []
    for pod, kind in found.consumers:
        key = consumers.pod_key(pod)
        entry = rec.pod(key)
        step = pod_step(pod, entry, f"{kind.kind}: {kind.why}", s, b.now)
        if step.entry is not None and step.entry != entry:
            rec = rec.with_pod(step.entry)
        if step.action is not None:
            b.actions.append(step.action)
        if step.finding is not None:
            b.add(step.finding)
        if step.deadline is not None:
            deadlines.append(step.deadline)
        if step.fresh:
            fresh.add(key)
    rec = _report_detected(b, rec, found.detected)
    rec = _report_unprepared(b, rec, found.unprepared)
    if state == RESTART_STATE and not rec.restart_race:
        rec = _report_restart_race(b, rec, pods, list(found.daemonset_pods))
    pending = tuple(sorted(consumers.pod_key(pod) for pod, _ in found.consumers))
    holding = bool(pending or found.daemonset_pods or found.unprepared)
    if not holding and rec.freed_at is None:
        rec = _report_freed(b, replace(rec, freed_at=b.now))
    b.record = rec
    candidates = ([s.poll_seconds] if holding else []) + [d for d in deadlines if d > 0]
    return Freeing(
        "freeing" if holding else "freed",
        found,
        pending,
        frozenset(fresh),
        min(candidates) if candidates else None,
    )


def _new_freeing_record(b: Builder, label_present: bool, verdict: Verdict) -> Record:
    """The record of a node we start to free. Started in ``pod-restart-required`` (the
    earlier states were missed: the service was down or slow), it keeps what told the full
    path there; a guess, or a restart-only verdict revoked, is reported with it, once."""
    rec = Record.new(b.now, parked_label=not label_present)
    if verdict.evidence not in record.PATH_EVIDENCE:
        return rec
    if verdict.evidence == "guess":
        b.report(
            "Warning",
            "UpgradePathGuessed",
            "Free",
            f"shared-svc could not tell whether this driver upgrade is restart-only or full: "
            f"{verdict.note}. It frees the GPU consumers, the side that cannot stall a full "
            "upgrade; on a restart-only path they leave for nothing.",
            record.format_time(rec.since),
        )
    elif verdict.evidence == "changed":
        b.report(
            "Warning",
            "UpgradePathChanged",
            "Free",
            f"{verdict.note}; shared-svc now frees the GPU consumers.",
            record.format_time(rec.since),
        )
    return replace(rec, path_evidence=verdict.evidence)


def _restart_only(b: Builder, verdict: Verdict) -> None:
    """The driver restarts in place: nothing is freed or parked. The verdict is recorded
    (one patch, so a restart does not decide again once the old driver pod is gone) and
    reported once, with it."""
    if b.record is not None and b.record.restart_only is not None:
        return
    assert verdict.daemonset is not None and verdict.digest is not None
    rec = replace(
        Record.new(b.now, parked_label=False),
        restart_only=RestartOnly(verdict.daemonset, verdict.digest),
    )
    b.report(
        "Normal",
        "UpgradeRestartOnly",
        "Skip",
        f"The driver upgrade on this node is restart-only ({verdict.note}): "
        "no GPU consumer is evicted and no DaemonSet parked.",
        record.format_time(rec.since),
    )
    b.record = rec


def _report_detected(b: Builder, rec: Record, detected: tuple[str, ...]) -> Record:
    """Detected consumers left running (detection=report): reported once per set."""
    if not set(detected) - set(rec.detected_reported):
        return rec
    s = b.settings
    b.report(
        "Normal",
        "GPUConsumersDetected",
        "Detect",
        f"GPU consumers detected but not declared, left running (detection=report): {_names(detected)}. "
        f"Declare them with {s.consumer_selector.text or 'the consumer selector'}, or set detection=evict.",
        _digest(*sorted(detected)),
    )
    return replace(rec, detected_reported=tuple(sorted({*rec.detected_reported, *detected})))


def _report_unprepared(
    b: Builder, rec: Record, unprepared: Mapping[str, tuple[str, ...]]
) -> Record:
    """DaemonSets running a declared consumer here, never prepared: reported once each."""
    for ds_key in sorted(set(unprepared) - set(rec.unprepared_reported)):
        b.report(
            "Warning",
            "GPUConsumerDaemonSetNotPrepared",
            "Free",
            f"DaemonSet {ds_key} runs GPU consumer pod(s) {_names(unprepared[ds_key])} on this node "
            f"({b.settings.consumer_selector.text}) but was never prepared: the parked label does not move "
            f"them, so the node is not freed. Run `shared-svc upgrade prepare-daemonset {ds_key}` "
            "(one rollout), or remove the consumer label from its pod template.",
            ds_key,
        )
    if not unprepared:
        return rec
    return replace(rec, unprepared_reported=tuple(sorted({*rec.unprepared_reported, *unprepared})))


def _report_freed(b: Builder, rec: Record) -> Record:
    """Every consumer gone: reported once per upgrade (the record's ``freedAt``)."""
    parked_key = daemonsets.parked_label_key(b.settings.driver_name)
    evicted = [p.key for p in rec.pods]
    b.report(
        "Normal",
        "GPUConsumersFreed",
        "Free",
        f"GPU consumers freed for the driver upgrade: "
        f"{_names(evicted) if evicted else 'no pods to evict'}; "
        f"{'node labelled ' + parked_key + ' so declared DaemonSets left' if rec.parked_label else parked_key + ' was already set'}.",
        record.format_time(rec.since),
    )
    return rec


def _report_restart_race(
    b: Builder, rec: Record, pods: list[K8sObject], ds_pods: list[str]
) -> Record:
    """The flow reached the driver restart while consumers we freed are still on the node
    (a declared or evicted detected pod of the record, terminating or not, or a pod of a
    prepared DaemonSet): they may hold the module. Reported once per node and upgrade."""
    live = {consumers.pod_key(p): p for p in pods if not consumers.is_finished(p)}
    still = sorted(
        {e.key for e in rec.pods if pod_identity(live.get(e.key, {}))[2] == e.uid} | set(ds_pods)
    )
    if not still:
        return rec
    try:
        wanted = gate.label_text(gate.consumer_labels(b.settings.consumer_selector))
    except gate.NoConsumerLabel:
        wanted = "the declared consumer label"
    b.report(
        "Warning",
        "GPUConsumersAtDriverRestart",
        "Free",
        f"The node reached pod-restart-required while GPU consumers freed by shared-svc were "
        f"still on it: {_names(still)}. The driver restarts now and cannot unload the module "
        "while they hold it (it retries until they are gone): freeing raced the driver restart. "
        f"Make the upgrade flow wait for them: set {_gate_where(b.flow)} to "
        f"{wanted!r} with timeoutSeconds > 0 (`shared-svc upgrade configure-gate`) and prepare "
        "consumer DaemonSets (`shared-svc upgrade prepare-daemonset`).",
        record.format_time(rec.since),
    )
    return replace(rec, restart_race=tuple(still))


def _gate_where(flow: NodeFlow | None) -> str:
    """The gate gpu-operator reads for the node, as the restart-race Warning names it."""
    if flow is None or flow.policy is None:
        return "waitForCompletion.podSelector of the upgrade policy gpu-operator reads"
    return f"{flow.policy.where} {flow.policy.gate_field}"


def _undo(b: Builder, *, aborted: bool) -> None:
    """Restore exactly what the record says we changed, then forget the record."""
    rec = b.record
    if rec is None:
        return
    if rec.restart_only is not None:
        b.record = None  # nothing was freed or parked: the verdict goes, unannounced
        return
    parked_key = daemonsets.parked_label_key(b.settings.driver_name)
    if rec.parked_label and parked_key in objects.labels_of(b.node):
        b.labels[parked_key] = None
    evicted = [p.key for p in rec.pods]
    what = (
        f"removed {parked_key}" if rec.parked_label else f"left {parked_key} (not set by us)"
    ) + (
        f"; {len(evicted)} evicted pod(s) return through their controllers: {_names(evicted)}"
        if evicted
        else ""
    )
    if aborted:
        why = (
            f"No upgrade flow moves the node any more ({b.flow.no_flow})"
            if b.flow is not None and b.flow.no_flow
            else "The driver-upgrade state label vanished mid-upgrade (auto-upgrade off?)"
        )
        b.report(
            "Warning",
            "UpgradeAborted",
            "Restore",
            f"{why}; restored GPU consumers: {what}.",
            record.format_time(rec.since),
        )
    else:
        b.report(
            "Normal",
            "GPUConsumersRestored",
            "Restore",
            f"Driver upgrade done; restored GPU consumers: {what}.",
            record.format_time(rec.since),
        )
    b.record = None


def plan_node(
    node: K8sObject,
    pods: Iterable[K8sObject],
    daemonset_objects: Iterable[K8sObject],
    settings: UpgradeSettings,
    now: float,
    *,
    ds_index: Mapping[str, daemonsets.DaemonSetRef] | None = None,
    flow: NodeFlow | None = None,
) -> NodePlan:
    """Decide what to write for one node. ``pods`` are the pods bound to it.

    ``ds_index`` is ``index_daemonsets(daemonset_objects)`` when the caller keeps it
    across nodes (the controller does); otherwise it is computed here. ``flow``: the
    upgrade policy that governs the node (``policy.PolicySources.flow``; None: not known,
    the state label is taken as it is).
    """
    labels = objects.labels_of(node)
    parked_key = daemonsets.parked_label_key(settings.driver_name)
    record_key = record.record_annotation_key(settings.driver_name)
    state = labels.get(states.state_label_key(settings.driver_name))
    mode = node_mode(state, flow)
    raw = objects.annotation(node, record_key)
    current, record_error = read_record(raw)
    b = Builder(node, settings, now, current, {}, [], [], flow)
    if record_error is not None and mode in ("free", "restore", "abort"):
        # Only where this plan rewrites the annotation, so the Warning does not repeat.
        b.report(
            "Warning",
            "UpgradeRecordInvalid",
            "Reconcile",
            f"Annotation {record_key} is not a record of ours ({record_error}); it is replaced, "
            f"and {parked_key} is left as found.",
            _digest(raw or ""),
        )
    daemonset_objects = tuple(daemonset_objects)
    if ds_index is None:
        ds_index = daemonsets.index_daemonsets(daemonset_objects, parked_key)
    pods = list(pods)
    freeing = _act(b, mode, state, record_error, pods, daemonset_objects, ds_index)
    # An unreadable record is rewritten only by a plan that decides it (free, restore, abort).
    owns_record = record_error is None or mode in ("free", "restore", "abort")
    status = plan_status(b, pods, ds_index, current, record_error, freeing)
    notices = _unknown_state(b, state) if status.unknown_state else ()
    return NodePlan(
        status.node,
        _patch(b, raw, record_key if owns_record else None),
        tuple(b.actions),
        tuple(b.reports),
        status,
        freeing.requeue_after if freeing else None,
        notices,
        b.record if owns_record else current,
        record_key,
    )


def _act(
    b: Builder,
    mode: states.Mode,
    state: str | None,
    record_error: str | None,
    pods: list[K8sObject],
    daemonset_objects: tuple[K8sObject, ...],
    ds_index: Mapping[str, daemonsets.DaemonSetRef],
) -> Freeing | None:
    """What the node's mode asks of the plan ``b`` (its record, as read, in ``b.record``):
    free (the full path) or hold the restart-only verdict, keep the parked label, restore
    or abort. The freeing, when the plan frees."""
    current, labels = b.record, objects.labels_of(b.node)
    parked_key = daemonsets.parked_label_key(b.settings.driver_name)
    if mode == "free":
        ns = b.settings.operator_namespace
        verdict = paths.decide(state, current, pods, daemonset_objects, ns)
        if verdict.path != "restart-only":
            return _free(b, pods, ds_index, parked_key in labels, state, verdict)
        _restart_only(b, verdict)
    elif mode == "keep" and current is not None:
        if current.parked_label and parked_key not in labels:
            b.labels[parked_key] = PARKED_VALUE  # someone removed it: keep what was freed parked
    elif mode in ("restore", "abort") and current is not None:
        _undo(b, aborted=mode == "abort")
    elif mode in ("restore", "abort") and record_error is not None:
        b.record = None  # an unreadable record is dropped; the label is not known to be ours
    return None


def _patch(b: Builder, raw: str | None, record_key: str | None) -> NodePatch | None:
    """The node patch of the plan: its labels, and the record when ``record_key`` (the
    plan owns the annotation) and it changed."""
    new_raw = None if b.record is None else record.encode(b.record)
    annotations = ((record_key, new_raw),) if record_key and new_raw != raw else ()
    if not b.labels and not annotations:
        return None
    version = objects.meta(b.node).get("resourceVersion")
    return NodePatch(b.name, version, tuple(sorted(b.labels.items())), annotations)


def _unknown_state(b: Builder, state: str | None) -> tuple[Report, ...]:
    """A state value this version does not know: a notice (no record write keeps it from
    repeating; the shell sends it once per process)."""
    b.report(
        "Warning",
        "UpgradeStateUnknown",
        "Reconcile",
        f"Unknown driver-upgrade state {state!r} on {states.state_label_key(b.settings.driver_name)}: "
        "treated as keep (what was freed stays parked, nothing new is evicted). "
        "A newer gpu-operator? Upgrade shared-svc.",
        _digest(str(state)),
    )
    return (b.reports.pop(),)
