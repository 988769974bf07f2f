"""Plain data in and out of the reconcile core.

The core is a pure function ``plan(world, settings) -> Plan`` (see ``planner.py``).
Inputs are Kubernetes objects as plain JSON-like dicts, exactly as the API server
returns them (camelCase keys); outputs are plain data as well, so the shell can send
them to the API server and the ``plan`` command can print them without translation.
Nothing in this package does I/O or reads a clock.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class World:
    """A consistent snapshot: cluster-scoped CRs plus namespaced objects of the operator namespace."""

    cluster_policies: tuple[K8sObject, ...] = ()
    gpu_clusters: tuple[K8sObject, ...] = ()
    daemonsets: tuple[K8sObject, ...] = ()
    pods: tuple[K8sObject, ...] = ()
    services: tuple[K8sObject, ...] = ()
    service_monitors: tuple[K8sObject, ...] = ()


@dataclass(frozen=True)
class Action:
    """One step that brings one live object to its desired state.

    ``Plan.actions`` is in execution order (coverage never dips: section 5 of the contract).
    For ``create``/``update`` the shell first sends ``json_patch`` (if any) guarded by
    ``preconditions``, then server-side-applies ``apply`` (if any) with field manager
    ``shared-svc``. For ``delete`` it deletes with ``preconditions``.
    """

    action: ActionKind
    kind: ManagedKind
    name: str
    reason: str
    apply: K8sObject | None = None
    json_patch: tuple[K8sObject, ...] = ()
    preconditions: dict[str, str] | None = None  # {"uid": ..., "resourceVersion": ...}
    changed_fields: tuple[str, ...] = ()  # dotted paths whose live value differs from intent


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
    reports: tuple[Report, ...] = ()
    status: tuple[ObjectStatus, ...] = ()
    notes: tuple[str, ...] = field(default=())  # e.g. "ServiceMonitor API not served: skipped"

    @property
    def writes(self) -> tuple[Action, ...]:
        return tuple(a for a in self.actions if a.action in ("create", "update", "delete"))
