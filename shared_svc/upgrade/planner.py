"""The per-node plan: node, its pods, DaemonSets, settings and ``now`` in; writes out.

``plan_node`` is pure. Its only memory is our record annotation on the node, so running
it again after a restart, or after its writes were applied, gives the same answer: a
plan whose writes are already done has none left (``NodePlan.writes`` is empty).
Every Report goes with the record write that keeps it from repeating.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from shared_svc.reconcile.model import K8sObject, ObjectRef, Report
from shared_svc.upgrade import consumers, daemonsets, record, states
from shared_svc.upgrade.record import FreedPod, Record, RecordError
from shared_svc.upgrade.settings import UpgradeSettings

Phase = Literal["idle", "freeing", "freed", "parked", "waiting", "restoring", "aborting"]
PodVerb = Literal["evict", "delete"]

PARKED_VALUE = "true"


@dataclass(frozen=True)
class NodePatch:
    """A JSON merge patch of the node touching only our label and annotation keys.

    ``resource_version`` makes the API server refuse it (409) if the node changed since
    it was read, so a decision is never written over state it did not see.
    """

    node: str
    resource_version: str | None
    labels: tuple[tuple[str, str | None], ...] = ()
    annotations: tuple[tuple[str, str | None], ...] = ()

    def body(self) -> dict[str, Any]:
        metadata: dict[str, Any] = {}
        if self.resource_version:
            metadata["resourceVersion"] = self.resource_version
        if self.labels:
            metadata["labels"] = dict(self.labels)
        if self.annotations:
            metadata["annotations"] = dict(self.annotations)
        return {"metadata": metadata}


class NodeChanged(Exception):
    """The API server refused a NodePatch (409): the node moved on since it was read; plan again."""


@dataclass(frozen=True)
class PodAction:
    """Evict (Eviction API, PDBs hold) or delete (opt-in, after the timeout) one pod.

    Both carry the pod's uid as a precondition: a same-named successor is never hit.
    """

    verb: PodVerb
    namespace: str
    name: str
    uid: str
    why: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class NodeStatus:
    node: str
    state: str | None
    mode: states.Mode
    phase: Phase
    parked_label: bool  # the label is on the node now
    parked_by_us: bool  # our record says we set it (so restore removes it)
    since: str | None
    freed_at: str | None
    pending: tuple[str, ...] = ()  # consumers still on the node
    blocked: tuple[str, ...] = ()  # evictions refused past the timeout
    detected: tuple[str, ...] = ()  # report mode: detected consumers left alone
    evicted: tuple[str, ...] = ()  # from the record: pods we asked to leave
    daemonset_pods: tuple[str, ...] = ()  # pods of declared DaemonSets still here
    operator_hook_pods: tuple[str, ...] = ()  # left to the driver-manager (gpu.deploy.client)
    partial_daemonsets: tuple[str, ...] = ()  # affinity term missing in some required terms
    record_error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class NodePlan:
    node: str
    patch: NodePatch | None
    pod_actions: tuple[PodAction, ...]
    reports: tuple[Report, ...]
    status: NodeStatus
    requeue_after: float | None  # look again this soon even without a change (seconds)

    @property
    def writes(self) -> tuple[NodePatch | PodAction, ...]:
        return ((self.patch,) if self.patch else ()) + self.pod_actions


def _names(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:10])
    return shown + (f" and {len(keys) - 10} more" if len(keys) > 10 else "")


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


@dataclass
class _Builder:
    """Collects one plan; the record is updated in place as decisions are made."""

    node: K8sObject
    settings: UpgradeSettings
    now: float
    record: Record | None
    labels: dict[str, str | None]
    reports: list[Report]
    actions: list[PodAction]

    @property
    def name(self) -> str:
        return str(self.node.get("metadata", {}).get("name", ""))

    def report(
        self, type_: Literal["Normal", "Warning"], reason: str, action: str, note: str, key: str
    ) -> None:
        meta = self.node.get("metadata", {})
        regarding = ObjectRef(api_version="v1", kind="Node", name=self.name, uid=meta.get("uid"))
        self.reports.append(
            Report(
                type_, reason, action, regarding, note[:1000], f"upgrade/{self.name}/{reason}/{key}"
            )
        )


def _pod_identity(pod: K8sObject) -> tuple[str, str, str]:
    meta = pod.get("metadata", {})
    return str(meta.get("namespace", "")), str(meta.get("name", "")), str(meta.get("uid", ""))


def _free(
    b: _Builder,
    pods: list[K8sObject],
    ds_index: Mapping[str, daemonsets.DaemonSetRef],
    label_present: bool,
) -> dict[str, Any]:
    s = b.settings
    parked_key = daemonsets.parked_label_key(s.driver_name)
    rec = b.record or Record.new(b.now, parked_label=not label_present)
    if not label_present:
        b.labels[parked_key] = PARKED_VALUE
        rec = replace(rec, parked_label=True)

    pending: list[str] = []
    blocked: list[str] = []
    detected: list[str] = []
    ds_pods: list[str] = []
    hook_pods: list[str] = []
    deadlines: list[float] = []
    for pod in pods:
        key = consumers.pod_key(pod)
        owner = daemonsets.owning_daemonset(pod, ds_index)
        if owner is not None and consumers.is_finished(pod):
            owner = None  # a Succeeded/Failed pod holds no GPU; the DaemonSet controller removes it
        if owner is not None and owner.kind == "declared":
            ds_pods.append(key)
        elif owner is not None and owner.kind == "operator-hook":
            hook_pods.append(key)
        found = consumers.classify(pod, s)
        if found.kind == "detected" and s.detection == "report":
            detected.append(key)
            continue
        if not found.is_consumer:
            continue
        namespace, name, uid = _pod_identity(pod)
        pending.append(key)
        terminating = bool(pod.get("metadata", {}).get("deletionTimestamp"))
        entry = rec.pod(key)
        if entry is None or entry.uid != uid:
            if terminating:
                continue  # leaving on its own: nothing of ours to record
            rec = rec.with_pod(FreedPod(namespace, name, uid, first_attempt=b.now))
            b.actions.append(PodAction("evict", namespace, name, uid, f"{found.kind}: {found.why}"))
            deadlines.append(s.eviction_timeout_seconds)
            continue
        if terminating:
            continue  # eviction accepted; waiting for the pod to go
        waited = b.now - entry.first_attempt
        if waited < s.eviction_timeout_seconds:
            b.actions.append(PodAction("evict", namespace, name, uid, "retry: still on the node"))
            deadlines.append(s.eviction_timeout_seconds - waited)
            continue
        blocked.append(key)
        if not entry.blocked:
            then = (
                "deleting it (upgrade_delete_after_timeout)"
                if s.delete_after_timeout
                else "left in place: set upgrade_delete_after_timeout to delete it, or relax its PodDisruptionBudget"
            )
            b.report(
                "Warning",
                "GPUConsumerEvictionBlocked",
                "Evict",
                f"Eviction of GPU consumer {key} refused for {int(waited)}s "
                f"(timeout {int(s.eviction_timeout_seconds)}s, likely a PodDisruptionBudget); {then}.",
                f"{key}/{uid}",
            )
        if s.delete_after_timeout:
            b.actions.append(PodAction("delete", namespace, name, uid, "eviction timeout"))
        else:
            b.actions.append(PodAction("evict", namespace, name, uid, "retry after timeout"))
        rec = rec.with_pod(
            replace(entry, blocked=True, deleted=entry.deleted or s.delete_after_timeout)
        )

    new_detected = sorted(set(detected) - set(rec.detected_reported))
    if new_detected:
        b.report(
            "Normal",
            "GPUConsumersDetected",
            "Detect",
            f"GPU consumers detected but not declared, left running (detection=report): {_names(detected)}. "
            f"Declare them with {s.consumer_selector.text or 'the consumer selector'}, or set detection=evict.",
            _digest(*sorted(detected)),
        )
        rec = replace(rec, detected_reported=tuple(sorted({*rec.detected_reported, *detected})))

    if not pending and not ds_pods and rec.freed_at is None:
        rec = replace(rec, freed_at=b.now)
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
    b.record = rec
    poll = [s.poll_seconds] if pending or ds_pods else []
    candidates = poll + [d for d in deadlines if d > 0]
    return {
        "phase": "freeing" if pending or ds_pods else "freed",
        "pending": tuple(sorted(pending)),
        "blocked": tuple(sorted(blocked)),
        "detected": tuple(sorted(detected)),
        "daemonset_pods": tuple(sorted(ds_pods)),
        "operator_hook_pods": tuple(sorted(hook_pods)),
        "requeue_after": min(candidates) if candidates else None,
    }


def _undo(b: _Builder, *, aborted: bool) -> None:
    """Restore exactly what the record says we changed, then forget the record."""
    rec = b.record
    if rec is None:
        return
    parked_key = daemonsets.parked_label_key(b.settings.driver_name)
    if rec.parked_label and parked_key in (b.node.get("metadata", {}).get("labels") or {}):
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
        b.report(
            "Warning",
            "UpgradeAborted",
            "Restore",
            f"The driver-upgrade state label vanished mid-upgrade (auto-upgrade off?); restored GPU consumers: {what}.",
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
) -> NodePlan:
    """Decide what to write for one node. ``pods`` are the pods bound to it.

    ``ds_index`` is ``index_daemonsets(daemonset_objects)`` when the caller keeps it
    across nodes (the controller does); otherwise it is computed here.
    """
    meta = node.get("metadata", {})
    name = str(meta.get("name", ""))
    labels: Mapping[str, str] = meta.get("labels") or {}
    annotations: Mapping[str, str] = meta.get("annotations") or {}
    parked_key = daemonsets.parked_label_key(settings.driver_name)
    record_key = record.record_annotation_key(settings.driver_name)
    state = labels.get(states.state_label_key(settings.driver_name))
    mode = states.mode_for(state)

    current: Record | None = None
    record_error: str | None = None
    raw = annotations.get(record_key)
    if raw is not None:
        try:
            current = record.decode(raw)
        except RecordError as exc:
            record_error = str(exc)

    b = _Builder(node, settings, now, current, {}, [], [])
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
    label_present = parked_key in labels
    if ds_index is None:
        ds_index = daemonsets.index_daemonsets(daemonset_objects, parked_key)
    partial = tuple(sorted(ref.key for ref in ds_index.values() if ref.kind == "partial"))
    found: dict[str, Any] = {}
    phase: Phase = "idle"
    if mode == "free":
        found = _free(b, list(pods), ds_index, label_present)
        phase = found.pop("phase")
    elif mode == "keep" and current is not None:
        phase = "parked"
        if current.parked_label and not label_present:
            b.labels[parked_key] = PARKED_VALUE  # someone removed it: keep what was freed parked
    elif mode == "nothing" and current is not None:
        phase = "waiting"
    elif mode in ("restore", "abort") and current is not None:
        phase = "restoring" if mode == "restore" else "aborting"
        _undo(b, aborted=mode == "abort")
    elif mode in ("restore", "abort") and record_error is not None:
        b.record = None  # an unreadable record is dropped; the label is not known to be ours

    annotation_changes: tuple[tuple[str, str | None], ...] = ()
    new_raw = None if b.record is None else record.encode(b.record)
    # An unreadable record is rewritten only by a plan that decides it (free, restore, abort).
    owns_record = record_error is None or mode in ("free", "restore", "abort")
    if owns_record and new_raw != raw:
        annotation_changes = ((record_key, new_raw),)
    patch = None
    if b.labels or annotation_changes:
        patch = NodePatch(
            name, meta.get("resourceVersion"), tuple(sorted(b.labels.items())), annotation_changes
        )

    shown = b.record or current
    status = NodeStatus(
        node=name,
        state=state,
        mode=mode,
        phase=phase,
        parked_label=label_present,
        parked_by_us=bool(shown and shown.parked_label),
        since=record.format_time(shown.since) if shown else None,
        freed_at=record.format_time(shown.freed_at)
        if shown and shown.freed_at is not None
        else None,
        pending=found.get("pending", ()),
        blocked=found.get("blocked", ()),
        detected=found.get("detected", ()),
        evicted=tuple(p.key for p in shown.pods) if shown else (),
        daemonset_pods=found.get("daemonset_pods", ()),
        operator_hook_pods=found.get("operator_hook_pods", ()),
        partial_daemonsets=partial,
        record_error=record_error,
    )
    return NodePlan(
        name, patch, tuple(b.actions), tuple(b.reports), status, found.get("requeue_after")
    )
