"""DCGM workloads on the embedded control plane, for the demo and the tests.

No DaemonSet controller or kubelet runs there, so this plays their part: it writes a
DaemonSet and sets the rollout status the controller would report, and creates pods
with the labels a rollout would give them, marked Running and Ready.
"""

from __future__ import annotations

from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from shared_svc.reconcile.names import COMMON_LABEL

IMAGE = "nvcr.io/nvidia/k8s/dcgm-exporter:4"
# The keys the project's ClusterPolicy CRD requires (testenv/crds/).
CP_REQUIRED = ("operator", "driver", "toolkit", "devicePlugin", "gfd", "nodeStatusExporter")


def cp_body(name: str = "cluster-policy", **spec: Any) -> dict[str, Any]:
    """A ClusterPolicy that passes the CRD (required keys present); ``spec`` overrides blocks."""
    full: dict[str, Any] = {k: {} for k in CP_REQUIRED}
    full.update({"daemonsets": {}, "dcgm": {}, "dcgmExporter": {}})
    full.update(spec)
    return {
        "apiVersion": "nvidia.com/v1",
        "kind": "ClusterPolicy",
        "metadata": {"name": name},
        "spec": full,
    }


def gc_body(**spec: Any) -> dict[str, Any]:
    """The GPUCluster (its CRD allows the name ``gpu-cluster`` only); ``spec`` overrides blocks."""
    full: dict[str, Any] = {
        "draDriver": {},
        "dcgm": {"enabled": True},
        "dcgmExporter": {"enabled": True},
    }
    full.update(spec)
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "GPUCluster",
        "metadata": {"name": "gpu-cluster"},
        "spec": full,
    }


def pod_labels(app: str, *, common: bool) -> dict[str, str]:
    """``app`` plus, once the operator's rollout has reached the pod, the common label."""
    key = COMMON_LABEL["exporter"] if "exporter" in app else COMMON_LABEL["dcgm"]
    return {"app": app, **({key: "true"} if common else {})}


class DcgmWorkloads:
    def __init__(self, api: ApiClient, namespace: str, *, field_manager: str = "testenv") -> None:
        self._core: Any = client.CoreV1Api(api)
        self._apps: Any = client.AppsV1Api(api)
        self._ns = namespace
        self._manager = field_manager

    async def daemonset(
        self,
        app: str,
        *,
        common: bool,
        desired: int = 2,
        updated: int | None = None,
        available: int | None = None,
        on_delete: bool = False,
    ) -> None:
        """Applies the DaemonSet ``app`` and sets its status (complete unless told otherwise)."""
        labels = pod_labels(app, common=common)
        body = {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": app, "namespace": self._ns, "labels": labels},
            "spec": {
                "selector": {"matchLabels": {"app": app}},
                "updateStrategy": {"type": "OnDelete" if on_delete else "RollingUpdate"},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{"name": "c", "image": IMAGE}]},
                },
            },
        }
        ds = await self._apps.patch_namespaced_daemon_set(
            app,
            self._ns,
            body,
            field_manager=self._manager,
            force=True,
            _content_type="application/apply-patch+yaml",
        )
        ready = available if available is not None else desired
        status = {
            "status": {
                "observedGeneration": ds.metadata.generation,
                "desiredNumberScheduled": desired,
                "currentNumberScheduled": desired,
                "numberMisscheduled": 0,
                "numberReady": ready,
                "updatedNumberScheduled": updated if updated is not None else desired,
                "numberAvailable": ready,
            }
        }
        await self._apps.patch_namespaced_daemon_set_status(
            app, self._ns, status, _content_type="application/merge-patch+json"
        )

    async def pod(self, name: str, app: str, *, common: bool, ready: bool = True) -> None:
        """Creates the pod, or relabels it as a rollout would; Running and Ready unless told."""
        labels = pod_labels(app, common=common)
        body = {
            "metadata": {"name": name, "namespace": self._ns, "labels": labels},
            "spec": {"containers": [{"name": "c", "image": IMAGE}]},
        }
        try:
            await self._core.create_namespaced_pod(self._ns, body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            await self._core.patch_namespaced_pod(name, self._ns, {"metadata": {"labels": labels}})
        if ready:
            status = {
                "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
            }
            await self._core.patch_namespaced_pod_status(name, self._ns, status)

    async def delete_pod(self, name: str) -> None:
        await self._core.delete_namespaced_pod(name, self._ns, grace_period_seconds=0)
