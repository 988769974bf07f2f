"""The real garbage collector and EndpointSlice controller (kube-controller-manager) beside
shared-svc: no per-node endpoint gap on ``nvidia-dcgm`` (the name the hold applies to)
through the rollout gate, a rollback and both migrations, and both stable names on every node
at the end; and the owner-reference contract as the collector acts on it.

This module runs its own control plane with kube-controller-manager (the collector would
otherwise act on every other test's objects). Tests play the kubelet (tests/kubelet.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

import testenv
from shared_svc.service import Service
from tests.endpoints import Timeline, recorded
from tests.kube import eventually
from tests.kubelet import Kubelet
from tests.svc import Kube, apiserver_write_count, cp_body, gc_body, settle

pytestmark = [pytest.mark.apiserver, pytest.mark.controller_manager]

NODES = ("node-a", "node-b")
DCGM_APPS = {
    "ClusterPolicy": ("nvidia-dcgm", "nvidia-dcgm-exporter"),
    "GPUCluster": ("nvidia-dcgm-dra", "nvidia-dcgm-exporter-dra"),
}
START_DELAY = 2.0  # seconds between a CR appearing and its pods being Ready


async def start_stack(
    kk: Kube, kubelet: Kubelet, kind: str, *, common: bool, suffix: str = ""
) -> None:
    """The stack's DaemonSets (rolled out) and one Ready pod per node of each."""
    for app in DCGM_APPS[kind]:
        await kk.daemonset(app, common=common, desired=len(NODES))
        for node in NODES:
            await kubelet.run(f"{app}-{node}{suffix}", app, node, common=common)


async def stop_stack(kubelet: Kubelet, kind: str, suffix: str = "") -> None:
    for app in DCGM_APPS[kind]:
        for node in NODES:
            await kubelet.gone(f"{app}-{node}{suffix}")


async def endpoints_on_every_node(kk: Kube, kapi: ApiClient) -> bool:
    slices = await client.DiscoveryV1Api(kapi).list_namespaced_endpoint_slice(kk.ns)
    for service in ("nvidia-dcgm", "nvidia-dcgm-exporter"):
        nodes = {
            ep.node_name
            for s in slices.items
            if (s.metadata.labels or {}).get("kubernetes.io/service-name") == service
            for ep in s.endpoints or []
            if ep.conditions and ep.conditions.ready
        }
        if nodes != set(NODES):
            return False
    return True


def no_gaps(timeline: Timeline) -> None:
    gaps = timeline.gaps()
    assert not gaps, "\n".join(str(g) for g in gaps[:10])


async def test_gpu_cluster_to_cluster_policy_keeps_an_endpoint_on_every_node(
    kk: Kube, kapi: ApiClient, svc: Service
) -> None:
    kubelet = Kubelet(kapi, kk.ns)
    await kk.create_cr(gc_body())
    await start_stack(kk, kubelet, "GPUCluster", common=False)
    await settle(svc)
    await eventually(lambda: endpoints_on_every_node(kk, kapi))
    async with recorded(kapi, kk.ns) as timeline:
        await kk.create_cr(cp_body())
        await settle(svc)
        # The ClusterPolicy exists, its pods do not run yet: the stable names are held.
        dcgm = await kk.service("nvidia-dcgm")
        assert dcgm is not None and dcgm["spec"]["selector"] == {"app": "nvidia-dcgm-dra"}
        pending = [p.reason for p in svc.controller.last_plan.pending]  # type: ignore[union-attr]
        assert "SelectorMigrationPending" in pending
        await asyncio.sleep(START_DELAY)
        await start_stack(kk, kubelet, "ClusterPolicy", common=False)
        await settle(svc)
        dcgm = await kk.service("nvidia-dcgm")
        assert dcgm is not None and dcgm["spec"]["selector"] == {"app": "nvidia-dcgm"}
        await kk.delete_cr("GPUCluster", "gpu-cluster")
        await settle(svc)
        await stop_stack(kubelet, "GPUCluster")
        await settle(svc)
        await eventually(lambda: endpoints_on_every_node(kk, kapi))
    no_gaps(timeline)


async def test_cluster_policy_to_gpu_cluster_keeps_an_endpoint_on_every_node(
    kk: Kube, kapi: ApiClient, svc: Service
) -> None:
    kubelet = Kubelet(kapi, kk.ns)
    await kk.create_cr(cp_body())
    await start_stack(kk, kubelet, "ClusterPolicy", common=False)
    await settle(svc)
    await eventually(lambda: endpoints_on_every_node(kk, kapi))
    async with recorded(kapi, kk.ns) as timeline:
        await kk.create_cr(gc_body())
        await settle(svc)
        # The ClusterPolicy goes before the DRA pods are ready: the stable names keep the
        # legacy pods until the DRA pods cover every node.
        await kk.delete_cr("ClusterPolicy", "cluster-policy")
        await settle(svc)
        dcgm = await kk.service("nvidia-dcgm")
        assert dcgm is not None and dcgm["spec"]["selector"] == {"app": "nvidia-dcgm"}
        await asyncio.sleep(START_DELAY)
        await start_stack(kk, kubelet, "GPUCluster", common=False)
        await settle(svc)
        dcgm = await kk.service("nvidia-dcgm")
        assert dcgm is not None and dcgm["spec"]["selector"] == {"app": "nvidia-dcgm-dra"}
        await stop_stack(kubelet, "ClusterPolicy")
        await settle(svc)
        await eventually(lambda: endpoints_on_every_node(kk, kapi))
    no_gaps(timeline)


async def test_rollout_gate_and_rollback_keep_an_endpoint_on_every_node(
    kk: Kube, kapi: ApiClient, svc: Service
) -> None:
    kubelet = Kubelet(kapi, kk.ns)
    await kk.create_cr(cp_body())
    await start_stack(kk, kubelet, "ClusterPolicy", common=False)
    await settle(svc)
    await eventually(lambda: endpoints_on_every_node(kk, kapi))
    async with recorded(kapi, kk.ns) as timeline:
        # Roll out, node by node: the new pod starts beside the old one, then the old goes.
        for generation, common in ((1, True), (2, False)):
            for app in DCGM_APPS["ClusterPolicy"]:
                await kk.daemonset(app, common=common, desired=len(NODES), updated=0)
            # shared-svc sees the new template within milliseconds; a DaemonSet controller
            # with maxSurge takes seconds (a new pod must start and turn Ready) before it
            # deletes an old one.
            await settle(svc)
            for node in NODES:
                for app in DCGM_APPS["ClusterPolicy"]:
                    await kubelet.run(f"{app}-{node}-g{generation}", app, node, common=common)
                    old = f"{app}-{node}" + (f"-g{generation - 1}" if generation > 1 else "")
                    await kubelet.gone(old)
                await settle(svc)
            for app in DCGM_APPS["ClusterPolicy"]:
                await kk.daemonset(app, common=common, desired=len(NODES))
            await settle(svc)
            dcgm = await kk.service("nvidia-dcgm")
            expected = (
                {"nvidia.com/gpu-operator.dcgm": "true"} if common else {"app": "nvidia-dcgm"}
            )
            assert dcgm is not None and dcgm["spec"]["selector"] == expected
        await eventually(lambda: endpoints_on_every_node(kk, kapi))
    no_gaps(timeline)


# ---------------------------------------------------------------- the garbage collector


async def uid_and_ip(kk: Kube, name: str) -> tuple[str, str] | None:
    s = await kk.service(name)
    return (s["metadata"]["uid"], s["spec"]["clusterIP"]) if s else None


@pytest.mark.parametrize("propagation", ["Background", "Foreground", "Orphan"])
async def test_cluster_policy_deleted_while_a_gpu_cluster_needs_the_services(
    kcm_plane: testenv.ControlPlane, kk: Kube, svc: Service, propagation: str
) -> None:
    await kk.create_cr(cp_body())
    await asyncio.sleep(1.1)
    await kk.create_cr(gc_body())
    await settle(svc)
    before = {n: await uid_and_ip(kk, n) for n in ("nvidia-dcgm", "nvidia-dcgm-exporter")}
    writes = apiserver_write_count(kcm_plane, ("services",))
    await kk.custom.delete_cluster_custom_object(
        "nvidia.com", "v1", "clusterpolicies", "cluster-policy", propagation_policy=propagation
    )

    async def cp_gone() -> bool:
        items = (await kk.custom.list_cluster_custom_object("nvidia.com", "v1", "clusterpolicies"))[
            "items"
        ]
        return not items

    await eventually(cp_gone)
    await settle(svc)
    after = {n: await uid_and_ip(kk, n) for n in before}
    assert after == before  # same objects, same clusterIPs
    for name in before:
        s = await kk.service(name)
        assert s is not None
        assert [r["kind"] for r in s["metadata"]["ownerReferences"]] == ["GPUCluster"]
    # The collector and shared-svc may each remove the reference: bounded, then quiet.
    assert apiserver_write_count(kcm_plane, ("services",)) - writes <= 8
    quiet = apiserver_write_count(kcm_plane, ("services",))
    await asyncio.sleep(2)
    assert apiserver_write_count(kcm_plane, ("services",)) == quiet
    assert not await kk.events_for("ConflictingWriter")


async def test_both_crs_deleted_the_services_go(kk: Kube, svc: Service) -> None:
    await kk.create_cr(cp_body())
    await kk.create_cr(gc_body())
    await settle(svc)
    await kk.delete_cr("ClusterPolicy", "cluster-policy")
    await kk.delete_cr("GPUCluster", "gpu-cluster")

    async def none_left() -> bool:
        return not await kk.services()

    await eventually(none_left)
    await settle(svc)
    assert svc.controller is not None and svc.controller.last_reconcile["result"] == "success"


async def test_a_foreign_owner_keeps_the_service(kk: Kube, svc: Service) -> None:
    await kk.create_cr(cp_body())
    await settle(svc)
    keeper = await kk.core.create_namespaced_config_map(kk.ns, {"metadata": {"name": "keeper"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "keeper", "uid": keeper.metadata.uid}
    await kk.core.patch_namespaced_service(
        "nvidia-dcgm",
        kk.ns,
        [{"op": "add", "path": "/metadata/ownerReferences/-", "value": ref}],
        _content_type="application/json-patch+json",
    )
    await kk.delete_cr("ClusterPolicy", "cluster-policy")
    await settle(svc)
    await asyncio.sleep(1)  # the collector has had its look
    kept = await kk.service("nvidia-dcgm")
    assert kept is not None
    assert [r["kind"] for r in kept["metadata"]["ownerReferences"]] == ["ConfigMap"]
    assert await kk.service("nvidia-dcgm-exporter") is None


async def test_a_cr_recreated_at_once_ends_with_services_owned_by_the_new_cr(
    kk: Kube, svc: Service
) -> None:
    # The owner-reference contract (docs/operations.md): the Services' only owner is gone.
    # Either the collector deletes them first (the usual case) and shared-svc creates them
    # anew for the new CR, or shared-svc moves the references to the new CR first and the
    # collector then finds a live owner and keeps them (seen once under load). Both end the
    # same way: the Service is there, its only CR owner is the new CR, and a kept Service
    # keeps its clusterIP.
    await kk.create_cr(cp_body())
    await settle(svc)
    old = await uid_and_ip(kk, "nvidia-dcgm")
    assert old is not None
    await kk.delete_cr("ClusterPolicy", "cluster-policy")
    new_cr = await kk.create_cr(cp_body())
    new_uid = new_cr["metadata"]["uid"]

    async def owned_by_the_new_cr() -> Any:
        s = await kk.service("nvidia-dcgm")
        refs = [r["uid"] for r in s["metadata"].get("ownerReferences", [])] if s else []
        return s if refs == [new_uid] else None

    await eventually(owned_by_the_new_cr)
    await settle(svc)
    s = await owned_by_the_new_cr()
    assert s is not None, await kk.service("nvidia-dcgm")
    if s["metadata"]["uid"] == old[0]:
        assert s["spec"]["clusterIP"] == old[1]


async def test_operator_namespace_deleted_under_shared_svc_is_retried_with_backoff(
    kcm_plane: testenv.ControlPlane, kk: Kube, svc: Service, caplog: pytest.LogCaptureFixture
) -> None:
    await kk.create_cr(cp_body())
    await settle(svc)
    caplog.set_level(logging.INFO, logger="shared_svc")
    await kk.core.delete_namespace(kk.ns)

    async def namespace_gone() -> bool:
        names = [n.metadata.name for n in (await kk.core.list_namespace()).items]
        return kk.ns not in names

    await eventually(namespace_gone, timeout=60)
    failures = svc.metrics.registry.get_sample_value(
        "controller_runtime_reconcile_errors_total", {"controller": "shared-services"}
    )
    await asyncio.sleep(6)
    later = svc.metrics.registry.get_sample_value(
        "controller_runtime_reconcile_errors_total", {"controller": "shared-services"}
    )
    # Backoff, not a hot loop: with a 2 s backoff cap (test settings), a handful of tries.
    assert later is not None and failures is not None and 1 <= later - failures <= 8
    assert svc.controller is not None and svc.controller.last_reconcile["result"] == "error"
    reported = [
        e
        for e in await kk.events_for("OperatorNamespaceMissing", namespace="default")
        if e["regarding"]["kind"] == "ClusterPolicy"
    ]
    assert len(reported) == 1, reported
    # One warning for the episode, not one per retry (issue 19 item 2).
    said = [
        r
        for r in caplog.records
        if r.levelno >= logging.WARNING and "namespace" in r.getMessage().lower()
    ]
    assert len(said) == 1, [r.getMessage() for r in said]


async def test_both_crs_deleted_under_the_collector_log_no_warning(
    kk: Kube, svc: Service, caplog: pytest.LogCaptureFixture
) -> None:
    """The collector and shared-svc race for the same Services: a 409 on a preconditioned
    write or a 404 on a delete is the API's answer to a concurrent change, planned again
    from the fresh cache without a warning (issue 19 item 2)."""
    await kk.create_cr(cp_body())
    await kk.create_cr(gc_body())
    await settle(svc)
    caplog.set_level(logging.DEBUG, logger="shared_svc")
    await kk.delete_cr("ClusterPolicy", "cluster-policy")
    await kk.delete_cr("GPUCluster", "gpu-cluster")

    async def none_left() -> bool:
        return not await kk.services()

    await eventually(none_left)
    await settle(svc)
    assert svc.controller is not None and svc.controller.last_reconcile["result"] == "success"
    warned = [
        f"{r.name}: {r.getMessage()} {r.__dict__.get('error', '')}"
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("shared_svc")
    ]
    assert warned == []
