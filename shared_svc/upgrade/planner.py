"""The per-node plan: node, its pods, DaemonSets, settings and ``now`` in; writes out.

``plan_node`` is pure. Its only memory is our record annotation on the node, so running
it again after a restart, or after its writes were applied, gives the same answer: a
plan whose writes are already done has none left (``NodePlan.writes`` is empty).
Every Report goes with the record write that keeps it from repeating.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from datetime import datetime
from typing import Any, Literal

from shared_svc.k8s import objects
from shared_svc.k8s.events import ObjectRef, Report
from shared_svc.k8s.events import note as event_note
from shared_svc.k8s.objects import K8sObject
from shared_svc.upgrade import consumers, daemonsets, gate, paths, record, states
from shared_svc.upgrade.paths import RESTART_STATE, Verdict
from shared_svc.upgrade.policy import NodeFlow
from shared_svc.upgrade.record import FreedPod, Record, RecordError, RestartOnly
from shared_svc.upgrade.settings import UpgradeSettings

Phase = Literal[
    "idle", "freeing", "freed", "parked", "waiting", "restoring", "aborting", "restart-only"
]
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
    pending: tuple[str, ...] = ()  # consumers still on the node (whatever their eviction did)
    refused: tuple[str, ...] = ()  # eviction refused (429, a PodDisruptionBudget): retried
    blocked: tuple[str, ...] = ()  # eviction refused past the timeout (Warning reported)
    evicted: tuple[str, ...] = ()  # eviction (or delete) accepted: gone or terminating
    stuck: tuple[str, ...] = ()  # evicted, still terminating past the timeout (Warning)
    detected: tuple[str, ...] = ()  # report mode: detected consumers left alone
    daemonset_pods: tuple[str, ...] = ()  # pods of declared DaemonSets still here
    unprepared_daemonsets: tuple[str, ...] = ()  # run a declared consumer here, never prepared
    operator_hook_pods: tuple[str, ...] = ()  # left to the driver-manager (gpu.deploy.client)
    partial_daemonsets: tuple[str, ...] = ()  # affinity term missing in some required terms
    # freed consumers still on the node when it reached pod-restart-required (Warning sent)
    restart_race: tuple[str, ...] = ()
    # The upgrade's path on the node (``upgrade/paths.py``): "full" or "restart-only"
    # (None: no freeing state, nothing recorded), what told it, and (restart-only) the
    # driver DaemonSet whose unchanged DRIVER_CONFIG_DIGEST decided it.
    path: str | None = None
    path_evidence: str | None = None
    driver_daemonset: str | None = None
    unknown_state: bool = False  # a state value this version does not know (kept)
    record_error: str | None = None
    # The upgrade policy gpu-operator reads for the node ("NVIDIADriver/<name>"; None: not
    # known), and why no upgrade flow moves it (None: one does, or it is not known):
    # ``upgrade/policy.py``. A node no flow moves is treated as one whose state label is gone.
    policy: str | None = None
    no_flow: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """Every field, tuples as lists (the fields are flat: no ``asdict`` deep copy, which
        made ``/status`` of 500 upgrading nodes cost 0.1 s of the event loop)."""
        return {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in ((k, getattr(self, k)) for k in _STATUS_FIELDS)
        }


_STATUS_FIELDS = tuple(f.name for f in fields(NodeStatus))


@dataclass(frozen=True)
class NodePlan:
    node: str
    patch: NodePatch | None
    pod_actions: tuple[PodAction, ...]
    reports: tuple[Report, ...]
    status: NodeStatus
    requeue_after: float | None  # look again this soon even without a change (seconds)
    # Reports no record write keeps from repeating: the shell sends each once per process.
    notices: tuple[Report, ...] = ()
    record: Record | None = None  # our record on the node once ``patch`` is written
    record_key: str = ""

    @property
    def writes(self) -> tuple[NodePatch | PodAction, ...]:
        return ((self.patch,) if self.patch else ()) + self.pod_actions


def deleted_patch(plan: NodePlan, uids: Collection[str]) -> NodePatch | None:
    """The record write after the plan's deletes of pods ``uids`` were accepted: the
    record says ``deleted`` only for a pod whose delete succeeded. Ours alone writes the
    record and one pass of a node runs at a time, so it needs no resourceVersion."""
    rec = plan.record
    if rec is None:
        return None
    marked = rec
    for entry in rec.pods:
        if entry.uid in uids and not entry.deleted:
            marked = marked.with_pod(replace(entry, deleted=True))
    if marked == rec:
        return None
    return NodePatch(plan.node, None, annotations=((plan.record_key, record.encode(marked)),))


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
    flow: NodeFlow | None = None

    @property
    def name(self) -> str:
        return objects.name_of(self.node)

    def add(self, finding: Finding) -> None:
        self.report(finding.type_, finding.reason, finding.action, finding.note, finding.key)

    def report(
        self, type_: Literal["Normal", "Warning"], reason: str, action: str, note: str, key: str
    ) -> None:
        uid = objects.uid_of(self.node) or None
        regarding = ObjectRef(api_version="v1", kind="Node", name=self.name, uid=uid)
        self.reports.append(
            Report(
                type_,
                reason,
                action,
                regarding,
                event_note(note),
                f"upgrade/{self.name}/{reason}/{key}",
            )
        )


def _pod_identity(pod: K8sObject) -> tuple[str, str, str]:
    return objects.namespace_of(pod), objects.name_of(pod), objects.uid_of(pod)


def terminating_for(pod: K8sObject, now: float) -> float | None:
    """Seconds since the pod was asked to go (deletionTimestamp less its grace), or None."""
    meta = objects.meta(pod)
    stamp = meta.get("deletionTimestamp")
    if not stamp:
        return None
    try:
        deadline = datetime.fromisoformat(str(stamp)).timestamp()
        grace = float(meta.get("deletionGracePeriodSeconds") or 0)
    except (TypeError, ValueError):
        return 0.0  # terminating, since an unknown time: never reported as stuck
    return now - (deadline - grace)


def _outcomes(
    rec: Record | None, pods: Iterable[K8sObject], fresh: frozenset[str] = frozenset()
) -> dict[str, tuple[str, ...]]:
    """What became of each pod of the record, judged from the pods on the node now.

    ``evicted``: accepted (gone, finished, replaced by a successor, or terminating);
    ``blocked``: still there past the timeout (the record's flag); ``refused``: still
    there, not terminating, after an earlier attempt (``fresh`` pods are asked only now);
    ``stuck``: evicted, still terminating past the timeout (the record's flag).
    """
    live = {consumers.pod_key(p): p for p in pods}
    out: dict[str, list[str]] = {"evicted": [], "refused": [], "blocked": [], "stuck": []}
    for entry in rec.pods if rec else ():
        pod = live.get(entry.key)
        if (
            pod is None
            or _pod_identity(pod)[2] != entry.uid
            or consumers.is_finished(pod)
            or objects.meta(pod).get("deletionTimestamp")
        ):
            out["evicted"].append(entry.key)
            if pod is not None and entry.stuck and _pod_identity(pod)[2] == entry.uid:
                out["stuck"].append(entry.key)
        elif entry.blocked:
            out["blocked"].append(entry.key)
        elif entry.key not in fresh:
            out["refused"].append(entry.key)
    return {k: tuple(sorted(v)) for k, v in out.items()}


@dataclass(frozen=True)
class Finding:
    """A report before it is addressed to the node (``_Builder.add`` addresses it)."""

    type_: Literal["Normal", "Warning"]
    reason: str
    action: str
    note: str
    key: str


@dataclass(frozen=True)
class PodStep:
    """What one consumer pod's step decides: its record entry, its write, its report, and
    how soon its next decision is due (seconds)."""

    entry: FreedPod | None  # the record's entry for the pod after the step (None: none of ours)
    action: PodAction | None = None
    finding: Finding | None = None
    deadline: float | None = None
    fresh: bool = False  # asked to leave for the first time by this step


def pod_step(
    pod: K8sObject, entry: FreedPod | None, why: str, settings: UpgradeSettings, now: float
) -> PodStep:
    """One consumer pod on a node being freed: evict it, retry a refused eviction, report
    it stuck terminating or blocked past the timeout, and delete it then (opt-in).

    ``entry`` is the record's entry of the pod's namespace/name (of any uid); ``why``
    says why it is a consumer. The eviction clock starts at the first attempt.
    """
    namespace, name, uid = _pod_identity(pod)
    timeout = settings.eviction_timeout_seconds
    terminating = terminating_for(pod, now)
    if entry is None or entry.uid != uid:
        if terminating is not None:
            return PodStep(entry)  # leaving on its own: nothing of ours to record
        return PodStep(
            FreedPod(namespace, name, uid, first_attempt=now),
            PodAction("evict", namespace, name, uid, why),
            deadline=timeout,
            fresh=True,
        )
    if terminating is not None:
        return _terminating_step(entry, terminating, timeout)
    waited = now - entry.first_attempt
    if waited < timeout:
        retry = PodAction("evict", namespace, name, uid, "retry: still on the node")
        return PodStep(entry, retry, deadline=timeout - waited)
    return _timeout_step(entry, waited, settings)


def _terminating_step(entry: FreedPod, terminating: float, timeout: float) -> PodStep:
    """Eviction accepted; waiting for the pod to go. Past the timeout it is stuck (a
    kubelet that does not finish it, a finalizer): reported once."""
    if entry.stuck:
        return PodStep(entry)
    if terminating < timeout:
        return PodStep(entry, deadline=timeout - terminating)
    finding = Finding(
        "Warning",
        "GPUConsumerStuckTerminating",
        "Evict",
        f"GPU consumer {entry.key} was evicted but is still terminating after {int(terminating)}s "
        f"(timeout {int(timeout)}s): it may still hold the GPU; "
        "check its finalizers and the node's kubelet.",
        f"{entry.key}/{entry.uid}",
    )
    return PodStep(replace(entry, stuck=True), finding=finding)


def _timeout_step(entry: FreedPod, waited: float, s: UpgradeSettings) -> PodStep:
    """Still there past the timeout: a Warning once (``blocked`` rides with the record
    write), then a delete (opt-in) or more evictions. Not yet ``deleted``: the delete may
    be refused; ``deleted_patch`` records it once it was accepted."""
    finding = None
    if not entry.blocked:
        then = (
            "deleting it (upgrade_delete_after_timeout)"
            if s.delete_after_timeout
            else "left in place: set upgrade_delete_after_timeout to delete it, or relax its PodDisruptionBudget"
        )
        finding = Finding(
            "Warning",
            "GPUConsumerEvictionBlocked",
            "Evict",
            f"Eviction of GPU consumer {entry.key} refused for {int(waited)}s "
            f"(timeout {int(s.eviction_timeout_seconds)}s, likely a PodDisruptionBudget); {then}.",
            f"{entry.key}/{entry.uid}",
        )
    ident = (entry.namespace, entry.name, entry.uid)
    if s.delete_after_timeout:
        action = PodAction("delete", *ident, "eviction timeout")
    else:
        action = PodAction("evict", *ident, "retry after timeout")
    return PodStep(replace(entry, blocked=True), action, finding)


@dataclass(frozen=True)
class NodePods:
    """The pods on a node being freed, by what they are to the upgrade (keys namespace/name)."""

    consumers: tuple[tuple[K8sObject, consumers.Classification], ...] = ()  # to free
    detected: tuple[str, ...] = ()  # report mode: detected consumers left alone
    daemonset_pods: tuple[str, ...] = ()  # pods of declared DaemonSets
    operator_hook_pods: tuple[str, ...] = ()
    unprepared: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # DaemonSet -> pods


def sort_pods(
    pods: Iterable[K8sObject],
    ds_index: Mapping[str, daemonsets.DaemonSetRef],
    s: UpgradeSettings,
) -> NodePods:
    """Which pods are consumers to free, detected ones to report, pods of declared or
    operator-hook DaemonSets, and declared consumers of DaemonSets never prepared."""
    to_free: list[tuple[K8sObject, consumers.Classification]] = []
    detected: list[str] = []
    ds_pods: list[str] = []
    hook_pods: list[str] = []
    unprepared: dict[str, list[str]] = {}
    for pod in pods:
        key = consumers.pod_key(pod)
        owner = daemonsets.owning_daemonset(pod, ds_index)
        if owner is not None and consumers.is_finished(pod):
            owner = None  # a Succeeded/Failed pod holds no GPU; the DaemonSet controller removes it
        if owner is not None and owner.kind == "declared":
            ds_pods.append(key)
        elif owner is not None and owner.kind == "operator-hook":
            hook_pods.append(key)
        elif (ds_key := daemonsets.owner_key(pod)) is not None and (
            consumers.classify(pod, s, daemonset_pods=True).kind == "declared"
        ):
            # A declared consumer whose DaemonSet was never (or only partly) prepared: the
            # parked label does not move it and evicting it is useless, so it holds the node.
            unprepared.setdefault(ds_key, []).append(key)
        found = consumers.classify(pod, s)
        if found.kind == "detected" and s.detection == "report":
            detected.append(key)
        elif found.is_consumer:
            to_free.append((pod, found))
    return NodePods(
        tuple(to_free),
        tuple(sorted(detected)),
        tuple(sorted(ds_pods)),
        tuple(sorted(hook_pods)),
        {k: tuple(v) for k, v in unprepared.items()},
    )


@dataclass(frozen=True)
class Freeing:
    """What ``_free`` found on the node (the record and reports are in the builder)."""

    phase: Phase
    pods: NodePods
    pending: tuple[str, ...]  # consumers still on the node
    fresh: frozenset[str]  # asked to leave for the first time by this plan
    requeue_after: float | None


def _free(
    b: _Builder,
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


def _new_freeing_record(b: _Builder, label_present: bool, verdict: Verdict) -> Record:
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


def _restart_only(b: _Builder, verdict: Verdict) -> None:
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


def _report_detected(b: _Builder, rec: Record, detected: tuple[str, ...]) -> Record:
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
    b: _Builder, rec: Record, unprepared: Mapping[str, tuple[str, ...]]
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


def _report_freed(b: _Builder, rec: Record) -> Record:
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
    b: _Builder, rec: Record, pods: list[K8sObject], ds_pods: list[str]
) -> Record:
    """The flow reached the driver restart while consumers we freed are still on the node
    (a declared or evicted detected pod of the record, terminating or not, or a pod of a
    prepared DaemonSet): they may hold the module. Reported once per node and upgrade."""
    live = {consumers.pod_key(p): p for p in pods if not consumers.is_finished(p)}
    still = sorted(
        {e.key for e in rec.pods if _pod_identity(live.get(e.key, {}))[2] == e.uid} | set(ds_pods)
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


def _undo(b: _Builder, *, aborted: bool) -> None:
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


def _read_record(raw: str | None) -> tuple[Record | None, str | None]:
    """Our record annotation, decoded: (record, None), (None, why it is not ours) or (None, None)."""
    if raw is None:
        return None, None
    try:
        return record.decode(raw), None
    except RecordError as exc:
        return None, str(exc)


def node_mode(state: str | None, flow: NodeFlow | None) -> states.Mode:
    """What the plan does with a node in ``state``: a node that no upgrade flow moves
    (``flow.no_flow``, NVIDIADriver mode: its NVIDIADriver's auto-upgrade is off, or no
    NVIDIADriver owns it) is treated as one whose state label is gone: nothing is freed
    there, and what was parked is restored."""
    return states.mode_for(None if flow is not None and flow.no_flow else state)


@dataclass(frozen=True)
class PodRead:
    """Which of a node's pods its plan reads (``pods_read``): none (``needed`` false), or
    every pod bound to it but those of ``skip_namespace``, and (``driver_pods``) the driver
    pods of that namespace (``paths.driver_pod_selector``)."""

    needed: bool
    skip_namespace: str | None = None
    driver_pods: bool = False

    @property
    def driver_namespace(self) -> str | None:
        """The namespace whose driver pods are listed besides, or None."""
        return self.skip_namespace if self.driver_pods else None

    def admits(self, pod: K8sObject) -> bool:
        if not self.needed:
            return False
        if objects.namespace_of(pod) != self.skip_namespace:
            return True
        return self.driver_pods and paths.is_driver_pod(pod, str(self.skip_namespace))


def pods_read(
    node: K8sObject,
    ds_index: Mapping[str, daemonsets.DaemonSetRef],
    settings: UpgradeSettings,
    daemonset_objects: Iterable[K8sObject] = (),
    flow: NodeFlow | None = None,
) -> PodRead:
    """The pods ``plan_node`` of this node depends on, before they are read: its plan is
    the same on every pod bound to the node as on those ``PodRead.admits``
    (proptests/test_upgrade_props.py). Issue 22: at fleet scale a GPU node runs eight or
    more operand pods of 15-22 KiB in the operator namespace, and reading them for every
    pass is most of what a pass costs the API server and this process.

    - No pod at all for a node that is not being freed and carries no record of ours
      (``upgrade-required`` for weeks, no label): its plan has no pod in it.
    - Not the operator namespace's pods: every rule excludes them (``consumers.exclusion``,
      DaemonSet pods too), unless a declared or operator-hook DaemonSet lives there (its
      pods hold or are shown on the node) or the record names a pod there (written under
      another ``namespace`` setting: its outcome is read from the pods).
    - No pod for a node on the restart-only path (its recorded verdict, in a state where it
      holds: ``paths.verdict_holds`` against ``daemonset_objects``): nothing is freed there.
    - The driver pods of the operator namespace besides (``PodRead.driver_pods``, one small
      list) for a node in ``pod-restart-required`` without a record: they tell its path
      (``paths.decide``), once; the verdict is then recorded.
    """
    raw = objects.annotation(node, record.record_annotation_key(settings.driver_name))
    state = objects.label(node, states.state_label_key(settings.driver_name))
    mode = node_mode(state, flow)
    if mode != "free" and raw is None:
        return PodRead(needed=False)
    current, _ = _read_record(raw)
    if (
        current is not None
        and current.restart_only is not None
        and (
            mode != "free"
            or (state == RESTART_STATE and paths.verdict_holds(current, daemonset_objects))
        )
    ):
        return PodRead(needed=False)
    ns = settings.operator_namespace
    if any(
        ref.namespace == ns and ref.kind in ("declared", "operator-hook")
        for ref in ds_index.values()
    ):
        return PodRead(needed=True)
    if current is not None and any(entry.namespace == ns for entry in current.pods):
        return PodRead(needed=True)
    drivers = mode == "free" and state == RESTART_STATE and current is None
    return PodRead(needed=True, skip_namespace=ns, driver_pods=drivers)


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
    current, record_error = _read_record(raw)
    b = _Builder(node, settings, now, current, {}, [], [], flow)
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
    freeing: Freeing | None = None
    verdict: Verdict | None = None
    if mode == "free":
        ns = settings.operator_namespace
        verdict = paths.decide(state, current, pods, daemonset_objects, ns)
        if verdict.path == "restart-only":
            _restart_only(b, verdict)
        else:
            freeing = _free(b, pods, ds_index, parked_key in labels, state, verdict)
    elif mode == "keep" and current is not None:
        if current.parked_label and parked_key not in labels:
            b.labels[parked_key] = PARKED_VALUE  # someone removed it: keep what was freed parked
    elif mode in ("restore", "abort") and current is not None:
        _undo(b, aborted=mode == "abort")
    elif mode in ("restore", "abort") and record_error is not None:
        b.record = None  # an unreadable record is dropped; the label is not known to be ours
    # An unreadable record is rewritten only by a plan that decides it (free, restore, abort).
    owns_record = record_error is None or mode in ("free", "restore", "abort")
    status = _status(b, pods, ds_index, current, record_error, freeing)
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


def _patch(b: _Builder, raw: str | None, record_key: str | None) -> NodePatch | None:
    """The node patch of the plan: its labels, and the record when ``record_key`` (the
    plan owns the annotation) and it changed."""
    new_raw = None if b.record is None else record.encode(b.record)
    annotations = ((record_key, new_raw),) if record_key and new_raw != raw else ()
    if not b.labels and not annotations:
        return None
    version = objects.meta(b.node).get("resourceVersion")
    return NodePatch(b.name, version, tuple(sorted(b.labels.items())), annotations)


def _status(
    b: _Builder,
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
    path, evidence, driver_ds = _path(shown)
    return NodeStatus(
        node=b.name,
        state=state,
        mode=mode,
        phase=freeing.phase if freeing else _phase(mode, shown),
        parked_label=daemonsets.parked_label_key(driver) in labels,
        parked_by_us=bool(shown and shown.parked_label),
        since=record.format_time(shown.since) if shown else None,
        freed_at=record.format_time(shown.freed_at)
        if shown and shown.freed_at is not None
        else None,
        pending=freeing.pending if freeing else (),
        detected=found.detected,
        daemonset_pods=found.daemonset_pods,
        operator_hook_pods=found.operator_hook_pods,
        unprepared_daemonsets=tuple(sorted(found.unprepared)),
        partial_daemonsets=_partial(ds_index),
        restart_race=shown.restart_race if shown else (),
        path=path,
        path_evidence=evidence,
        driver_daemonset=driver_ds,
        unknown_state=states.is_unknown(state),
        record_error=record_error,
        policy=_policy_of(b.flow),
        no_flow=b.flow.no_flow if b.flow else None,
        **_outcomes(shown, pods, freeing.fresh if freeing else frozenset()),
    )


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


def _unknown_state(b: _Builder, state: str | None) -> tuple[Report, ...]:
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
    rec, record_error = _read_record(raw)
    state = labels.get(states.state_label_key(driver_name))
    mode = node_mode(state, flow)
    parked_key = daemonsets.parked_label_key(driver_name)
    ds_index = daemonsets.index_daemonsets(daemonset_objects, parked_key)
    pods = [p for p in pods if not consumers.is_finished(p)]
    outcomes = _outcomes(rec, pods)
    path, evidence, driver_ds = _path(rec)
    live = {consumers.pod_key(p): p for p in pods}
    still = [  # recorded pods still here (terminating ones too: they hold the GPU until gone)
        e.key for e in (rec.pods if rec else ()) if _pod_identity(live.get(e.key, {}))[2] == e.uid
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
        state=state,
        mode=mode,
        phase=_phase(mode, rec) if rec is not None or mode != "free" else "freeing",
        parked_label=parked_key in labels,
        parked_by_us=bool(rec and rec.parked_label),
        since=record.format_time(rec.since) if rec else None,
        freed_at=record.format_time(rec.freed_at) if rec and rec.freed_at is not None else None,
        pending=tuple(sorted(still)),
        detected=tuple(k for k in (rec.detected_reported if rec else ()) if k in live),
        daemonset_pods=tuple(sorted(ds_pods)),
        operator_hook_pods=tuple(sorted(hook_pods)),
        unprepared_daemonsets=tuple(sorted(unprepared)),
        partial_daemonsets=_partial(ds_index),
        restart_race=rec.restart_race if rec else (),
        path=path,
        path_evidence=evidence,
        driver_daemonset=driver_ds,
        unknown_state=states.is_unknown(state),
        record_error=record_error,
        policy=_policy_of(flow),
        no_flow=flow.no_flow if flow else None,
        **outcomes,
    )


def listed(status: NodeStatus) -> bool:
    """Upgrading (a freeing or keep state) or still parked / recorded: what ``upgrade status`` shows."""
    return (
        status.mode in ("free", "keep")
        or status.since is not None
        or status.parked_label
        or status.record_error is not None
    )
