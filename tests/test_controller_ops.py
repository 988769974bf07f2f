"""Operating the Services controller on the real API server: Events once per conflict,
a fighting writer, steady state, replicas, API server restarts, discovery, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import aiohttp
import pytest

import testenv
from shared_svc.service import Service
from testenv import ControlPlane
from tests.kube import api_client, eventually, make_namespace
from tests.svc import Kube, apiserver_write_count, cp_body, gc_body, running, service_config, settle

pytestmark = pytest.mark.apiserver


async def http_get(port: int, path: str) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            f"http://127.0.0.1:{port}{path}", timeout=aiohttp.ClientTimeout(total=5)
        ) as resp,
    ):
        return resp.status, await resp.text()


def successful_reconciles(service: Service) -> float:
    return metric(
        service,
        "controller_runtime_reconcile_total",
        controller="shared-services",
        result="success",
    )


def metric(service: Service, name: str, **labels: str) -> float:
    value = service.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


async def test_each_conflict_is_one_warning_event_and_in_status(
    control_plane: ControlPlane, kube: Kube
) -> None:
    # The ClusterPolicy is older, so it wins; the GPUCluster loses both fields.
    await kube.create_cr(
        cp_body(dcgmExporter={"service": {"type": "NodePort", "internalTrafficPolicy": "Local"}})
    )
    await asyncio.sleep(1.1)  # creationTimestamp has second resolution
    await kube.create_cr(
        gc_body(
            dcgmExporter={
                "enabled": True,
                "service": {"type": "ClusterIP", "internalTrafficPolicy": "Cluster"},
            }
        )
    )
    config = service_config(control_plane, kube.ns, resync_seconds=0.3)
    async with running(config) as svc:
        await settle(svc)
        exporter = await kube.service("nvidia-dcgm-exporter")
        assert exporter is not None
        assert (
            exporter["spec"]["type"] == "NodePort"
            and exporter["spec"]["internalTrafficPolicy"] == "Local"
        )
        assert exporter["spec"]["ports"][0]["nodePort"], (
            "the API server assigned a nodePort; we keep it"
        )
        # Many reconciles later (resync every 0.3 s) there is still one Event per conflict.
        reconciles = successful_reconciles(svc)
        await asyncio.sleep(2.5)
        assert successful_reconciles(svc) >= reconciles + 5
        events = await kube.events_for("ServiceConfigConflict", namespace="default")
        fields = sorted(e["note"].split(":")[0] for e in events)
        assert len(events) == 2, [e["note"] for e in events]
        assert all(
            e["regarding"]["kind"] == "GPUCluster" and e["type"] == "Warning" for e in events
        )
        assert all(not e.get("series") for e in events), "not re-emitted on every reconcile"
        assert any(
            "spec.type" in e["note"] and "NodePort" in e["note"] and "ClusterIP" in e["note"]
            for e in events
        ), fields
        status, body = await http_get(svc.port or 0, "/status")
        assert status == 200
        conflicts = json.loads(body)["conflicts"]
        assert {c["field"] for c in conflicts if c["object"] == "Service/nvidia-dcgm-exporter"} == {
            "spec.type",
            "spec.internalTrafficPolicy",
        }
        assert all(c["winner"]["kind"] == "ClusterPolicy" for c in conflicts)
    await kube.events.delete_collection_namespaced_event("default")


async def test_fighting_writer_is_reported_and_not_fought(
    control_plane: ControlPlane, kube: Kube
) -> None:
    await kube.create_cr(cp_body(dcgmExporter={"enabled": False}))
    config = service_config(
        control_plane,
        kube.ns,
        conflicting_writer_threshold=3,
        conflicting_writer_backoff_seconds=600,
    )
    async with running(config) as svc:
        await settle(svc)
        assert svc.writer is not None
        ours_before = sum(svc.writer.writes.values())
        fights = 0

        async def fight() -> None:
            # What gpu-operator's built-in step does: a whole-object Update of the selector.
            nonlocal fights
            while True:
                s = await kube.core.read_namespaced_service("nvidia-dcgm", kube.ns)
                if s.spec.selector != {"app": "legacy"}:
                    s.spec.selector = {"app": "legacy"}
                    try:
                        await kube.core.replace_namespaced_service(
                            "nvidia-dcgm", kube.ns, s, field_manager="gpu-operator"
                        )
                        fights += 1
                    except Exception:
                        pass
                await asyncio.sleep(0.1)

        fighter = asyncio.ensure_future(fight())
        try:
            await eventually(lambda: kube.events_for("ConflictingWriter"), timeout=30)
            ours_at_report = sum(svc.writer.writes.values()) - ours_before
            await asyncio.sleep(3)  # the fight goes on; we stay out of it
        finally:
            fighter.cancel()
            await asyncio.gather(fighter, return_exceptions=True)
        ours_total = sum(svc.writer.writes.values()) - ours_before
        assert ours_at_report <= config.conflicting_writer_threshold + 1, ours_at_report
        assert ours_total == ours_at_report, "no writes to a contested object during the backoff"
        assert fights >= 3
        events = await kube.events_for("ConflictingWriter")
        assert len(events) == 1
        assert "gpu-operator" in events[0]["note"] and "spec.selector" in events[0]["note"]
        contested = svc.status()["contested"]
        assert contested and contested[0]["managers"][0] == "gpu-operator"
        assert metric(svc, "shared_svc_conflicting_writer_total") == 1


async def test_steady_state_writes_nothing(control_plane: ControlPlane, kube: Kube) -> None:
    """Hours of steady state, compressed: many periodic reconciles from the caches, and
    re-lists (what an API-server restart or a 410 brings), write nothing."""
    monitor = {"enabled": True, "interval": "30s"}
    await kube.create_cr(cp_body(dcgmExporter={"serviceMonitor": monitor}))
    await kube.create_cr(gc_body(dcgmExporter={"enabled": True, "service": {"type": "NodePort"}}))
    config = service_config(control_plane, kube.ns, resync_seconds=0.25)
    async with running(config) as svc:
        await settle(svc)
        await asyncio.sleep(0.5)
        ctrl = svc.controller
        assert ctrl is not None
        writes_before = apiserver_write_count(control_plane)
        reconciles = successful_reconciles(svc)
        relists = {n: i.relists for n, i in ctrl._informers.items()}
        for _ in range(5):
            for informer in ctrl._informers.values():
                await informer.relist()
            await asyncio.sleep(0.5)
        await asyncio.sleep(2.5)
        assert apiserver_write_count(control_plane) == writes_before
        assert successful_reconciles(svc) >= reconciles + 10
        # Five forced re-lists of each cache: one list per list+watch it holds.
        assert all(
            i.relists == relists[n] + 5 * len(getattr(i, "parts", (i,)))
            for n, i in ctrl._informers.items()
        )


async def test_the_periodic_resync_reconciles_from_the_caches_without_relisting(
    control_plane: ControlPlane, kube: Kube
) -> None:
    """client-go's resync: the controller reconciles every ``resync_seconds`` from its
    caches; a cache whose watch is healthy is never re-listed for it (a re-list of 8,000
    pods costs seconds of CPU), and changes still arrive through the watches."""
    await kube.create_cr(cp_body())
    async with running(service_config(control_plane, kube.ns, resync_seconds=0.3)) as svc:
        await settle(svc)
        ctrl = svc.controller
        assert ctrl is not None
        relists = {n: i.relists for n, i in ctrl._informers.items()}
        reconciles = successful_reconciles(svc)
        await kube.core.create_namespaced_service(
            kube.ns, {"metadata": {"name": "other"}, "spec": {"ports": [{"port": 1}]}}
        )
        services = ctrl._informers["services"]
        await eventually(lambda: _true(services.get("other", kube.ns) is not None), timeout=15)
        await asyncio.sleep(3)  # ten resync periods
        assert successful_reconciles(svc) >= reconciles + 5, "the resync still reconciles"
        assert {n: i.relists for n, i in ctrl._informers.items()} == relists


async def test_http_endpoints(control_plane: ControlPlane, kube: Kube) -> None:
    await kube.create_cr(cp_body())
    async with running(service_config(control_plane, kube.ns)) as svc:
        await settle(svc)
        port = svc.port or 0
        assert await http_get(port, "/livez") == (200, "ok\n")
        assert await http_get(port, "/healthz") == (200, "ok\n")
        assert await http_get(port, "/readyz") == (200, "ok\n")
        status = json.loads((await http_get(port, "/status"))[1])
        assert status["leader"] is True and status["lastReconcile"]["result"] == "success"
        names = {o["name"]: o for o in status["objects"]}
        assert names["nvidia-dcgm"]["neededBy"] == ["ClusterPolicy/cluster-policy"]
        assert names["nvidia-dcgm"]["selector"] == {"app": "nvidia-dcgm"}
        code, text = await http_get(port, "/metrics")
        assert code == 200
        assert (
            'controller_runtime_reconcile_total{controller="shared-services",result="success"}'
            in text
        )
        assert 'shared_svc_managed_objects{kind="Service"} 2.0' in text
        assert 'leader_election_master_status{name="shared-svc"} 1.0' in text


async def test_two_replicas_one_writer_and_handover(
    control_plane: ControlPlane, kube: Kube
) -> None:
    base = {
        "leader_election": True,
        "lease_duration_seconds": 3.0,
        "renew_deadline_seconds": 2.0,
        "retry_period_seconds": 0.5,
    }
    a = service_config(control_plane, kube.ns, pod_name="replica-a", **base)
    b = service_config(control_plane, kube.ns, pod_name="replica-b", **base)
    async with running(a) as ra, running(b) as rb:
        await eventually(lambda: _leader_of(ra, rb), timeout=15)
        leader, standby = (ra, rb) if ra.is_leader() else (rb, ra)
        assert not standby.is_leader()
        await kube.create_cr(cp_body())
        await settle(leader)
        assert await kube.service("nvidia-dcgm") is not None
        assert sum(leader.writer.writes.values()) >= 2  # type: ignore[union-attr]
        assert sum(standby.writer.writes.values()) == 0  # type: ignore[union-attr]
        assert (await http_get(standby.port or 0, "/readyz"))[0] == 200, "a standby is ready"
        assert json.loads((await http_get(standby.port or 0, "/status"))[1])["leader"] is False

        # The leader dies without releasing the Lease (a crash): the standby takes over within a lease duration.
        async def no_release() -> None:
            return None

        assert leader.elector is not None
        leader.elector.release = no_release  # type: ignore[method-assign]
        leader.elector._retry = 3600  # stop renewing, as a dead process would
        assert leader.controller is not None
        leader.controller._is_leader = lambda: False  # ...and stop writing (it reconciles at once)
        killed_at = time.monotonic()
        await eventually(lambda: _true(standby.is_leader()), timeout=10, interval=0.05)
        handover = time.monotonic() - killed_at
        assert (
            handover <= base["lease_duration_seconds"] + 2 * base["retry_period_seconds"] + 1.0
        ), handover
        await kube.patch_cr(
            "ClusterPolicy", "cluster-policy", {"spec": {"dcgmExporter": {"enabled": False}}}
        )
        await settle(standby)
        assert await kube.service("nvidia-dcgm-exporter") is None
        assert sum(standby.writer.writes.values()) >= 1  # type: ignore[union-attr]


async def _leader_of(*services: Service) -> bool:
    return sum(s.is_leader() for s in services) == 1


async def _true(value: bool) -> bool:
    return value


async def test_graceful_stop_releases_the_lease(control_plane: ControlPlane, kube: Kube) -> None:
    cfg = service_config(
        control_plane,
        kube.ns,
        pod_name="graceful",
        leader_election=True,
        lease_duration_seconds=30.0,
        renew_deadline_seconds=20.0,
        retry_period_seconds=0.5,
    )
    async with running(cfg) as svc:
        await eventually(lambda: _true(svc.is_leader()), timeout=10)
    lease = await kube.api.call_api(
        f"/apis/coordination.k8s.io/v1/namespaces/{kube.ns}/leases/shared-svc",
        "GET",
        auth_settings=["BearerToken"],
        response_types_map={200: "object"},
        _return_http_data_only=True,
    )
    assert lease["spec"]["holderIdentity"] == ""


async def test_sigterm_finishes_and_exits_zero(
    control_plane: ControlPlane, kube: Kube, tmp_path: Any
) -> None:
    await kube.create_cr(cp_body())
    env = {**os.environ, "OPERATOR_NAMESPACE": kube.ns, "POD_NAME": "proc-1"}
    port = testenv.free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shared_svc",
            "run",
            "--kubeconfig",
            str(control_plane.kubeconfig),
            "--port",
            str(port),
            "--bind-address",
            "127.0.0.1",
            "--leader-election",
            "true",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "log").open("w"),
    )
    try:

        async def ready() -> bool:
            try:
                return (await http_get(port, "/readyz"))[0] == 200 and json.loads(
                    (await http_get(port, "/status"))[1]
                )["leader"]
            except (OSError, aiohttp.ClientError):
                return False

        await eventually(ready, timeout=30, interval=0.2)
        await eventually(lambda: kube.service("nvidia-dcgm-exporter"), timeout=20)
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.get_running_loop().run_in_executor(None, proc.wait, 30)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "log").read_text()
    assert code == 0, log
    assert '"msg": "lease released"' in log and '"msg": "stopped"' in log
    assert "Traceback" not in log


async def test_stop_ends_every_part_in_reverse_order_of_start_and_releases_the_lease(
    control_plane: ControlPlane, kube: Kube, tmp_path: Any
) -> None:
    """What SIGTERM does (``run`` sets the same stop event): every long-running part is a
    Runnable of the Manager; the controllers stop first, the Lease is released after the
    guard and before the servers close (issue 21)."""
    from tests.admission import make_tls

    tls = make_tls(tmp_path / "tls")
    await kube.create_cr(cp_body())
    config = service_config(
        control_plane,
        kube.ns,
        leader_election=True,
        pod_name="ordered-1",
        upgrade_controller=True,
        webhook_cert_file=tls.cert_file,
        webhook_key_file=tls.key_file,
        webhook_port=testenv.free_port(),
    )
    async with running(config) as svc:
        await eventually(lambda: asyncio.sleep(0, svc.is_leader() and svc.ready()), timeout=30)
        started = [r.name for r in svc.runnables()]
        assert svc.manager is not None and svc.manager.started.is_set()
    assert started == [
        "http",
        "lease",
        "admission-webhook",
        "webhook-certificate",
        "admission-guard",
        "servicemonitor-discovery",
        "shared-services",
        "upgrade",
    ]
    assert svc.manager.stopped == started[::-1]
    assert svc.elector is not None and not svc.elector.is_leader
    lease = await kube.api.call_api(
        f"/apis/coordination.k8s.io/v1/namespaces/{kube.ns}/leases/{config.lease_name}",
        "GET",
        auth_settings=["BearerToken"],
        response_types_map={200: "object"},
        _return_http_data_only=True,
    )
    assert lease["spec"]["holderIdentity"] == "", "released"


def test_bad_configuration_is_one_line_exit_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "shared_svc", "run", "--port", "99999"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KUBECONFIG": "/nonexistent"},
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("shared-svc: error: invalid configuration: --port '99999':"), (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "shared_svc", "run", "--kubeconfig", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        proc.returncode == 2
        and "kubeconfig /nonexistent does not exist" in proc.stderr
        and "Traceback" not in proc.stderr
    )


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


async def test_upgrade_controller_runs_inside_the_service(
    control_plane: ControlPlane, kube: Kube
) -> None:
    config = service_config(control_plane, kube.ns, upgrade_controller=True)
    async with running(config) as svc:
        await eventually(lambda: _true(svc.ready()), timeout=30)
        status = json.loads((await http_get(svc.port or 0, "/status"))[1])
        assert status["upgrade"]["enabled"] is True and status["upgrade"]["driver"] == "gpu"
        assert status["upgrade"]["synced"] is True
        _, text = await http_get(svc.port or 0, "/metrics")
        assert "shared_svc_upgrade_nodes" in text, "upgrade metrics share the service's registry"
        assert "controller_runtime_reconcile_total" in text
    async with running(service_config(control_plane, kube.ns)) as svc:
        assert "upgrade" not in svc.status(), "off by default"


async def test_dry_run_computes_and_reports_but_writes_nothing(
    control_plane: ControlPlane, kube: Kube
) -> None:
    await kube.create_cr(cp_body())
    before = apiserver_write_count(control_plane)
    async with running(service_config(control_plane, kube.ns, dry_run=True)) as svc:
        await eventually(
            lambda: _true(svc.status()["lastReconcile"].get("result") == "dry-run"), timeout=30
        )
        status = svc.status()
        assert {o["name"]: o["lastAction"]["action"] for o in status["objects"]} == {
            "nvidia-dcgm": "create",
            "nvidia-dcgm-exporter": "create",
        }
    assert await kube.services() == {}
    assert apiserver_write_count(control_plane) == before, (
        "no Service, ServiceMonitor or Event written"
    )


async def test_informer_relists_after_410_gone() -> None:
    """Own control plane: etcd is compacted and the API server restarted (its watch cache
    rebuilt), so a watch from an old resourceVersion really gets 410 Expired."""
    from shared_svc.kube.reflector import Informer, Resource

    cp = await asyncio.get_running_loop().run_in_executor(None, testenv.start)
    try:
        api = await api_client(cp)
        k = Kube(api, await make_namespace(api, "gone"))
        informer = Informer(
            api, Resource("", "v1", "services", "Service", namespace=k.ns), on_change=lambda: None
        )
        await informer.relist()
        old = informer.resource_version
        for i in range(3):
            await k.core.create_namespaced_service(
                k.ns, {"metadata": {"name": f"s{i}"}, "spec": {"ports": [{"port": 1}]}}
            )
        await asyncio.get_running_loop().run_in_executor(None, cp.compact_etcd)
        await asyncio.get_running_loop().run_in_executor(None, cp.stop_apiserver)
        await asyncio.get_running_loop().run_in_executor(None, cp.start_apiserver)
        await api.close()
        api = await api_client(cp)
        informer = Informer(
            api, Resource("", "v1", "services", "Service", namespace=k.ns), on_change=lambda: None
        )
        informer.resource_version = old
        assert await informer.watch_once() == "gone"
        # Run from there, the informer ends with the complete list.
        informer.resource_version = old
        informer.synced.set()
        stop = asyncio.Event()
        task = asyncio.ensure_future(informer.run(stop))
        try:
            await eventually(lambda: _true(len(informer.items()) == 3), timeout=20)
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
        await api.close()
    finally:
        cp.stop()


async def test_a_404_is_believed_only_when_the_crd_is_gone(kube: Kube) -> None:
    """A warming-up API server answers 404 for custom resources whose CRD exists: that must
    never read as "no ClusterPolicy exists" (it would delete Services)."""
    from shared_svc.kube.reflector import Informer, NotServedYet, Resource

    # The path 404s while the CRD exists: what a restarting API server looks like.
    warming = Informer(
        kube.api,
        Resource(
            "nvidia.com",
            "v1",
            "clusterpolicies-not-loaded",
            "ClusterPolicy",
            crd_name="clusterpolicies.nvidia.com",
        ),
        on_change=lambda: None,
    )
    with pytest.raises(NotServedYet):
        await warming.relist()
    assert not warming.synced.is_set(), "no reconcile may run on this"

    # The CRD really is absent: the resource is not served, and that is a complete answer.
    absent = Informer(
        kube.api,
        Resource("example.com", "v1", "widgets", "Widget", crd_name="widgets.example.com"),
        on_change=lambda: None,
    )
    await absent.relist()
    assert absent.synced.is_set() and not absent.served and absent.items() == ()


def test_a_file_that_is_not_a_kubeconfig_is_one_line_exit_2(tmp_path: Any) -> None:
    bad = tmp_path / "kubeconfig"
    bad.write_text("garbage")
    proc = subprocess.run(
        [sys.executable, "-m", "shared_svc", "run", "--kubeconfig", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    # One line after the start-up log line (version and configuration, JSON).
    starting, error = proc.stderr.splitlines()
    assert json.loads(starting)["msg"] == "starting"
    assert (
        error == f"shared-svc: error: kubeconfig {bad} is not a kubeconfig (it names no clusters)"
    )
