"""A node's plan and its parts: what ``plan_node`` (``planner.py``) returns and what it
builds it with.

``NodePlan`` holds the node patch (``NodePatch``: our label and record annotation only),
the pod actions (``PodAction``), the reports and the status (``NodeStatus``); ``Builder``
collects one plan; ``deleted_patch`` is the record write after accepted deletes;
``node_mode`` is what a plan does with a node in a state, under its upgrade flow.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from shared_svc.k8s import objects
from shared_svc.k8s.events import ObjectRef, Report
from shared_svc.k8s.events import note as event_note
from shared_svc.k8s.objects import K8sObject
from shared_svc.upgrade import record, states
from shared_svc.upgrade.policy import NodeFlow
from shared_svc.upgrade.record import Record, RecordError
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


@dataclass
class Builder:
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


@dataclass(frozen=True)
class Finding:
    """A report before it is addressed to the node (``Builder.add`` addresses it)."""

    type_: Literal["Normal", "Warning"]
    reason: str
    action: str
    note: str
    key: str


def read_record(raw: str | None) -> tuple[Record | None, str | None]:
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
