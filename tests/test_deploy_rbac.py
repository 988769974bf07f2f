"""The chart on the real API server (``--authorization-mode=RBAC``).

The rendered manifests pass server-side dry-run; the service, authenticated as the
chart's ServiceAccount (a real token from TokenRequest) and holding exactly the chart's
RBAC, converges the Services, writes its Events and leads through its Lease; the same
identity gets 403 for everything else; the driver-upgrade permissions exist only when
the value turns the controller on.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from shared_svc.config import Config
from shared_svc.controllers import shared_caches
from shared_svc.controllers.upgrade.caches import UpgradeCaches
from shared_svc.controllers.upgrade.io import KubeUpgradeIO, upgrade_write_limiter
from shared_svc.k8s.objects import name_of
from shared_svc.kube.writer import Writer
from shared_svc.upgrade.daemonsets import parked_label_key
from shared_svc.upgrade.node_plan import NodePatch, PodAction
from shared_svc.upgrade.states import state_label_key
from testenv import ControlPlane
from tests.kube import api_client, eventually, make_namespace, unique
from tests.parts import managed
from tests.svc import (
    Kube,
    cp_body,
    gc_body,
    running,
    service_config,
    service_monitor_gone,
    settle,
)
from tests.test_deploy_chart import (
    ALL_CONVENTIONS,
    MANIFESTS,
    PLAIN,
    UPGRADE_ON,
    Doc,
    rbac_docs,
    render_docs,
)

pytestmark = pytest.mark.apiserver

# kind -> (plural, namespaced) for every kind the chart renders
KINDS = {
    "ServiceAccount": ("serviceaccounts", True),
    "Role": ("roles", True),
    "RoleBinding": ("rolebindings", True),
    "ClusterRole": ("clusterroles", False),
    "ClusterRoleBinding": ("clusterrolebindings", False),
    "Deployment": ("deployments", True),
    "Service": ("services", True),
    "Pod": ("pods", True),  # the helm test hook
    "PodDisruptionBudget": ("poddisruptionbudgets", True),
    "ServiceMonitor": ("servicemonitors", True),
    "MutatingAdmissionPolicy": ("mutatingadmissionpolicies", False),
    "MutatingAdmissionPolicyBinding": ("mutatingadmissionpolicybindings", False),
    "MutatingWebhookConfiguration": ("mutatingwebhookconfigurations", False),
    "ValidatingWebhookConfiguration": ("validatingwebhookconfigurations", False),
    "Job": ("jobs", True),
    "NetworkPolicy": ("networkpolicies", True),
    "ConfigMap": ("configmaps", True),
}
DRIVER = "rbactest"  # a driver name of its own: no other test's upgrade controller sees these nodes


def object_path(doc: Doc) -> str:
    plural, namespaced = KINDS[doc["kind"]]
    api_version = doc["apiVersion"]
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    meta = doc["metadata"]
    where = f"/namespaces/{meta['namespace']}" if namespaced else ""
    return f"{base}{where}/{plural}/{meta['name']}"


def dry_run_apply(cp: ControlPlane, docs: list[Doc]) -> dict[str, tuple[int, Any]]:
    """Server-side apply with dryRun=All and strict field validation: (kind/name) -> answer."""
    answers = {}
    for doc in docs:
        status, body = cp.request(
            "PATCH",
            object_path(doc)
            + "?fieldManager=shared-svc-test&dryRun=All&fieldValidation=Strict&force=true",
            json.dumps(doc),
            content_type="application/apply-patch+yaml",
        )
        answers[f"{doc['kind']}/{doc['metadata']['name']}"] = (status, body)
    return answers


@dataclass
class Identity:
    namespace: str
    release: str
    kubeconfig: Path


def install_identity(cp: ControlPlane, directory: Path, *sets: str) -> Identity:
    """Applies the chart's RBAC objects (rendered for a namespace of their own) and returns
    a kubeconfig with a real token of the chart's ServiceAccount."""
    namespace = unique("rbac")
    release = f"shared-svc-{namespace}"
    cp.ensure_namespace(namespace)
    cp.apply_manifests(rbac_docs(render_docs(*sets, name=release, namespace=namespace)))
    token = cp.service_account_token(namespace, release)
    return Identity(
        namespace, release, cp.write_kubeconfig(directory / f"{release}.kubeconfig", token)
    )


def remove_cluster_objects(cp: ControlPlane, identity: Identity) -> None:
    for plural in ("clusterrolebindings", "clusterroles"):
        for name in (identity.release, f"{identity.release}-upgrade"):
            cp.request("DELETE", f"/apis/rbac.authorization.k8s.io/v1/{plural}/{name}")


async def status_of(call: Awaitable[Any]) -> int:
    """200 when the call succeeds, else the API server's status code."""
    try:
        await call
    except ApiException as exc:
        return int(exc.status)
    return 200


@pytest.fixture
def identity(control_plane: ControlPlane, tmp_path: Path) -> Any:
    ident = install_identity(control_plane, tmp_path)
    yield ident
    remove_cluster_objects(control_plane, ident)


async def as_identity(cp: ControlPlane, ident: Identity) -> ApiClient:
    api = await api_client(cp, str(ident.kubeconfig))
    # RBAC objects reach the authorizer through its informers: wait until the grant is seen.
    services = client.CoreV1Api(api)
    await eventually(lambda: _ok(services.list_namespaced_service(ident.namespace)), timeout=15)
    return api


async def _ok(call: Awaitable[Any]) -> bool:
    return await status_of(call) == 200


# --- the manifests are valid Kubernetes objects ---
def test_rendered_manifests_pass_server_side_dry_run(control_plane: ControlPlane) -> None:
    import yaml

    control_plane.ensure_namespace("gpu-operator")
    control_plane.ensure_namespace("nvidia-gpu")  # namespaceOverride of ALL_CONVENTIONS
    control_plane.ensure_namespace("monitoring")  # its grafanaDashboard.namespace
    sets = [
        *[
            (
                f"deploy/manifests/{name}",
                [d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d],
            )
            for name in PLAIN
        ],
        (
            "chart with serviceMonitor.enabled",
            render_docs("serviceMonitor.enabled=true", *UPGRADE_ON),
        ),
        (
            # every convention value (the test control plane has no PrometheusRule CRD)
            "chart with every convention value",
            [
                d
                for d in render_docs(*ALL_CONVENTIONS, *UPGRADE_ON)
                if d["kind"] != "PrometheusRule"
            ],
        ),
    ]
    for label, docs in sets:
        answers = dry_run_apply(control_plane, docs)
        bad = {k: v for k, v in answers.items() if v[0] not in (200, 201)}
        assert not bad, f"{label}: {bad}"
        assert len(answers) == len(docs) >= 10
    # Dry run means nothing was stored.
    assert (
        control_plane.request(
            "GET", "/apis/apps/v1/namespaces/gpu-operator/deployments/shared-svc"
        )[0]
        == 404
    )
    # ...and the check can fail: a Deployment whose selector misses its pods is refused.
    deployment = next(d for d in sets[0][1] if d["kind"] == "Deployment")
    broken = json.loads(json.dumps(deployment))
    broken["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] = "other"
    ((status, body),) = dry_run_apply(control_plane, [broken]).values()
    assert status == 422 and "does not match template" in json.dumps(body)


# --- the service with exactly the chart's permissions ---
@pytest.mark.usefixtures("kube")  # no ClusterPolicy/GPUCluster before or after
async def test_service_converges_and_reports_as_its_service_account(
    control_plane: ControlPlane, api: ApiClient, identity: Identity
) -> None:
    ns = identity.namespace
    kube = Kube(api, ns)  # admin view of the chart's namespace
    pod_name = f"{identity.release}-0"
    probe = await as_identity(control_plane, identity)
    await probe.close()
    config = service_config(
        control_plane,
        ns,
        kubeconfig=str(identity.kubeconfig),
        leader_election=True,
        pod_name=pod_name,
    )
    async with running(config) as svc:
        cp = await kube.create_cr(cp_body())
        await settle(svc)
        assert set(await kube.services()) == {"nvidia-dcgm", "nvidia-dcgm-exporter"}
        created = await kube.events_for("ServiceCreated")
        assert {(e["regarding"]["name"], e["reportingInstance"]) for e in created} == {
            ("nvidia-dcgm", pod_name),
            ("nvidia-dcgm-exporter", pod_name),
        }
        lease = await client.CoordinationV1Api(kube.api).read_namespaced_lease("shared-svc", ns)
        assert lease.spec.holder_identity == pod_name and svc.is_leader()

        # A GPUCluster with a ServiceMonitor: Services re-owned (patch), a ServiceMonitor created.
        monitor = {"enabled": True, "serviceMonitor": {"enabled": True}}
        gc = await kube.create_cr(gc_body(dcgmExporter=monitor))
        await settle(svc)
        assert await kube.service_monitor("nvidia-dcgm-exporter") is not None
        assert "nvidia-dcgm-exporter-dra" in await kube.services()

        # An Event about a cluster-scoped object goes to `default`.
        await kube.patch_cr(
            "GPUCluster", "gpu-cluster", {"spec": {"dcgmExporter": {"service": {"type": "Bogus"}}}}
        )
        await settle(svc)
        invalid = await kube.events_for("InvalidSpec", namespace="default")
        assert [
            e["regarding"]["kind"]
            for e in invalid
            if e["regarding"]["uid"] == gc["metadata"]["uid"]
        ] == ["GPUCluster"]

        # Deletes: with no CR left, every Service and the ServiceMonitor go.
        await kube.delete_cr("ClusterPolicy", cp["metadata"]["name"])
        await kube.delete_cr("GPUCluster", "gpu-cluster")
        await settle(svc)
        assert await kube.services() == {}
        await service_monitor_gone(kube, "nvidia-dcgm-exporter")  # drained first

        assert svc.recorder is not None and svc.recorder.failures == 0, "every Event was written"
        assert svc.elector is not None and svc.elector.last_error is None
        assert svc.controller is not None
        errors = {
            name: c["lastError"]
            for name, c in svc.controller.cache_status().items()
            if c["lastError"]
        }
        assert not errors
        # It reads which admission guard is active (list only; nothing installed here).
        guard = svc.status()["admissionGuard"]
        assert guard["checkedAt"] and guard["errors"] == {} and guard["mode"] == "none"
    released = await client.CoordinationV1Api(kube.api).read_namespaced_lease("shared-svc", ns)
    assert not released.spec.holder_identity, "the Lease is released on shutdown"


def _service(name: str, namespace: str | None = None) -> Doc:
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {"ports": [{"name": "x", "port": 80}]},
    }


def _monitor(name: str, namespace: str | None = None) -> Doc:
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": meta,
        "spec": {"selector": {"matchLabels": {"app": name}}, "endpoints": [{"port": "x"}]},
    }


async def test_service_account_is_denied_everything_else(
    control_plane: ControlPlane, kube: Kube, identity: Identity
) -> None:
    ns = identity.namespace
    other = await make_namespace(kube.api, unique("rbac-other"))
    api = await as_identity(control_plane, identity)
    try:
        core = client.CoreV1Api(api)
        custom = client.CustomObjectsApi(api)
        rbac = client.RbacAuthorizationV1Api(api)
        service = {"metadata": {"name": "intruder"}, "spec": {"ports": [{"port": 80}]}}
        event = {
            "metadata": {"name": "x"},
            "eventTime": "2026-01-01T00:00:00.000000Z",
            "reason": "X",
            "action": "X",
            "reportingController": "x",
            "reportingInstance": "x",
            "type": "Normal",
        }
        calls = {
            "list Secrets in its namespace": core.list_namespaced_secret(ns),
            "read a Secret in its namespace": core.read_namespaced_secret("any", ns),
            "create a Service in another namespace": core.create_namespaced_service(other, service),
            "delete a Service in another namespace": core.delete_namespaced_service(
                "nvidia-dcgm", other
            ),
            "create an Event in another namespace": client.EventsV1Api(api).create_namespaced_event(
                other, event
            ),
            "create a Namespace": core.create_namespace({"metadata": {"name": unique("nope")}}),
            "patch a ClusterPolicy": custom.patch_cluster_custom_object(
                "nvidia.com",
                "v1",
                "clusterpolicies",
                "cluster-policy",
                {"metadata": {"labels": {"x": "y"}}},
                _content_type="application/merge-patch+json",
            ),
            "create a ClusterRole": rbac.create_cluster_role(
                {"metadata": {"name": unique("nope")}, "rules": []}
            ),
            "read another CRD": client.ApiextensionsV1Api(api).read_custom_resource_definition(
                "nodes.example.com"
            ),
            "list Nodes (upgrade controller off)": core.list_node(),
            "create a MutatingWebhookConfiguration (the chart installs the guard)": client.AdmissionregistrationV1Api(
                api
            ).create_mutating_webhook_configuration({"metadata": {"name": unique("nope")}}),
            "delete Pods in its namespace (upgrade controller off)": core.delete_collection_namespaced_pod(
                ns
            ),
            "update a Lease of another name": client.CoordinationV1Api(
                api
            ).replace_namespaced_lease(
                "other-lease", ns, {"metadata": {"name": "other-lease"}, "spec": {}}
            ),
        }
        answers = {what: await status_of(call) for what, call in calls.items()}
        assert answers == dict.fromkeys(calls, 403)

        # In its own namespace it writes only under the contract's names, with the calls the
        # service makes (shared_svc.kube.writer): objects of other names are refused.
        for path, body in (
            (f"/api/v1/namespaces/{ns}/services", _service("other-svc")),
            (
                f"/apis/monitoring.coreos.com/v1/namespaces/{ns}/servicemonitors",
                _monitor("other-sm"),
            ),
        ):
            status, resp = control_plane.request("POST", path, body)
            assert status == 201, resp
        writer = Writer(api)
        label = [{"op": "add", "path": "/metadata/labels", "value": {"x": "y"}}]
        own = {
            "apply (create) a Service of another name": writer.apply(_service("intruder", ns)),
            "apply a Service of another name": writer.apply(_service("other-svc", ns)),
            "patch a Service of another name": writer.json_patch("Service", ns, "other-svc", label),
            "delete a Service of another name": writer.delete("Service", ns, "other-svc", {}),
            "create a Service by POST, even of our name": core.create_namespaced_service(
                ns, _service("nvidia-dcgm")
            ),
            "apply (create) a ServiceMonitor of another name": writer.apply(
                _monitor("intruder", ns)
            ),
            "apply a ServiceMonitor of another name": writer.apply(_monitor("other-sm", ns)),
            "patch a ServiceMonitor of another name": writer.json_patch(
                "ServiceMonitor", ns, "other-sm", label
            ),
            "delete a ServiceMonitor of another name": writer.delete(
                "ServiceMonitor", ns, "other-sm", {}
            ),
        }
        answers = {what: await status_of(call) for what, call in own.items()}
        assert answers == dict.fromkeys(own, 403)
        # ...while our names work: an apply that creates (PATCH; create is checked on the
        # name), a patch, and a delete with preconditions.
        for kind, obj in (
            ("Service", _service("nvidia-dcgm-dra", ns)),
            ("ServiceMonitor", _monitor("nvidia-dcgm-exporter", ns)),
        ):
            created = await writer.apply(obj)
            await writer.json_patch(kind, ns, obj["metadata"]["name"], label)
            await writer.delete(
                kind, ns, obj["metadata"]["name"], {"uid": created["metadata"]["uid"]}
            )
        assert (
            control_plane.request("GET", f"/api/v1/namespaces/{ns}/services/nvidia-dcgm-dra")[0]
            == 404
        )
        # The grant itself is there (the 403s are not an identity that can do nothing).
        assert (
            await status_of(
                custom.list_cluster_custom_object("nvidia.com", "v1", "clusterpolicies")
            )
            == 200
        )
    finally:
        await api.close()


# --- the driver-upgrade permissions follow the value ---
async def test_upgrade_permissions_exist_only_when_the_controller_is_on(
    control_plane: ControlPlane, kube: Kube, tmp_path: Path
) -> None:
    ident = install_identity(control_plane, tmp_path)
    node = unique("rbac-node")
    core = client.CoreV1Api(kube.api)
    await core.create_node(
        {"metadata": {"name": node, "labels": {state_label_key(DRIVER): "pod-restart-required"}}}
    )
    ns = ident.namespace
    pods = []
    for i in range(2):
        body = {
            "metadata": {"name": f"consumer-{i}"},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x"}]},
        }
        pods.append(await core.create_namespaced_pod(ns, body))
    actions = [
        PodAction(verb, ns, p.metadata.name, p.metadata.uid, "test")
        for verb, p in zip(("evict", "delete"), pods, strict=True)
    ]
    patch = NodePatch(
        node=node, resource_version=None, labels=((parked_label_key(DRIVER), "true"),)
    )
    api = await as_identity(control_plane, ident)
    try:
        io = KubeUpgradeIO(api, DRIVER, write_limiter=upgrade_write_limiter(Config()))
        off = {
            "pods on node": io.pods_on_node(node),
            "patch node": io.patch_node(patch),
            "evict": io.evict(actions[0]),
            "delete pod": io.delete_pod(actions[1]),
            "list nodes": client.CoreV1Api(api).list_node(),
            "list daemonsets": client.AppsV1Api(api).list_daemon_set_for_all_namespaces(),
        }
        assert {k: await status_of(c) for k, c in off.items()} == dict.fromkeys(off, 403)

        # The same release with controllers.upgrade=true: the calls of shared_svc.controllers.upgrade.io work.
        control_plane.apply_manifests(
            rbac_docs(render_docs(*UPGRADE_ON, name=ident.release, namespace=ns))
        )
        await eventually(lambda: _ok(client.CoreV1Api(api).list_node()), timeout=15)
        assert {p["metadata"]["name"] for p in await io.pods_on_node(node)} == {
            "consumer-0",
            "consumer-1",
        }
        await io.patch_node(patch)
        assert (await core.read_node(node)).metadata.labels[parked_label_key(DRIVER)] == "true"
        assert await io.evict(actions[0]) == "evicted"
        # Deleting a pod (after the eviction timeout) is granted only with deleteAfterTimeout.
        assert await status_of(io.delete_pod(actions[1])) == 403
        control_plane.apply_manifests(
            rbac_docs(
                render_docs(
                    *UPGRADE_ON, "upgrade.deleteAfterTimeout=true", name=ident.release, namespace=ns
                )
            )
        )
        await eventually(lambda: _true_async(io.delete_pod(actions[1]), "evicted"), timeout=15)
        registry = shared_caches.registry(api, Config(upgrade_controller=True))
        caches = UpgradeCaches.of(registry, DRIVER)
        async with managed(registry.runnables()):
            await eventually(lambda: _true(all(c.synced.is_set() for c in caches.all())), 15)
            assert {name_of(n) for n in caches.cached_nodes()} == {node}
            assert all(c.last_error is None for c in caches.all())
        # Still nothing beyond the grant: no node writes other than patch, no pods outside
        # list/delete, and no GET of a node (the controller reads nodes from its cache).
        assert await status_of(client.CoreV1Api(api).delete_node(node)) == 403
        assert await status_of(client.CoreV1Api(api).read_node(node)) == 403
        assert await status_of(client.CoreV1Api(api).read_namespaced_pod("consumer-0", ns)) == 403
    finally:
        await api.close()
        await core.delete_node(node)
        remove_cluster_objects(control_plane, ident)


async def _true(value: bool) -> bool:
    return value


async def _true_async(call: Awaitable[Any], expected: Any) -> bool:
    """The call answers ``expected`` (False while the authorizer still says 403)."""
    try:
        return await call == expected
    except ApiException as exc:
        if exc.status == 403:
            return False
        raise


# --- issue 14: the upgrade controller alone reads the ClusterPolicy, never writes it ---
async def test_upgrade_controller_alone_reads_cluster_policies_and_cannot_write_them(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    ident = install_identity(control_plane, tmp_path, "controllers.services=false", *UPGRADE_ON)
    api = await api_client(control_plane, str(ident.kubeconfig))
    try:
        await eventually(lambda: _ok(client.CoreV1Api(api).list_node()), timeout=15)
        custom = client.CustomObjectsApi(api)
        # The upgrade controller's caches (shared_svc.controllers.upgrade.caches) sync: the
        # gate's ClusterPolicies are listed and watched with the upgrade controller's own
        # grant (no Services controller here).
        registry = shared_caches.registry(api, Config(upgrade_controller=True))
        caches = UpgradeCaches.of(registry, DRIVER)
        async with managed(registry.runnables()):
            await eventually(lambda: _true(all(c.synced.is_set() for c in caches.all())), 15)
            assert all(c.last_error is None for c in caches.all())
        assert (
            await status_of(
                custom.list_cluster_custom_object("nvidia.com", "v1", "clusterpolicies")
            )
            == 200
        )
        # ...and never writes one: `upgrade configure-gate` is the admin's, with their kubeconfig.
        gate = {
            "spec": {"driver": {"upgradePolicy": {"waitForCompletion": {"podSelector": "a=b"}}}}
        }
        writes = {
            "patch": custom.patch_cluster_custom_object(
                "nvidia.com",
                "v1",
                "clusterpolicies",
                "cluster-policy",
                gate,
                _content_type="application/merge-patch+json",
            ),
            "update": custom.replace_cluster_custom_object(
                "nvidia.com",
                "v1",
                "clusterpolicies",
                "cluster-policy",
                {
                    "apiVersion": "nvidia.com/v1",
                    "kind": "ClusterPolicy",
                    "metadata": {"name": "cluster-policy"},
                    "spec": {},
                },
            ),
            "create": custom.create_cluster_custom_object(
                "nvidia.com",
                "v1",
                "clusterpolicies",
                {
                    "apiVersion": "nvidia.com/v1",
                    "kind": "ClusterPolicy",
                    "metadata": {"name": unique("cp")},
                    "spec": {},
                },
            ),
        }
        assert {k: await status_of(c) for k, c in writes.items()} == dict.fromkeys(writes, 403)
    finally:
        await api.close()
        remove_cluster_objects(control_plane, ident)
