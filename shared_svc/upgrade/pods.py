"""The pods of a node's plan: which pods a pass reads (``pods_read``), what each pod on
a node being freed is to the upgrade (``sort_pods``), one consumer's step (``pod_step``:
evict, retry, report, delete) and what became of the pods of our record
(``pod_outcomes``). Pure, as ``planner.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime

from shared_svc.k8s import objects
from shared_svc.k8s.objects import K8sObject
from shared_svc.upgrade import consumers, daemonsets, paths, record, states
from shared_svc.upgrade.node_plan import Finding, Phase, PodAction, node_mode, read_record
from shared_svc.upgrade.paths import RESTART_STATE
from shared_svc.upgrade.policy import NodeFlow
from shared_svc.upgrade.record import FreedPod, Record
from shared_svc.upgrade.settings import UpgradeSettings


def pod_identity(pod: K8sObject) -> tuple[str, str, str]:
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


def pod_outcomes(
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
            or pod_identity(pod)[2] != entry.uid
            or consumers.is_finished(pod)
            or objects.meta(pod).get("deletionTimestamp")
        ):
            out["evicted"].append(entry.key)
            if pod is not None and entry.stuck and pod_identity(pod)[2] == entry.uid:
                out["stuck"].append(entry.key)
        elif entry.blocked:
            out["blocked"].append(entry.key)
        elif entry.key not in fresh:
            out["refused"].append(entry.key)
    return {k: tuple(sorted(v)) for k, v in out.items()}


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
    namespace, name, uid = pod_identity(pod)
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
    current, _ = read_record(raw)
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
