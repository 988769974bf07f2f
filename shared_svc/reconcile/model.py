"""Plain data in and out of the reconcile core.

The core is a pure function ``plan(world, settings) -> Plan`` (see ``planner.py``).
Inputs are Kubernetes objects as plain JSON-like dicts, exactly as the API server
returns them (camelCase keys); outputs are plain data as well, so the shell can send
them to the API server and the ``plan`` command can print them without translation.
Nothing in this package does I/O or reads a clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from shared_svc.k8s.events import Report
from shared_svc.k8s.objects import K8sObject

SelectorMode = Literal["auto", "app"]
ActionKind = Literal["create", "update", "delete", "unchanged", "skip"]
ManagedKind = Literal["Service", "ServiceMonitor"]


@dataclass(frozen=True)
class Settings:
    """What configuration decides for the core (a subset of ``shared_svc.config``)."""

    namespace: str = "gpu-operator"
    selector_mode: SelectorMode = "auto"
    adopt: bool = True
    # Whether the cluster serves monitoring.coreos.com/v1 ServiceMonitor (discovery).
    service_monitor_served: bool = True
    # The scrape interval of a ServiceMonitor that sets none (the Prometheus' own): one
    # going away selects nothing for two of its intervals before it is deleted.
    scrape_interval_seconds: float = 30.0


@dataclass(frozen=True)
class World:
    """A consistent snapshot: cluster-scoped CRs plus namespaced objects of the operator namespace."""

    cluster_policies: tuple[K8sObject, ...] = ()
    gpu_clusters: tuple[K8sObject, ...] = ()
    daemonsets: tuple[K8sObject, ...] = ()
    pods: tuple[K8sObject, ...] = ()
    services: tuple[K8sObject, ...] = ()
    service_monitors: tuple[K8sObject, ...] = ()
    # When the snapshot was taken (Unix time), for the rules that wait (a ServiceMonitor
    # going away); None: no clock (an offline plan), nothing waits. Two worlds of the same
    # objects are equal whenever they were taken.
    now: float | None = field(default=None, compare=False)


# The kinds the planner reads, by the World field that holds them; the first two are
# cluster-scoped, the others live in the operator namespace.
WORLD_KINDS: Mapping[str, str] = {
    "ClusterPolicy": "cluster_policies",
    "GPUCluster": "gpu_clusters",
    "DaemonSet": "daemonsets",
    "Pod": "pods",
    "Service": "services",
    "ServiceMonitor": "service_monitors",
}
CLUSTER_SCOPED_KINDS = frozenset({"ClusterPolicy", "GPUCluster"})


def world_of(by_kind: Mapping[str, Iterable[K8sObject]], now: float | None = None) -> World:
    """The one World builder (``run``'s cache snapshot and ``plan``'s manifests): the
    objects of each kind in ``WORLD_KINDS``, by kind; a kind not given is empty; ``now``,
    the snapshot's time."""
    unknown = sorted(set(by_kind) - set(WORLD_KINDS))
    if unknown:
        raise ValueError(f"the planner does not read {', '.join(unknown)}")
    return World(
        **{WORLD_KINDS[kind]: tuple(objects) for kind, objects in by_kind.items()}, now=now
    )


@dataclass(frozen=True)
class Action:
    """One step that brings one live object to its desired state.

    ``Plan.actions`` is in execution order (coverage never dips: section 5 of the contract).
    For ``create``/``update`` the shell first sends ``json_patch`` (if any) guarded by
    ``preconditions``, then server-side-applies ``apply`` (if any) with field manager
    ``shared-svc``. For ``delete`` it deletes with ``preconditions``.

    ``announces`` are the Normal reports that say what the write did (``Created``,
    ``Adopted``, ``Deleted``, ``SelectorMigrated``): the shell sends them right after the
    write succeeds, never before or without it. ``live`` is the object the action was
    planned against (None: absent), for the shell's ConflictingWriter check; it takes no
    part in comparing actions (two plans of the same intent are equal).
    """

    action: ActionKind
    kind: ManagedKind
    name: str
    reason: str
    apply: K8sObject | None = None
    json_patch: tuple[K8sObject, ...] = ()
    preconditions: dict[str, str] | None = None  # {"uid": ..., "resourceVersion": ...}
    changed_fields: tuple[str, ...] = ()  # dotted paths whose live value differs from intent
    announces: tuple[Report, ...] = ()
    live: K8sObject | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class ConflictValue:
    kind: str
    name: str
    value: Any


@dataclass(frozen=True)
class Conflict:
    object: str  # e.g. "Service/nvidia-dcgm-exporter"
    field: str  # e.g. "spec.type", "spec.endpoints[0].interval", 'metadata.labels["release"]'
    winner: ConflictValue
    losers: tuple[ConflictValue, ...]


@dataclass(frozen=True)
class Pending:
    object: str  # e.g. "Service/nvidia-dcgm"
    reason: str  # SelectorMigrationPending | ServiceNotAdopted | DuplicateScrapeTarget | ...
    message: str


@dataclass(frozen=True)
class SpecError:
    kind: str
    name: str
    reason: str  # InvalidSpec
    message: str


@dataclass(frozen=True)
class GateState:
    """The selector gate of one stack for one stable name (section 4)."""

    stack: Literal["ClusterPolicy", "GPUCluster"]
    open: bool
    failing: tuple[str, ...] = ()  # human-readable conditions that fail


@dataclass(frozen=True)
class ObjectStatus:
    """Per managed object, for ``/status``."""

    kind: ManagedKind
    name: str
    needed_by: tuple[str, ...]  # "ClusterPolicy/cluster-policy", "GPUCluster/gpu-cluster"
    selector: dict[str, str] | None = None
    gates: tuple[GateState, ...] = ()
    # The selector the rules chose while the hold keeps ``selector`` (section 4), else None.
    held_back: dict[str, str] | None = None


@dataclass(frozen=True)
class Plan:
    objects: tuple[K8sObject, ...] = ()
    actions: tuple[Action, ...] = ()
    conflicts: tuple[Conflict, ...] = ()
    pending: tuple[Pending, ...] = ()
    errors: tuple[SpecError, ...] = ()
    # Every report, sorted by key: the occurrences (``after_write`` None) and the
    # announcements each write action carries in ``Action.announces``.
    reports: tuple[Report, ...] = ()
    status: tuple[ObjectStatus, ...] = ()
    notes: tuple[str, ...] = field(default=())  # e.g. "ServiceMonitor API not served: skipped"
    # Seconds until a waiting rule is due (a drained ServiceMonitor's deletion): plan again
    # then, even if nothing changes. None: nothing waits.
    recheck_after: float | None = None

    @property
    def writes(self) -> tuple[Action, ...]:
        return tuple(a for a in self.actions if a.action in ("create", "update", "delete"))
