"""Helpers for the admission-guard tests: a test CA and serving certificate, the guard as
the chart renders it, and the "writers" that play gpu-operator's two controllers.

The writer is an interface (``OperatorWriter``): ``SimulatedOperator`` does exactly what
the fact sheet (gpu-operator.md section 9) measured of the real ClusterPolicy controller
(whole-object PUTs with a controller owner reference and only its own labels, field
manager ``gpu-operator``, deletes by name) under gpu-operator's own ServiceAccount. A
run against the real gpu-operator swaps in a writer that drives it instead.

``SimulatedGpuCluster`` is the GPUCluster controller of gpu-operator v26.7.0 as measured
(facts section 10; the module proxy serves no 26.x to build it): the one emulation of it
the tests use. It renders ``nvidia-dcgm-dra`` (dcgm on), ``nvidia-dcgm-exporter-dra``
(exporter on) and, when its exporter's ``serviceMonitor.enabled`` and the cluster serves
the ServiceMonitor API, the ServiceMonitor ``nvidia-dcgm-exporter-dra``; every object with
a controller reference to the GPUCluster and the state label; it creates, and on 409 GETs
and PUTs the whole object (only ``resourceVersion`` copied from the live one).
"""

from __future__ import annotations

import base64
import copy
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from shared_svc.admission.rules import operator_username
from testenv import ControlPlane
from tests.kube import api_client, eventually
from tests.test_deploy_chart import Doc, render_docs
from tests.worlds import gpu_cluster_objects

ADMISSION_KINDS = {
    "MutatingAdmissionPolicy": "mutatingadmissionpolicies",
    "MutatingAdmissionPolicyBinding": "mutatingadmissionpolicybindings",
    "MutatingWebhookConfiguration": "mutatingwebhookconfigurations",
    "ValidatingWebhookConfiguration": "validatingwebhookconfigurations",
}
ADMISSION_API = "/apis/admissionregistration.k8s.io/v1"
# What gpu-operator's ClusterPolicy controller renders (facts section 1.1 and 9).
OPERATOR_SHAPE: dict[str, dict[str, Any]] = {
    "nvidia-dcgm": {
        "annotations": None,
        "port": {"name": "dcgm", "port": 5555, "protocol": "TCP"},
        "itp": "Local",
    },
    "nvidia-dcgm-exporter": {
        "annotations": {"prometheus.io/scrape": "true"},
        "port": {"name": "gpu-metrics", "port": 9400, "targetPort": 9400, "protocol": "TCP"},
        "itp": "Cluster",
    },
}
STATE_LABEL = "nvidia.com/gpu-operator.state"
MONITORING = ("monitoring.coreos.com", "v1")


@dataclass(frozen=True)
class Tls:
    """A test CA and a serving certificate for 127.0.0.1 signed by it (openssl CLI)."""

    ca_bundle: str  # base64 PEM, for caBundle
    cert_file: str
    key_file: str


def make_tls(directory: Path, dns_names: tuple[str, ...] = ()) -> Tls:
    """``dns_names``: more names of the serving certificate (a webhook behind a Service is
    called with the server name ``<service>.<namespace>.svc``)."""
    directory.mkdir(parents=True, exist_ok=True)
    d = str(directory)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    run(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        "-subj", "/CN=shared-svc-test-ca", "-keyout", f"{d}/ca.key", "-out", f"{d}/ca.crt",
    )  # fmt: skip
    run(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", f"{d}/tls.key", "-out", f"{d}/tls.csr",
    )  # fmt: skip
    sans = ",".join(["IP:127.0.0.1", *(f"DNS:{n}" for n in dns_names)])
    (directory / "ext.cnf").write_text(f"subjectAltName={sans}\nextendedKeyUsage=serverAuth\n")
    run(
        "x509", "-req", "-in", f"{d}/tls.csr", "-CA", f"{d}/ca.crt", "-CAkey", f"{d}/ca.key",
        "-CAcreateserial", "-days", "1", "-extfile", f"{d}/ext.cnf", "-out", f"{d}/tls.crt",
    )  # fmt: skip
    ca = (directory / "ca.crt").read_bytes()
    return Tls(base64.b64encode(ca).decode(), f"{d}/tls.crt", f"{d}/tls.key")


def guard_docs(
    namespace: str, *sets: str, cluster: ControlPlane | None = None, flags: tuple[str, ...] = ()
) -> list[Doc]:
    """The admission objects of the chart rendered for ``namespace`` with ``sets``; with
    ``cluster``, as ``helm install`` renders them there (that API server's version and
    API versions decide ``admission.mutation: auto``); ``flags``: more helmrender flags."""
    kubeconfig = cluster.kubeconfig if cluster is not None else None
    return [
        d
        for d in render_docs(
            *sets, name="shared-svc", namespace=namespace, kubeconfig=kubeconfig, flags=flags
        )
        if d["kind"] in ADMISSION_KINDS
    ]


def policy_sets() -> tuple[str, ...]:
    return ("admission.mutation=policy", "admission.webhook.enabled=false")


def webhook_sets(tls: Tls, port: int, *, mutation: str = "webhook") -> tuple[str, ...]:
    return (
        f"admission.mutation={mutation}",
        "admission.webhook.enabled=true",
        f"admission.webhook.url=https://127.0.0.1:{port}",
        "admission.certificate.source=external",
        f"admission.webhook.caBundle={tls.ca_bundle}",
    )


def install(cp: ControlPlane, docs: list[Doc]) -> None:
    cp.apply_manifests(docs, field_manager="helm")


def uninstall(cp: ControlPlane, docs: list[Doc]) -> None:
    """Bindings first (the chart's uninstall order), then the rest."""
    for doc in sorted(docs, key=lambda d: not d["kind"].endswith("Binding")):
        cp.request(
            "DELETE", f"{ADMISSION_API}/{ADMISSION_KINDS[doc['kind']]}/{doc['metadata']['name']}"
        )


class OperatorWriter(Protocol):
    """What the tests need of gpu-operator: its writes of one of our names."""

    async def put(self, name: str, *, dry_run: bool = False) -> dict[str, Any]:
        """One whole-object update; returns the object the API server answered."""
        ...

    async def delete(self, name: str, *, dry_run: bool = False) -> int:
        """Deletes by name; returns 200 or the API server's status code."""
        ...


async def operator_api(cp: ControlPlane, directory: Path, namespace: str) -> ApiClient:
    """A client as gpu-operator's ServiceAccount ``gpu-operator`` of ``namespace``, with
    ``cluster-admin`` (the aggregated roles are empty without kube-controller-manager): its
    writes in the namespace and its reads of the cluster-scoped CRs."""
    body = {
        "metadata": {"name": f"gpu-operator-{namespace}"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": "cluster-admin",
        },
        "subjects": [{"kind": "ServiceAccount", "name": "gpu-operator", "namespace": namespace}],
    }
    code, out = cp.request("POST", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", body)
    assert code in (201, 409), out
    token = cp.service_account_token(namespace, "gpu-operator")
    path = cp.write_kubeconfig(directory / f"gpu-operator-{namespace}.kubeconfig", token)
    api = await api_client(cp, str(path))
    core = client.CoreV1Api(api)

    async def can_list() -> bool:
        try:
            await core.list_namespaced_service(namespace)
        except ApiException:
            return False
        return True

    try:
        await eventually(can_list, timeout=15)
    except BaseException:
        await api.close()
        raise
    return api


class SimulatedOperator:
    """gpu-operator's ClusterPolicy controller as measured (facts section 9), under its
    own ServiceAccount ``gpu-operator`` and field manager ``gpu-operator``."""

    FIELD_MANAGER = "gpu-operator"

    def __init__(self, api: ApiClient, namespace: str, owner: dict[str, Any]) -> None:
        self.api = api
        self.ns = namespace
        self.owner = owner  # the ClusterPolicy (or GPUCluster) it reconciles
        self.core = client.CoreV1Api(api)

    @classmethod
    async def start(
        cls, cp: ControlPlane, directory: Path, namespace: str, owner: dict[str, Any]
    ) -> SimulatedOperator:
        return cls(await operator_api(cp, directory, namespace), namespace, owner)

    @property
    def username(self) -> str:
        return operator_username(self.ns, "gpu-operator")

    def metadata(self, name: str, live: dict[str, Any]) -> dict[str, Any]:
        meta = self.owner["metadata"]
        return {
            "name": name,
            "namespace": self.ns,
            "resourceVersion": live["metadata"]["resourceVersion"],
            "labels": {"app": name},
            "ownerReferences": [
                {
                    "apiVersion": self.owner["apiVersion"],
                    "kind": self.owner["kind"],
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        }

    def body(self, name: str, live: dict[str, Any]) -> dict[str, Any]:
        shape = OPERATOR_SHAPE[name]
        metadata = self.metadata(name, live)
        if shape["annotations"]:
            metadata["annotations"] = shape["annotations"]
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": metadata,
            "spec": {
                "type": "ClusterIP",
                "clusterIP": live["spec"]["clusterIP"],  # the one field it copies (facts 3)
                "selector": {"app": name},
                "ports": [shape["port"]],
                "internalTrafficPolicy": shape["itp"],
            },
        }

    async def put(self, name: str, *, dry_run: bool = False) -> dict[str, Any]:
        live = self.api.sanitize_for_serialization(
            await self.core.read_namespaced_service(name, self.ns)
        )
        kwargs: dict[str, Any] = {"field_manager": self.FIELD_MANAGER}
        if dry_run:
            kwargs["dry_run"] = "All"
        out = await self.core.replace_namespaced_service(
            name, self.ns, self.body(name, live), **kwargs
        )
        result: dict[str, Any] = self.api.sanitize_for_serialization(out)
        return result

    async def put_monitor(self, name: str = "nvidia-dcgm-exporter") -> dict[str, Any]:
        """ClusterPolicy's ServiceMonitor step (facts 4): a whole-object update."""
        custom = client.CustomObjectsApi(self.api)
        args = ("monitoring.coreos.com", "v1", self.ns, "servicemonitors", name)
        live = await custom.get_namespaced_custom_object(*args)
        body = {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "ServiceMonitor",
            "metadata": self.metadata(name, live),
            "spec": {
                "jobLabel": "app",
                "namespaceSelector": {"matchNames": [self.ns]},
                "selector": {"matchLabels": {"app": name}},
                "endpoints": [{"port": "gpu-metrics", "path": "/metrics"}],
            },
        }
        out: dict[str, Any] = await custom.replace_namespaced_custom_object(
            *args, body, field_manager=self.FIELD_MANAGER
        )
        return out

    async def delete(self, name: str, *, dry_run: bool = False) -> int:
        kwargs = {"dry_run": "All"} if dry_run else {}
        try:
            await self.core.delete_namespaced_service(name, self.ns, **kwargs)
        except ApiException as exc:
            return int(exc.status)
        return 200

    async def close(self) -> None:
        await self.api.close()


class SimulatedGpuCluster:
    """gpu-operator v26.7.0's GPUCluster controller as measured (facts section 10), under
    gpu-operator's ServiceAccount and field manager: ``reconcile`` renders the GPUCluster's
    objects and writes each (create; on 409 GET and a whole PUT). Its clean-up of a
    disabled state matched no resource type in the measurements (disabling dcgm left its
    Services behind), so ``reconcile`` deletes nothing; ``sweep`` is the label sweep its
    code describes (facts section 3), for the delete guard's tests."""

    FIELD_MANAGER = "gpu-operator"

    def __init__(self, api: ApiClient, namespace: str) -> None:
        self.api = api
        self.ns = namespace
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    @classmethod
    async def start(cls, cp: ControlPlane, directory: Path, namespace: str) -> SimulatedGpuCluster:
        return cls(await operator_api(cp, directory, namespace), namespace)

    @property
    def username(self) -> str:
        return operator_username(self.ns, "gpu-operator")

    async def cr(self) -> dict[str, Any] | None:
        try:
            out: dict[str, Any] = await self.custom.get_cluster_custom_object(
                "nvidia.com", "v1alpha1", "gpuclusters", "gpu-cluster"
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return out

    async def monitors_served(self) -> bool:
        """Its RESTMapper's answer: is ``monitoring.coreos.com/v1`` ServiceMonitor served."""
        try:
            res = await self.api.call_api(
                "/apis/monitoring.coreos.com/v1", "GET", response_types_map={200: "object"},
                auth_settings=["BearerToken"], _return_http_data_only=True,
            )  # fmt: skip
        except ApiException:
            return False
        return any(r.get("name") == "servicemonitors" for r in (res or {}).get("resources", []))

    def render(self, gc: dict[str, Any], *, monitors: bool) -> list[dict[str, Any]]:
        """The objects it keeps for ``gc`` (tests/worlds.py ``gpu_cluster_objects``)."""
        return gpu_cluster_objects(gc, self.ns, monitors=monitors)

    async def reconcile(self) -> dict[str, dict[str, Any]]:
        """One reconcile of the GPUCluster: each rendered object written; what the API
        server answered, by ``Kind/name``. Nothing without a GPUCluster."""
        gc = await self.cr()
        if gc is None:
            return {}
        answered = {}
        for obj in self.render(gc, monitors=await self.monitors_served()):
            answered[f"{obj['kind']}/{obj['metadata']['name']}"] = await self.requeued(obj)
        return answered

    async def requeued(self, obj: dict[str, Any], attempts: int = 5) -> dict[str, Any]:
        """``write`` again when its PUT meets a newer resourceVersion (409 Conflict: the
        object changed between its GET and its PUT, as shared-svc may write it then), as
        controller-runtime requeues the reconcile that returned the error."""
        for _ in range(attempts - 1):
            try:
                return await self.write(obj)
            except ApiException as exc:
                if exc.status != 409:
                    raise
        return await self.write(obj)

    async def write(self, obj: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        """Create; on 409 GET and PUT the whole object (its ``mergeObjects``: only the
        resourceVersion comes from the live object)."""
        kwargs: dict[str, Any] = {"field_manager": self.FIELD_MANAGER}
        if dry_run:
            kwargs["dry_run"] = "All"
        name = obj["metadata"]["name"]
        service = obj["kind"] == "Service"
        try:
            if service:
                created = await self.core.create_namespaced_service(self.ns, obj, **kwargs)
                out: dict[str, Any] = self.api.sanitize_for_serialization(created)
            else:
                out = await self.custom.create_namespaced_custom_object(
                    *MONITORING, self.ns, "servicemonitors", obj, **kwargs
                )
            return out
        except ApiException as exc:
            if exc.status != 409:
                raise
        live = await self.get(obj["kind"], name)
        body = copy.deepcopy(obj)
        body["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"]
        if service:
            put = await self.core.replace_namespaced_service(name, self.ns, body, **kwargs)
            out = self.api.sanitize_for_serialization(put)
        else:
            out = await self.custom.replace_namespaced_custom_object(
                *MONITORING, self.ns, "servicemonitors", name, body, **kwargs
            )
        return out

    async def put(self, kind: str, name: str, *, dry_run: bool = False) -> dict[str, Any]:
        """One whole PUT of ``kind/name`` as its reconcile sends it (the object exists)."""
        gc = await self.cr()
        assert gc is not None, "no GPUCluster"
        [obj] = [
            o
            for o in self.render(gc, monitors=True)
            if o["kind"] == kind and o["metadata"]["name"] == name
        ]
        return await self.write(obj, dry_run=dry_run)

    async def get(self, kind: str, name: str) -> dict[str, Any]:
        if kind == "Service":
            live = await self.core.read_namespaced_service(name, self.ns)
            out: dict[str, Any] = self.api.sanitize_for_serialization(live)
            return out
        got: dict[str, Any] = await self.custom.get_namespaced_custom_object(
            *MONITORING, self.ns, "servicemonitors", name
        )
        return got

    async def sweep(self, state: str) -> dict[str, int]:
        """``deleteStateRelatedObjects`` as its code reads (facts 3): list Services and
        ServiceMonitors by the state label, delete each by name; ``Kind/name`` -> status."""
        out: dict[str, int] = {}
        selector = f"{STATE_LABEL}={state}"
        services = await self.core.list_namespaced_service(self.ns, label_selector=selector)
        monitors = await self.custom.list_namespaced_custom_object(
            *MONITORING, self.ns, "servicemonitors", label_selector=selector
        )
        for kind, name in [("Service", s.metadata.name) for s in services.items] + [
            ("ServiceMonitor", m["metadata"]["name"]) for m in monitors["items"]
        ]:
            out[f"{kind}/{name}"] = await self.delete(kind, name)
        return out

    async def delete(self, kind: str, name: str, *, dry_run: bool = False) -> int:
        kwargs: dict[str, Any] = {"dry_run": "All"} if dry_run else {}
        try:
            if kind == "Service":
                await self.core.delete_namespaced_service(name, self.ns, **kwargs)
            else:
                await self.custom.delete_namespaced_custom_object(
                    *MONITORING, self.ns, "servicemonitors", name, **kwargs
                )
        except ApiException as exc:
            return int(exc.status)
        return 200

    async def close(self) -> None:
        await self.api.close()


async def guard_effective(
    dry_run_put: Callable[[], Awaitable[dict[str, Any]]], timeout: float = 30.0
) -> None:
    """Waits until the API server applies the guard (policies and webhook configurations
    reach admission through informers): a dry run of gpu-operator's PUT keeps our shape."""

    async def kept() -> bool:
        out = await dry_run_put()
        labels = out["metadata"].get("labels") or {}
        return labels.get("app.kubernetes.io/managed-by") == "shared-svc"

    await eventually(kept, timeout=timeout, interval=0.2)


def shape(svc: dict[str, Any]) -> dict[str, Any]:
    """What shared-svc owns on a Service or a ServiceMonitor, for comparisons."""
    meta = svc["metadata"]
    return {
        "labels": meta.get("labels"),
        "annotations": meta.get("annotations"),
        "ownerReferences": meta.get("ownerReferences"),
        "spec": svc["spec"],
        "resourceVersion": meta["resourceVersion"],
        "uid": meta["uid"],
    }
