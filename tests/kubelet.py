"""The missing kubelet, for tests on a control plane with kube-controller-manager.

The EndpointSlice controller computes endpoints from what a kubelet reports: a pod bound to
a Node (``spec.nodeName``), its ``podIP``/``hostIP`` and its ``Ready`` condition. No kubelet
runs here, so this plays its part: real Node objects, pod status with IPs and Ready, and
deletes with grace period 0 (the kubelet's confirmation that the containers are gone).
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from testenv.workloads import IMAGE, pod_labels

_ips = itertools.count(2)


class Kubelet:
    def __init__(self, api: ApiClient, namespace: str) -> None:
        self._core: Any = client.CoreV1Api(api)
        self._ns = namespace
        self._node_ips: dict[str, str] = {}

    async def node(self, name: str) -> None:
        """A Node object, Ready, with an InternalIP."""
        ip = self._node_ips.setdefault(name, f"192.0.2.{len(self._node_ips) + 1}")
        with contextlib.suppress(ApiException):
            await self._core.create_node({"metadata": {"name": name}})
        await self._core.patch_node_status(
            name,
            {
                "status": {
                    "addresses": [{"type": "InternalIP", "address": ip}],
                    "conditions": [{"type": "Ready", "status": "True"}],
                }
            },
        )

    async def run(
        self,
        name: str,
        app: str,
        node: str,
        *,
        common: bool,
        ready: bool = True,
        labels: dict[str, str] | None = None,
        ports: list[dict[str, Any]] | None = None,
    ) -> str:
        """Creates the pod bound to ``node``, Running with an IP; Ready unless told. The
        labels of an exporter of ``app`` unless ``labels``; its container's ``ports`` (a
        Service's named targetPort). Returns its pod IP."""
        await self.node(node)
        container: dict[str, Any] = {"name": "c", "image": IMAGE}
        if ports:
            container["ports"] = ports
        body = {
            "metadata": {
                "name": name,
                "namespace": self._ns,
                "labels": labels if labels is not None else pod_labels(app, common=common),
            },
            "spec": {"nodeName": node, "containers": [container]},
        }
        await self._core.create_namespaced_pod(self._ns, body)
        n = next(_ips)
        ip = f"10.244.{n // 250}.{n % 250 + 1}"
        status = {
            "status": {
                "phase": "Running",
                "hostIP": self._node_ips[node],
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            }
        }
        await self._core.patch_namespaced_pod_status(name, self._ns, status)
        return ip

    async def ready(self, name: str) -> None:
        await self._core.patch_namespaced_pod_status(
            name, self._ns, {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
        )

    async def gone(self, name: str) -> None:
        """The pod's containers stopped: the object goes at once (grace period 0)."""
        with contextlib.suppress(ApiException):
            await self._core.delete_namespaced_pod(name, self._ns, grace_period_seconds=0)
