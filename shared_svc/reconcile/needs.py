"""Which CRs count and which objects each of them needs (contract sections 1, 2 and 9)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from shared_svc.k8s.objects import K8sObject, owner_refs
from shared_svc.reconcile.model import World
from shared_svc.reconcile.names import (
    DCGM,
    DCGM_DRA,
    EXPORTER,
    EXPORTER_DRA,
    GPU_CLUSTER_NAME,
    SERVICE_MONITOR,
    SERVICE_MONITOR_DRA,
)
from shared_svc.reconcile.specs import CLUSTER_POLICY, GPU_CLUSTER, CRKind, CRSpec, parse_cr

# (kind, name) of an object we may manage.
ObjectKey = tuple[str, str]


def active_cluster_policy(policies: Iterable[CRSpec]) -> CRSpec | None:
    """The oldest ClusterPolicy not being deleted, ties broken by lowest name."""
    alive = [p for p in policies if not p.deleting]
    return min(alive, key=lambda p: (p.created, p.name, p.uid), default=None)


def counting_crs(world: World) -> tuple[CRSpec, ...]:
    """The CRs whose needs count: the active ClusterPolicy and GPUCluster ``gpu-cluster``."""
    policies = [parse_cr(CLUSTER_POLICY, o) for o in world.cluster_policies if isinstance(o, dict)]
    clusters = [parse_cr(GPU_CLUSTER, o) for o in world.gpu_clusters if isinstance(o, dict)]
    chosen: list[CRSpec] = []
    active = active_cluster_policy(policies)
    if active is not None:
        chosen.append(active)
    # GPUCluster is a singleton by admission rule; any other name never counts.
    gc = [c for c in clusters if c.name == GPU_CLUSTER_NAME and not c.deleting]
    chosen.extend(sorted(gc, key=lambda c: c.precedence)[:1])
    return tuple(sorted(chosen, key=lambda c: c.precedence))


def needs_table(cr: CRSpec) -> tuple[ObjectKey, ...]:
    """What a valid CR needs (section 2; the ServiceMonitors from section 7: the canonical
    one for either stack, the GPUCluster's own ``-dra`` one for the GPUCluster only)."""
    legacy = cr.kind == CLUSTER_POLICY
    wanted: list[ObjectKey] = []
    if cr.dcgm_on:
        wanted.append(("Service", DCGM))
        if not legacy:
            wanted.append(("Service", DCGM_DRA))
    if cr.exporter_on:
        wanted.append(("Service", EXPORTER))
        if not legacy:
            wanted.append(("Service", EXPORTER_DRA))
        if cr.service_monitor_on:
            wanted.append(("ServiceMonitor", SERVICE_MONITOR))
            if not legacy:
                wanted.append(("ServiceMonitor", SERVICE_MONITOR_DRA))
    return tuple(wanted)


def holds_ref(cr: CRSpec, obj: K8sObject) -> bool:
    """Whether ``obj`` carries an owner reference to exactly this CR (same uid)."""
    return any(
        r.get("kind") == cr.kind and r.get("name") == cr.name and r.get("uid") == cr.uid
        for r in owner_refs(obj)
    )


@dataclass(frozen=True)
class Needs:
    """Who needs what, after the InvalidSpec rule."""

    crs: tuple[CRSpec, ...]  # the counting CRs, in precedence order
    by_object: Mapping[ObjectKey, tuple[CRSpec, ...]]  # only objects someone needs

    def needed_by(self, key: ObjectKey) -> tuple[CRSpec, ...]:
        return self.by_object.get(key, ())

    def stacks_needing(self, name: str) -> frozenset[CRKind]:
        return frozenset(cr.kind for cr in self.needed_by(("Service", name)))


def compute_needs(crs: tuple[CRSpec, ...], live: Mapping[ObjectKey, K8sObject]) -> Needs:
    """Needs per object. An invalid CR needs exactly the objects it owns now (section 9)."""
    table: dict[ObjectKey, list[CRSpec]] = {}
    for cr in crs:
        if cr.valid:
            keys: Iterable[ObjectKey] = needs_table(cr)
        else:
            keys = [key for key, obj in sorted(live.items()) if holds_ref(cr, obj)]
        for key in keys:
            table.setdefault(key, []).append(cr)
    return Needs(crs=crs, by_object={k: tuple(v) for k, v in sorted(table.items())})
