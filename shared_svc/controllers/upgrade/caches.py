"""What the driver-upgrade controller reads, each cache declared once (controller-runtime's
``cache.Options.ByObject``; what both controllers read: ``controllers/shared_caches.py``):
the upgrading nodes and the nodes it parked (metadata only), the DaemonSets of every
namespace, and what tells which upgrade policy gpu-operator reads (``upgrade/policy.py``;
never written): the ClusterPolicies, the NVIDIADrivers and the NVIDIADriver CRD (whether it
has ``spec.upgradePolicy``, kept as that one answer).

What is watched and why: docs/decisions.md, "What is watched".
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from shared_svc.controllers.shared_caches import ALL_DAEMONSETS, CLUSTER_POLICIES
from shared_svc.k8s.objects import K8sObject
from shared_svc.kube.registry import AnyCache, CacheRegistry
from shared_svc.kube.resources import METADATA_DECODER, Resource
from shared_svc.upgrade.daemonsets import parked_label_key
from shared_svc.upgrade.policy import NVIDIA_DRIVER_CRD, crd_fields
from shared_svc.upgrade.states import state_label_key

NVIDIA_DRIVERS = Resource(
    "nvidia.com", "v1alpha1", "nvidiadrivers", "NVIDIADriver", crd_name=NVIDIA_DRIVER_CRD
)
# The one CRD, by name (RBAC: list and watch with that resourceName), kept as whether it
# gives NVIDIADrivers an upgrade policy (gpu-operator v26.7.0 and later).
NVIDIA_DRIVER_CRD_RESOURCE = Resource(
    "apiextensions.k8s.io",
    "v1",
    "customresourcedefinitions",
    "CustomResourceDefinition",
    field_selector=f"metadata.name={NVIDIA_DRIVER_CRD}",
    project=crd_fields,
    name="nvidiadriver-crd",
)


def node_resources(driver_name: str) -> tuple[Resource, Resource]:
    """Nodes in an upgrade (state label exists) and nodes we may have parked.

    Kept as metadata only (``PartialObjectMetadata``, under kind ``Node``): every reader
    of a cached node (``plan_node`` through ``get_node``, the event sources) reads its
    labels, annotations, name, uid and resourceVersion, never its spec or status (a GPU
    node's status is 10-30 KiB, rewritten by its kubelet)."""
    state, parked = state_label_key(driver_name), parked_label_key(driver_name)
    return (
        Resource(
            "",
            "v1",
            "nodes",
            "Node",
            label_selector=state,
            metadata_only=True,
            decoder=METADATA_DECODER,
            name="upgrading-nodes",
        ),
        Resource(
            "",
            "v1",
            "nodes",
            "Node",
            label_selector=parked,
            metadata_only=True,
            decoder=METADATA_DECODER,
            name="parked-nodes",
        ),
    )


def _rv(obj: K8sObject) -> int:
    version = str(obj.get("metadata", {}).get("resourceVersion", ""))
    return int(version) if version.isdigit() else 0


@dataclass(frozen=True)
class UpgradeCaches:
    """The caches the controller reads, from the process's registry."""

    nodes: tuple[AnyCache, AnyCache]  # upgrading, parked: a node may be in both
    daemonsets: AnyCache
    cluster_policies: AnyCache
    nvidia_drivers: AnyCache
    driver_crd: AnyCache  # the NVIDIADriver CRD, projected (``policy.crd_fields``)

    @classmethod
    def of(cls, registry: CacheRegistry, driver_name: str) -> UpgradeCaches:
        state, parked = node_resources(driver_name)
        return cls(
            nodes=(registry.cache(state), registry.cache(parked)),
            daemonsets=registry.cache(ALL_DAEMONSETS),
            cluster_policies=registry.cache(CLUSTER_POLICIES),
            nvidia_drivers=registry.cache(NVIDIA_DRIVERS),
            driver_crd=registry.cache(NVIDIA_DRIVER_CRD_RESOURCE),
        )

    def all(self) -> tuple[AnyCache, ...]:
        return (
            *self.nodes,
            self.daemonsets,
            self.cluster_policies,
            self.nvidia_drivers,
            self.driver_crd,
        )

    def read(self) -> tuple[AnyCache, ...]:
        """What a pass reads: the node caches and the DaemonSets (the policy caches are
        the gate review's)."""
        return (*self.nodes, self.daemonsets)

    def policy_caches(self) -> tuple[AnyCache, AnyCache, AnyCache]:
        """What tells which upgrade policy gpu-operator reads (``policy.policy_sources``)."""
        return (self.cluster_policies, self.nvidia_drivers, self.driver_crd)

    def get_node(self, name: str) -> K8sObject | None:
        """The node from the node caches (no request): every node the controller handles
        is in one of them; a node in neither is no longer upgrading nor parked. Of two
        copies, the newer (a stale one would only cost a 409 and a retry)."""
        copies = [n for n in (cache.get(name) for cache in self.nodes) if n is not None]
        return max(copies, key=_rv, default=None)

    def cached_nodes(self) -> Iterator[K8sObject]:
        """Every cached node that is upgrading or parked, a node in both caches twice (the
        resync's list, ``upgrade.resync.resync_keys``: not read per event)."""
        for cache in self.nodes:
            yield from cache.items()
