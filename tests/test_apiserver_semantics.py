"""The API semantics the reconciler relies on, proven on the real kube-apiserver."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

import testenv
from tests.conftest import UPSTREAM_CRDS
from tests.kube import make_namespace, unique

pytestmark = pytest.mark.apiserver

SSA = "application/apply-patch+yaml"


@pytest.fixture
async def ns(api: ApiClient) -> str:
    return await make_namespace(api, unique("sem"))


async def _make_owner(api: ApiClient, ns: str) -> dict[str, Any]:
    cm = await client.CoreV1Api(api).create_namespaced_config_map(
        ns, {"metadata": {"name": unique("owner")}}
    )
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": cm.metadata.name,
        "uid": cm.metadata.uid,
    }


def _service(name: str, ns: str, **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": ns, **meta},
        "spec": {
            "selector": {"app": name},
            "ports": [{"name": "dcgm", "port": 5555, "protocol": "TCP"}],
        },
    }


async def test_created_service_gets_cluster_ip(api: ApiClient, ns: str) -> None:
    svc = await client.CoreV1Api(api).create_namespaced_service(ns, _service("a", ns))
    assert svc.spec.cluster_ip and svc.spec.cluster_ip.startswith("10.0.0.")
    assert svc.spec.cluster_ips == [svc.spec.cluster_ip]
    # API defaults the reconciler must treat as equal to its intent.
    assert svc.spec.ports[0].target_port == 5555
    assert svc.spec.type == "ClusterIP"
    assert svc.spec.internal_traffic_policy == "Cluster"


async def test_two_controller_owner_references_are_rejected(api: ApiClient, ns: str) -> None:
    o1, o2 = await _make_owner(api, ns), await _make_owner(api, ns)
    body = _service(
        "two-controllers",
        ns,
        ownerReferences=[{**o1, "controller": True}, {**o2, "controller": True}],
    )
    with pytest.raises(ApiException) as err:
        await client.CoreV1Api(api).create_namespaced_service(ns, body)
    assert err.value.status == 422
    assert "Only one reference can have Controller set to true" in err.value.body


async def test_server_side_apply_keeps_cluster_ip_and_drops_unapplied_owner(
    api: ApiClient, ns: str
) -> None:
    core = client.CoreV1Api(api)
    o1, o2 = await _make_owner(api, ns), await _make_owner(api, ns)
    refs = [{**o, "controller": False, "blockOwnerDeletion": False} for o in (o1, o2)]
    first = await core.patch_namespaced_service(
        "ssa",
        ns,
        _service("ssa", ns, ownerReferences=refs),
        field_manager="shared-svc",
        force=True,
        _content_type=SSA,
    )
    cluster_ip = first.spec.cluster_ip
    assert cluster_ip
    assert {r.uid for r in first.metadata.owner_references} == {o1["uid"], o2["uid"]}

    second = await core.patch_namespaced_service(
        "ssa",
        ns,
        _service("ssa", ns, ownerReferences=refs[:1]),
        field_manager="shared-svc",
        force=True,
        _content_type=SSA,
    )
    assert [r.uid for r in second.metadata.owner_references] == [o1["uid"]]
    assert second.spec.cluster_ip == cluster_ip
    assert second.metadata.resource_version != first.metadata.resource_version

    # Applying the same intent again is a no-op: the resourceVersion does not move.
    third = await core.patch_namespaced_service(
        "ssa",
        ns,
        _service("ssa", ns, ownerReferences=refs[:1]),
        field_manager="shared-svc",
        force=True,
        _content_type=SSA,
    )
    assert third.metadata.resource_version == second.metadata.resource_version


async def test_apply_cannot_remove_what_another_manager_owns(api: ApiClient, ns: str) -> None:
    """Why adoption needs a guarded JSON patch: a label set by an Update survives our apply."""
    core = client.CoreV1Api(api)
    await core.create_namespaced_service(
        ns, _service("foreign", ns, labels={"nvidia.com/gpu-operator.state": "state-dcgm"})
    )
    applied = await core.patch_namespaced_service(
        "foreign",
        ns,
        _service("foreign", ns, labels={"app": "foreign"}),
        field_manager="shared-svc",
        force=True,
        _content_type=SSA,
    )
    assert applied.metadata.labels["nvidia.com/gpu-operator.state"] == "state-dcgm"
    patch = [
        {"op": "test", "path": "/metadata/uid", "value": applied.metadata.uid},
        {
            "op": "replace",
            "path": "/metadata/resourceVersion",
            "value": applied.metadata.resource_version,
        },
        {"op": "remove", "path": "/metadata/labels/nvidia.com~1gpu-operator.state"},
    ]
    patched = await core.patch_namespaced_service(
        "foreign", ns, patch, _content_type="application/json-patch+json"
    )
    assert "nvidia.com/gpu-operator.state" not in patched.metadata.labels
    # The same guarded patch with the now stale resourceVersion is refused with 409.
    with pytest.raises(ApiException) as err:
        await core.patch_namespaced_service(
            "foreign", ns, patch[:2], _content_type="application/json-patch+json"
        )
    assert err.value.status == 409


async def test_stale_resource_version_is_a_conflict(api: ApiClient, ns: str) -> None:
    core = client.CoreV1Api(api)
    svc = await core.create_namespaced_service(ns, _service("stale", ns))
    stale_rv = svc.metadata.resource_version
    svc.metadata.labels = {"x": "1"}
    await core.replace_namespaced_service("stale", ns, svc)
    svc.metadata.labels = {"x": "2"}
    svc.metadata.resource_version = stale_rv
    with pytest.raises(ApiException) as err:
        await core.replace_namespaced_service("stale", ns, svc)
    assert err.value.status == 409


async def test_delete_with_preconditions(api: ApiClient, ns: str) -> None:
    core = client.CoreV1Api(api)
    svc = await core.create_namespaced_service(ns, _service("pre", ns))
    wrong = client.V1DeleteOptions(
        preconditions=client.V1Preconditions(uid=svc.metadata.uid, resource_version="1")
    )
    with pytest.raises(ApiException) as err:
        await core.delete_namespaced_service("pre", ns, body=wrong)
    assert err.value.status == 409
    right = client.V1DeleteOptions(
        preconditions=client.V1Preconditions(
            uid=svc.metadata.uid, resource_version=svc.metadata.resource_version
        )
    )
    await core.delete_namespaced_service("pre", ns, body=right)
    with pytest.raises(ApiException) as gone:
        await core.read_namespaced_service("pre", ns)
    assert gone.value.status == 404


async def test_event_through_events_k8s_io_with_series(api: ApiClient, ns: str) -> None:
    events = client.EventsV1Api(api)
    now = dt.datetime.now(dt.UTC)
    body = {
        "metadata": {"name": unique("ev"), "namespace": ns},
        "eventTime": now.isoformat(timespec="microseconds").replace("+00:00", "Z"),
        "action": "Reconcile",
        "reason": "ServiceConfigConflict",
        "note": "spec.type: ClusterPolicy/a wants NodePort, GPUCluster/gpu-cluster wins with ClusterIP",
        "type": "Warning",
        "regarding": {
            "apiVersion": "v1",
            "kind": "Service",
            "name": "nvidia-dcgm-exporter",
            "namespace": ns,
        },
        "reportingController": "nvidia.com/shared-svc",
        "reportingInstance": "shared-svc-0",
    }
    created = await events.create_namespaced_event(ns, body)
    assert created.reason == "ServiceConfigConflict"
    series = {
        "series": {
            "count": 2,
            "lastObservedTime": now.isoformat(timespec="microseconds").replace("+00:00", "Z"),
        }
    }
    patched = await events.patch_namespaced_event(created.metadata.name, ns, series)
    assert patched.series.count == 2


async def test_lease_create_and_renew(api: ApiClient, ns: str) -> None:
    coord = client.CoordinationV1Api(api)
    now = dt.datetime.now(dt.UTC)
    lease = await coord.create_namespaced_lease(
        ns,
        {
            "metadata": {"name": "shared-svc"},
            "spec": {
                "holderIdentity": "a",
                "leaseDurationSeconds": 15,
                "acquireTime": now,
                "renewTime": now,
            },
        },
    )
    later = now + dt.timedelta(seconds=2)
    lease.spec.renew_time = later
    renewed = await coord.replace_namespaced_lease("shared-svc", ns, lease)
    assert renewed.spec.renew_time == later.replace(microsecond=renewed.spec.renew_time.microsecond)
    assert renewed.metadata.resource_version != lease.metadata.resource_version
    # A second holder working from the old version loses: leader election depends on it.
    lease.spec.holder_identity = "b"
    with pytest.raises(ApiException) as err:
        await coord.replace_namespaced_lease("shared-svc", ns, lease)
    assert err.value.status == 409


def _sample_crs() -> list[dict[str, Any]]:
    cp = {
        "apiVersion": "nvidia.com/v1",
        "kind": "ClusterPolicy",
        "metadata": {"name": "cluster-policy"},
        "spec": {
            **{
                k: {}
                for k in (
                    "operator",
                    "driver",
                    "toolkit",
                    "devicePlugin",
                    "gfd",
                    "nodeStatusExporter",
                )
            },
            "daemonsets": {"labels": {}, "annotations": {}, "updateStrategy": "RollingUpdate"},
            "dcgm": {"enabled": True},
            "dcgmExporter": {
                "enabled": True,
                "annotations": {},
                "service": {"type": "ClusterIP", "internalTrafficPolicy": "Cluster"},
                "serviceMonitor": {
                    "enabled": True,
                    "interval": "15s",
                    "scrapeTimeout": "10s",
                    "honorLabels": False,
                    "additionalLabels": {"release": "prom"},
                    "relabelings": [],
                },
            },
        },
    }
    gc = {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "GPUCluster",
        "metadata": {"name": "gpu-cluster"},
        "spec": {
            "draDriver": {},
            "daemonsets": {"labels": {}, "annotations": {}},
            "dcgm": {"enabled": False},
            "dcgmExporter": {
                "enabled": True,
                "service": {"type": "ClusterIP", "internalTrafficPolicy": "Cluster"},
                "serviceMonitor": {
                    "enabled": True,
                    "interval": "15s",
                    "honorLabels": False,
                    "additionalLabels": {},
                },
            },
        },
    }
    return [cp, gc]


def _check_crs_pass(cp: testenv.ControlPlane) -> None:
    for doc in _sample_crs():
        status, resp = cp.request(
            "POST",
            f"/apis/{doc['apiVersion']}/{doc['kind'].lower()}s".replace(
                "clusterpolicys", "clusterpolicies"
            ),
            doc,
        )
        assert status == 201, resp
    bad = {**_sample_crs()[1], "metadata": {"name": "not-gpu-cluster"}}
    status, resp = cp.request("POST", "/apis/nvidia.com/v1alpha1/gpuclusters", bad)
    assert status == 422, resp
    assert "GPUCluster is a singleton" in str(resp)
    bad_type = {**_sample_crs()[0], "metadata": {"name": "bad"}}
    bad_type["spec"] = {**bad_type["spec"], "dcgm": {"enabled": "yes"}}
    status, resp = cp.request("POST", "/apis/nvidia.com/v1/clusterpolicies", bad_type)
    assert status == 422, resp


def test_project_crds_accept_samples_and_enforce_singleton() -> None:
    with testenv.running() as cp:
        _check_crs_pass(cp)
        # ServiceMonitor is served from the project's CRD.
        status, res = cp.request("GET", "/apis/monitoring.coreos.com/v1")
        assert status == 200 and any(r["kind"] == "ServiceMonitor" for r in res["resources"])


def test_upstream_crds_accept_samples_and_enforce_singleton() -> None:
    assert UPSTREAM_CRDS.is_dir(), f"{UPSTREAM_CRDS} missing"
    with testenv.running(crds=False, upstream_crds=UPSTREAM_CRDS) as cp:
        _check_crs_pass(cp)


# The upgrade flow's gate (shared_svc.upgrade.gate): ClusterPolicy only.
CLUSTER_POLICY_PATHS = {
    ("driver", "upgradePolicy", "autoUpgrade"): "boolean",
    ("driver", "upgradePolicy", "waitForCompletion", "podSelector"): "string",
    ("driver", "upgradePolicy", "waitForCompletion", "timeoutSeconds"): "integer",
    ("driver", "useNvidiaDriverCRD"): "boolean",
    ("sandboxWorkloads", "enabled"): "boolean",
}


def test_project_crds_cover_the_upstream_fields_we_read() -> None:
    """Every field path shared-svc reads exists with the same type in the upstream schema."""
    paths = {
        ("dcgm", "enabled"): "boolean",
        ("dcgmExporter", "enabled"): "boolean",
        ("dcgmExporter", "service", "type"): "string",
        ("dcgmExporter", "service", "internalTrafficPolicy"): "string",
        ("dcgmExporter", "serviceMonitor", "enabled"): "boolean",
        ("dcgmExporter", "serviceMonitor", "interval"): "string",
        ("dcgmExporter", "serviceMonitor", "scrapeTimeout"): "string",
        ("dcgmExporter", "serviceMonitor", "honorLabels"): "boolean",
        ("dcgmExporter", "serviceMonitor", "additionalLabels"): "object",
        ("dcgmExporter", "serviceMonitor", "relabelings"): "array",
    }
    for fname in ("nvidia.com_clusterpolicies.yaml", "nvidia.com_gpuclusters.yaml"):
        ours = yaml.safe_load((testenv.PROJECT_CRDS / fname).read_text())
        theirs = yaml.safe_load((UPSTREAM_CRDS / fname).read_text())
        for crd in (ours, theirs):
            spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
            only_cp = CLUSTER_POLICY_PATHS if fname.startswith("nvidia.com_clusterpolicies") else {}
            for path, typ in {**paths, **only_cp}.items():
                node = spec
                for part in path:
                    node = node["properties"][part]
                assert node["type"] == typ, (fname, path)
        assert ours["spec"]["scope"] == theirs["spec"]["scope"] == "Cluster"
        assert sorted(
            ours["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"].get(
                "required", []
            )
        ) == sorted(
            theirs["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"].get(
                "required", []
            )
        )


def test_build_is_cached() -> None:
    """A second build of unchanged inputs returns the same directory without compiling."""
    first = testenv.build_binaries()
    second = testenv.build_binaries()
    assert first == second
    assert (Path(first) / "kube-apiserver").exists() and (Path(first) / "etcd").exists()
