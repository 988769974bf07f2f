"""The caches both controllers read, each declared once, and the one registry of a process.

A declaration is a :class:`~shared_svc.kube.resources.Resource` (controller-runtime's
``cache.Options.ByObject``: what is watched of a kind, what is kept of each object).
Each controller package declares what it reads (``services/caches.py``,
``upgrade/caches.py``); what both read is declared here, once: two controllers that read
one resource get the same declaration, hence one cache in the shared registry
(``kube.registry.CacheRegistry`` keys its caches by declaration), whichever asks first,
and neither knows of the other. The registry's own options (the reconnect backoff) are
set once, from the configuration (:func:`registry`).

What is watched and why: docs/decisions.md, "What is watched".
"""

from __future__ import annotations

from collections.abc import Callable

from kubernetes_asyncio.client import ApiClient

from shared_svc.config import Config
from shared_svc.k8s.projections import DAEMONSET_READS, daemonset_fields
from shared_svc.kube.decode import Decoder
from shared_svc.kube.registry import CacheRegistry
from shared_svc.kube.resources import Resource

CACHE_BACKOFF_MAX_SECONDS = 30.0  # a cache's reconnects wait at most this (or the setting)

# Read by the Services controller (the CRs that need the Services) and by the upgrade
# controller (the gate of the upgrade flow, never written).
CLUSTER_POLICIES = Resource(
    "nvidia.com", "v1", "clusterpolicies", "ClusterPolicy", crd_name="clusterpolicies.nvidia.com"
)

# What is decoded of each DaemonSet (kube.decode; the rest of the text is skipped): the
# fields its projection reads (proptests/test_cache_decode_props.py: the same kept objects).
DAEMONSET_DECODER = Decoder(DAEMONSET_READS)


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


# The upgrade controller reads the DaemonSets of every namespace (declared consumers);
# with it on, the Services controller reads the same cache (it keeps the namespace's).
ALL_DAEMONSETS = daemonsets(None)


def daemonsets_read(config: Config) -> Resource:
    """The DaemonSets the Services controller reads: with the upgrade controller on, one
    cache of every namespace serves both (the Services planner keeps only the
    namespace's; the upgrade RBAC lists DaemonSets everywhere), else the namespace's."""
    return ALL_DAEMONSETS if config.upgrade_controller else daemonsets(config.namespace)


def registry(
    api: ApiClient,
    config: Config,
    *,
    on_synced: Callable[[str, bool], None] | None = None,
    on_all_synced: Callable[[], None] | None = None,
) -> CacheRegistry:
    """The one registry of caches of a process, shared by its controllers, which only ask
    it for caches and read them; the service hands its caches to the Manager
    (``CacheRegistry.runnables``), which starts them before the controllers.
    ``on_synced``: the ``shared_svc_cache_synced`` gauge, set for every cache;
    ``on_all_synced``: every cache it runs is synced (the service freezes the heap)."""
    return CacheRegistry(
        api,
        backoff_max_seconds=min(CACHE_BACKOFF_MAX_SECONDS, config.backoff_max_seconds),
        on_synced=on_synced,
        on_all_synced=on_all_synced,
    )
