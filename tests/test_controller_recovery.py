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
from shared_svc.config import Config
from shared_svc.controller import ServicesController
from shared_svc.kube.writer import raw_request
from shared_svc.metrics import Metrics
from shared_svc.reconcile.model import Action, Plan
from testenv import ControlPlane
from tests.kube import api_client, eventually, make_namespace
from tests.refusals import ServiceWritesRefused
from tests.svc import Kube, cp_body, running, service_config, settle

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
            await eventually(lambda: _true(ctrl._failures >= 1), timeout=30)
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
            assert ctrl._failures == 0
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
            assert svc.controller is not None and svc.controller._failures == 0
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
    ctrl = ServicesController(
        None,  # type: ignore[arg-type]  # no API access in this test
        Config(),
        recorder=None,  # type: ignore[arg-type]
        writer=GoneApiWriter(),  # type: ignore[arg-type]
        metrics=Metrics(),
        is_leader=lambda: True,
    )
    body = {"kind": "ServiceMonitor", "metadata": {"name": "nvidia-dcgm-exporter"}}
    create = Action("create", "ServiceMonitor", "nvidia-dcgm-exporter", "Created", apply=body)
    with pytest.raises(ApiException):
        await ctrl._execute(Plan(actions=(create,)))
    assert ctrl._rediscover.is_set()
    service = Action(
        "create", "Service", "nvidia-dcgm", "Created", apply={**body, "kind": "Service"}
    )
    ctrl._rediscover.clear()
    with pytest.raises(ApiException):
        await ctrl._execute(Plan(actions=(service,)))
    assert not ctrl._rediscover.is_set(), "only the ServiceMonitor path says the API may be gone"
