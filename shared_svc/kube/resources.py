"""The resources both controllers cache, each kept as its one projection (what the
planners read of it), so a shared :class:`~shared_svc.kube.cache.Informers` holds one
copy of each."""

from __future__ import annotations

from shared_svc.kube.cache import Resource
from shared_svc.reconcile.selectors import daemonset_fields

CLUSTER_POLICIES = Resource(
    "nvidia.com", "v1", "clusterpolicies", "ClusterPolicy", crd_name="clusterpolicies.nvidia.com"
)


def daemonsets(namespace: str | None = None) -> Resource:
    """DaemonSets of ``namespace`` (None: all namespaces, as the upgrade controller reads
    them), kept as ``daemonset_fields``."""
    return Resource(
        "apps", "v1", "daemonsets", "DaemonSet", namespace=namespace, project=daemonset_fields
    )
