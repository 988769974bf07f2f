"""What the Services controller reads, each cache declared once (controller-runtime's
``cache.Options.ByObject``; what both controllers read: ``controllers/shared_caches.py``).

What is watched and why: docs/decisions.md, "What is watched".
"""

from __future__ import annotations

from shared_svc.config import Config
from shared_svc.controllers.shared_caches import CLUSTER_POLICIES, daemonsets_read
from shared_svc.kube.decode import ALL, Decoder
from shared_svc.kube.resources import Resource
from shared_svc.reconcile.names import APP_LABEL, COMMON_LABEL, DRA_APP, LEGACY_APP
from shared_svc.reconcile.selection import pod_fields

GPU_CLUSTERS = Resource(
    "nvidia.com", "v1alpha1", "gpuclusters", "GPUCluster", crd_name="gpuclusters.nvidia.com"
)

# What is decoded of each pod (kube.decode; the rest of the text is skipped): the fields
# its projection reads (proptests/test_cache_decode_props.py: the same kept objects).
POD_DECODER = Decoder(
    {
        "apiVersion": ALL,
        "kind": ALL,
        "metadata": dict.fromkeys(("name", "namespace", "labels", "deletionTimestamp"), ALL),
        "spec": {"nodeName": ALL},
        "status": {"conditions": [{"type": ALL, "status": ALL}]},
    }
)


def dcgm_pod_selectors() -> tuple[str, ...]:
    """The DCGM pods as disjoint label selectors: the pods of each of the four DCGM apps
    (the gate's), one selector per ``app``, then those of the other pods that carry the
    DCGM common label, then those of the rest that carry the exporter's common label (the
    hold's: a rule selector is an ``app`` or a common label). Their union is every pod
    planning reads; disjoint, each pod is listed, watched and kept once. One selector per
    app, not ``app in (...)``: each is listed page after page on its own, so the four
    DaemonSets' pods (one per GPU node each) are four lists at once, the API server
    answering one while shared-svc reads another (docs/decisions.md, "What is watched")."""
    apps = sorted({*LEGACY_APP.values(), *DRA_APP.values()})
    dcgm, exporter = COMMON_LABEL["dcgm"], COMMON_LABEL["exporter"]
    others = f"{APP_LABEL} notin ({','.join(apps)})"
    return (
        *(f"{APP_LABEL}={app}" for app in apps),
        f"{dcgm}=true,{others}",
        f"{exporter}=true,{dcgm}!=true,{others}",
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


def services(namespace: str) -> Resource:
    return Resource("", "v1", "services", "Service", namespace=namespace)


def service_monitors(namespace: str) -> Resource:
    return Resource(
        "monitoring.coreos.com",
        "v1",
        "servicemonitors",
        "ServiceMonitor",
        namespace=namespace,
        crd_name="servicemonitors.monitoring.coreos.com",
    )


def declare(config: Config) -> dict[str, Resource]:
    """What planning reads, by the name ``/status`` gives each cache (the
    ServiceMonitors aside: :func:`service_monitors`, read while their API is served)."""
    ns = config.namespace
    return {
        "clusterpolicies": CLUSTER_POLICIES,
        "gpuclusters": GPU_CLUSTERS,
        "services": services(ns),
        "daemonsets": daemonsets_read(config),
        "pods": operator_pods(ns),
    }
