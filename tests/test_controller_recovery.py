"""Recovery without waiting for a grown backoff or the next discovery pass (issue 10,
items 4 and 6), and the start-up log line (item 7)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import pytest
from kubernetes_asyncio.client.exceptions import ApiException

import testenv
from shared_svc import __version__
from shared_svc.controllers.services.reconciler import KEY
from shared_svc.kube.writer import raw_request
from shared_svc.reconcile.model import Action, Plan
from testenv import ControlPlane
from tests.kube import api_client, eventually, make_namespace
from tests.parts import executor
from tests.refusals import ServiceWritesRefused
from tests.svc import Kube, cp_body, gc_body, running, service_config, services_runtime, settle

SM_CRD = "servicemonitors.monitoring.coreos.com"
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


async def _true(value: bool) -> bool:
    return value


@pytest.mark.apiserver
async def test_backoff_is_reset_once_the_watches_are_back() -> None:
    """Own control plane: it is restarted while the controller backs off for 120-240 s."""
    loop = asyncio.get_running_loop()
    cp = await loop.run_in_executor(None, testenv.start)
    try:
        api = await api_client(cp)
        k = Kube(api, await make_namespace(api, "outage"))
        await k.create_cr(cp_body())
        config = service_config(cp, k.ns, backoff_base_seconds=120.0, backoff_max_seconds=240.0)
        refusal = await ServiceWritesRefused(api, k.ns).__aenter__()
        async with running(config) as svc:
            ctrl = svc.controller
            assert ctrl is not None
            runtime = services_runtime(svc)
            await eventually(lambda: _true(runtime.failures(KEY) >= 1), timeout=30)
            # The cause goes away unseen (no watched object changes): still backing off.
            await refusal.lift()
            await loop.run_in_executor(None, cp.stop_apiserver)
            await eventually(lambda: _true(not ctrl.caches_synced()), timeout=30)
            await loop.run_in_executor(None, cp.start_apiserver)
            await api.close()
            api = await api_client(cp)
            k = Kube(api, k.ns)
            # A change made after the restart converges at once, not after the old backoff.
            await k.patch_cr(
                "ClusterPolicy", "cluster-policy", {"spec": {"dcgm": {"enabled": False}}}
            )

            async def converged() -> bool:
                return set(await k.services()) == {"nvidia-dcgm-exporter"}

            # Bounded by the caches' own reconnect backoff (at most 30 s), not by ours.
            await eventually(converged, timeout=60)
            await settle(svc)
            assert runtime.failures(KEY) == 0
            assert svc.status()["lastReconcile"]["result"] == "success"
        await api.close()
    finally:
        cp.stop()


@pytest.mark.apiserver
async def test_service_monitor_api_removed_is_rediscovered_at_once(
    control_plane: ControlPlane, kube: Kube
) -> None:
    await kube.create_cr(cp_body(dcgmExporter={"serviceMonitor": {"enabled": True}}))
    # Neither the periodic discovery nor a grown backoff can explain a quick recovery.
    config = service_config(
        control_plane,
        kube.ns,
        discovery_seconds=600.0,
        backoff_base_seconds=60.0,
        backoff_max_seconds=240.0,
    )
    async with running(config) as svc:
        await settle(svc)
        assert await kube.service_monitor("nvidia-dcgm-exporter") is not None
        try:
            await raw_request(kube.api, "DELETE", f"{CRDS}/{SM_CRD}")

            async def rediscovered() -> bool:
                status = svc.status()
                return (
                    status["serviceMonitorServed"] is False
                    and status["lastReconcile"].get("result") == "success"
                )

            await eventually(rediscovered, timeout=45)
            await settle(svc)
            status = svc.status()
            assert any("ServiceMonitor" in n for n in status["notes"]), status["notes"]
            assert services_runtime(svc).failures(KEY) == 0
            assert await kube.service("nvidia-dcgm-exporter") is not None
        finally:
            await _restore_service_monitor_crd(control_plane, kube)


async def _restore_service_monitor_crd(cp: ControlPlane, kube: Kube) -> None:
    async def gone() -> bool:
        return not any(
            c["metadata"]["name"] == SM_CRD
            for c in (await raw_request(kube.api, "GET", CRDS))["items"]
        )

    await eventually(gone, timeout=60)
    await asyncio.get_running_loop().run_in_executor(
        None, cp.install_crds, [testenv.PROJECT_CRDS / "monitoring.coreos.com_servicemonitors.yaml"]
    )


def test_start_logs_version_and_effective_configuration_once(tmp_path: Any) -> None:
    bad = tmp_path / "kubeconfig"
    bad.write_text("users: [{name: x, user: {token: sekrit-token-123}}]\n")
    proc = subprocess.run(
        [sys.executable, "-m", "shared_svc", "run", "--kubeconfig", str(bad), "--namespace", "ns1"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"SHARED_SVC_RESYNC_SECONDS": "42", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2, proc.stderr  # then it stops: not a kubeconfig
    lines = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    starts = [line for line in lines if line["msg"] == "starting"]
    assert len(starts) == 1, proc.stderr
    assert starts[0]["level"] == "info" and starts[0]["version"] == __version__
    config = starts[0]["config"]
    assert config["namespace"] == "ns1" and config["resync_seconds"] == 42.0
    assert config["kubeconfig"] == str(bad) and config["leader_election"] is True
    assert "sekrit" not in proc.stderr


class GoneApiWriter:
    """The ServiceMonitor API answers what a removed CRD leaves behind: 404 page not found."""

    async def apply(self, obj: dict[str, Any]) -> None:
        exc = ApiException(status=404, reason="Not Found")
        exc.body = "404 page not found\n"
        raise exc


async def test_a_404_on_a_service_monitor_write_rediscovers_at_once() -> None:
    rediscover = asyncio.Event()  # ServiceMonitor discovery's wake
    writes = executor(writer=GoneApiWriter(), rediscover=rediscover)
    body = {"kind": "ServiceMonitor", "metadata": {"name": "nvidia-dcgm-exporter"}}
    create = Action("create", "ServiceMonitor", "nvidia-dcgm-exporter", "Created", apply=body)
    with pytest.raises(ApiException):
        await writes.execute(Plan(actions=(create,)))
    assert rediscover.is_set()
    service = Action(
        "create", "Service", "nvidia-dcgm", "Created", apply={**body, "kind": "Service"}
    )
    rediscover.clear()
    with pytest.raises(ApiException):
        await writes.execute(Plan(actions=(service,)))
    assert not rediscover.is_set(), "only the ServiceMonitor path says the API may be gone"


@pytest.mark.apiserver
async def test_apiserver_restart_recovers_and_deletes_nothing() -> None:
    """Own control plane: it is stopped mid-run."""
    cp = await asyncio.get_running_loop().run_in_executor(None, testenv.start)
    try:
        api = await api_client(cp)
        k = Kube(api, await make_namespace(api, "restart"))
        await k.create_cr(gc_body())
        async with running(service_config(cp, k.ns, backoff_max_seconds=1.0)) as svc:
            await settle(svc)
            before = {n: s["metadata"]["uid"] for n, s in (await k.services()).items()}
            assert len(before) == 4
            await asyncio.get_running_loop().run_in_executor(None, cp.stop_apiserver)
            await asyncio.sleep(3)
            assert svc.controller is not None and not svc.controller.caches_synced(), (
                "no reconcile on stale data"
            )
            assert sum(svc.writer.writes.values()) == 4 if svc.writer else False  # type: ignore[union-attr]
            await asyncio.get_running_loop().run_in_executor(None, cp.start_apiserver)
            await api.close()
            api = await api_client(cp)
            k = Kube(api, "restart")
            await k.patch_cr("GPUCluster", "gpu-cluster", {"spec": {"dcgm": {"enabled": False}}})
            await eventually(lambda: _absent(k, "nvidia-dcgm-dra"), timeout=60)
            await settle(svc)
            after = {n: s["metadata"]["uid"] for n, s in (await k.services()).items()}
            assert after == {
                n: u
                for n, u in before.items()
                if n in ("nvidia-dcgm-exporter", "nvidia-dcgm-exporter-dra")
            }
            assert svc.controller.status()["cachesSynced"] is True
        await api.close()
    finally:
        cp.stop()


async def _absent(k: Kube, name: str) -> bool:
    return await k.service(name) is None


@pytest.mark.apiserver
async def test_service_monitor_api_installed_later() -> None:
    """Own control plane without the ServiceMonitor CRD at first."""
    cp = await asyncio.get_running_loop().run_in_executor(None, lambda: testenv.start(crds=False))
    try:
        await asyncio.get_running_loop().run_in_executor(
            None,
            cp.install_crds,
            [
                testenv.PROJECT_CRDS / "nvidia.com_clusterpolicies.yaml",
                testenv.PROJECT_CRDS / "nvidia.com_gpuclusters.yaml",
            ],
        )
        api = await api_client(cp)
        k = Kube(api, await make_namespace(api, "later"))
        await k.create_cr(cp_body(dcgmExporter={"serviceMonitor": {"enabled": True}}))
        async with running(service_config(cp, k.ns, discovery_seconds=0.5)) as svc:
            await settle(svc)
            status = svc.status()
            assert status["serviceMonitorServed"] is False
            assert any("ServiceMonitor" in n for n in status["notes"])
            assert await k.service("nvidia-dcgm-exporter") is not None
            await asyncio.get_running_loop().run_in_executor(
                None,
                cp.install_crds,
                [testenv.PROJECT_CRDS / "monitoring.coreos.com_servicemonitors.yaml"],
            )
            await eventually(lambda: k.service_monitor("nvidia-dcgm-exporter"), timeout=30)
            assert svc.status()["serviceMonitorServed"] is True
        await api.close()
    finally:
        cp.stop()


@pytest.mark.apiserver
async def test_cache_relists_after_410_gone() -> None:
    """Own control plane: etcd is compacted and the API server restarted (its watch cache
    rebuilt), so a watch from an old resourceVersion really gets 410 Expired."""
    from shared_svc.kube.reflector import Cache, Resource

    cp = await asyncio.get_running_loop().run_in_executor(None, testenv.start)
    try:
        api = await api_client(cp)
        k = Kube(api, await make_namespace(api, "gone"))
        cache = Cache(api, Resource("", "v1", "services", "Service", namespace=k.ns))
        await cache.relist()
        old = cache.resource_version
        for i in range(3):
            await k.core.create_namespaced_service(
                k.ns, {"metadata": {"name": f"s{i}"}, "spec": {"ports": [{"port": 1}]}}
            )
        await asyncio.get_running_loop().run_in_executor(None, cp.compact_etcd)
        await asyncio.get_running_loop().run_in_executor(None, cp.stop_apiserver)
        await asyncio.get_running_loop().run_in_executor(None, cp.start_apiserver)
        await api.close()
        api = await api_client(cp)
        cache = Cache(api, Resource("", "v1", "services", "Service", namespace=k.ns))
        cache.resource_version = old
        assert await cache.watch_once() == "gone"
        # Run from there, the cache ends with the complete list.
        cache.resource_version = old
        cache.synced.set()
        stop = asyncio.Event()
        task = asyncio.ensure_future(cache.run(stop))
        try:
            await eventually(lambda: _true(len(cache.items()) == 3), timeout=20)
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
        await api.close()
    finally:
        cp.stop()


@pytest.mark.apiserver
async def test_a_404_is_believed_only_when_the_crd_is_gone(kube: Kube) -> None:
    """A warming-up API server answers 404 for custom resources whose CRD exists: that must
    never read as "no ClusterPolicy exists" (it would delete Services)."""
    from shared_svc.kube.reflector import Cache, NotServedYet, Resource

    # The path 404s while the CRD exists: what a restarting API server looks like.
    warming = Cache(
        kube.api,
        Resource(
            "nvidia.com",
            "v1",
            "clusterpolicies-not-loaded",
            "ClusterPolicy",
            crd_name="clusterpolicies.nvidia.com",
        ),
    )
    with pytest.raises(NotServedYet):
        await warming.relist()
    assert not warming.synced.is_set(), "no reconcile may run on this"

    # The CRD really is absent: the resource is not served, and that is a complete answer.
    absent = Cache(
        kube.api,
        Resource("example.com", "v1", "widgets", "Widget", crd_name="widgets.example.com"),
    )
    await absent.relist()
    assert absent.synced.is_set() and not absent.served and absent.items() == ()
