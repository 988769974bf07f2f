"""The application's caches, each declared once (controller-runtime's ``cache.Options.ByObject``).

Every resource a controller caches is declared here, with what is watched of it
(namespace, label selectors) and what is kept of each object (projection, metadata
only): ``kube/`` knows how to cache a :class:`~shared_svc.kube.resources.Resource`, this
module knows which ones shared-svc needs. The controllers ask for the declaration of what
they read; two controllers that read one resource get the same declaration, hence one
cache in the shared registry (``kube.registry.Informers`` keys its caches by declaration),
whichever asks first, and neither knows of the other. The registry's own options (the
reconnect backoff) are set once, from the configuration (:func:`registry`).

What is watched and why: docs/decisions.md, "What is watched".
"""

from __future__ import annotations

from dataclasses import dataclass

from kubernetes_asyncio.client import ApiClient

from shared_svc.config import Config
from shared_svc.k8s.projections import DAEMONSET_READS, daemonset_fields
from shared_svc.kube.decode import ALL, Decoder
from shared_svc.kube.registry import Informers
from shared_svc.kube.resources import METADATA_DECODER as METADATA
from shared_svc.kube.resources import Resource
from shared_svc.reconcile.names import APP_LABEL, COMMON_LABEL, DRA_APP, LEGACY_APP
from shared_svc.reconcile.selection import pod_fields
from shared_svc.upgrade.daemonsets import parked_label_key
from shared_svc.upgrade.states import state_label_key

CACHE_BACKOFF_MAX_SECONDS = 30.0  # a cache's reconnects wait at most this (or the setting)

CLUSTER_POLICIES = Resource(
    "nvidia.com", "v1", "clusterpolicies", "ClusterPolicy", crd_name="clusterpolicies.nvidia.com"
)
GPU_CLUSTERS = Resource(
    "nvidia.com", "v1alpha1", "gpuclusters", "GPUCluster", crd_name="gpuclusters.nvidia.com"
)


# What is decoded of each object (kube.decode; the rest of the text is skipped): the
# fields its projection reads (proptests/test_cache_decode_props.py: the same kept objects).
DAEMONSET_DECODER = Decoder(DAEMONSET_READS)
POD_DECODER = Decoder(
    {
        "apiVersion": ALL,
        "kind": ALL,
        "metadata": dict.fromkeys(("name", "namespace", "labels", "deletionTimestamp"), ALL),
        "spec": {"nodeName": ALL},
        "status": {"conditions": [{"type": ALL, "status": ALL}]},
    }
)


def daemonsets(namespace: str | None) -> Resource:
    """DaemonSets of ``namespace`` (None: all namespaces), kept as ``daemonset_fields``."""
    return Resource(
        "apps",
        "v1",
        "daemonsets",
        "DaemonSet",
        namespace=namespace,
        project=daemonset_fields,
        decoder=DAEMONSET_DECODER,
    )


# The upgrade controller reads the DaemonSets of every namespace (declared consumers).
ALL_DAEMONSETS = daemonsets(None)


def node_resources(driver_name: str) -> tuple[Resource, Resource]:
    """Nodes in an upgrade (state label exists) and nodes we may have parked.

    Kept as metadata only (``PartialObjectMetadata``, under kind ``Node``): every reader
    of a cached node (``plan_node`` through ``get_node``, the event sources) reads its
    labels, annotations, name, uid and resourceVersion, never its spec or status (a GPU
    node's status is 10-30 KiB, rewritten by its kubelet)."""
    state, parked = state_label_key(driver_name), parked_label_key(driver_name)
    return (
        Resource(
            "", "v1", "nodes", "Node", label_selector=state, metadata_only=True, decoder=METADATA
        ),
        Resource(
            "", "v1", "nodes", "Node", label_selector=parked, metadata_only=True, decoder=METADATA
        ),
    )


def dcgm_pod_selectors() -> tuple[str, ...]:
    """The DCGM pods as three disjoint label selectors: the pods whose ``app`` is one of
    the four DCGM apps (the gate's), then those of the others that carry the DCGM common
    label, then those of the rest that carry the exporter's common label (the hold's:
    a rule selector is an ``app`` or a common label). Their union is every pod planning
    reads; disjoint, each pod is listed, watched and kept once."""
    apps = ",".join(sorted({*LEGACY_APP.values(), *DRA_APP.values()}))
    dcgm, exporter = COMMON_LABEL["dcgm"], COMMON_LABEL["exporter"]
    return (
        f"{APP_LABEL} in ({apps})",
        f"{dcgm}=true,{APP_LABEL} notin ({apps})",
        f"{exporter}=true,{dcgm}!=true,{APP_LABEL} notin ({apps})",
    )


def operator_pods(namespace: str) -> Resource:
    """The DCGM pods of the operator namespace (:func:`dcgm_pod_selectors`; the other
    operands' pods, most of the namespace, are not watched), kept as the fields planning
    reads (``pod_fields``)."""
    return Resource(
        "",
        "v1",
        "pods",
        "Pod",
        namespace=namespace,
        project=pod_fields,
        any_of=dcgm_pod_selectors(),
        decoder=POD_DECODER,
    )


def service_monitors(namespace: str) -> Resource:
    return Resource(
        "monitoring.coreos.com",
        "v1",
        "servicemonitors",
        "ServiceMonitor",
        namespace=namespace,
        crd_name="servicemonitors.monitoring.coreos.com",
    )


@dataclass(frozen=True)
class Caches:
    """The declaration of every cache of one configuration."""

    cluster_policies: Resource
    gpu_clusters: Resource
    services: Resource
    daemonsets: Resource
    pods: Resource
    service_monitors: Resource


def declare(config: Config) -> Caches:
    """The caches of ``config``. DaemonSets: with the upgrade controller on, one cache of
    every namespace serves both controllers (the Services planner keeps only the
    namespace's; the upgrade RBAC lists DaemonSets everywhere), else the namespace's."""
    ns = config.namespace
    return Caches(
        cluster_policies=CLUSTER_POLICIES,
        gpu_clusters=GPU_CLUSTERS,
        services=Resource("", "v1", "services", "Service", namespace=ns),
        daemonsets=ALL_DAEMONSETS if config.upgrade_controller else daemonsets(ns),
        pods=operator_pods(ns),
        service_monitors=service_monitors(ns),
    )


def registry(api: ApiClient, config: Config) -> Informers:
    """The one registry of caches of a process, shared by its controllers, which only ask
    it for caches and read them; the service hands its caches to the Manager
    (``Informers.runnables``), which starts them before the controllers."""
    return Informers(
        api, backoff_max_seconds=min(CACHE_BACKOFF_MAX_SECONDS, config.backoff_max_seconds)
    )
