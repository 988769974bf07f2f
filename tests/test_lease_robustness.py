"""Leader election on the real API server when things go wrong: Lease errors are visible
(log on change, ``/status``, ``/metrics``), and a leader whose connection freezes gives up
at its renew deadline, before a standby can take over (never two leaders)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client.exceptions import ApiException

import testenv
from shared_svc.kube.lease import LeaseElector
from shared_svc.kube.lease import _now as lease_now
from shared_svc.kube.writer import raw_request
from shared_svc.service import Service
from testenv import ControlPlane, free_port
from tests.apiproxy import TcpProxy, ThrottlingProxy, kubeconfig_via
from tests.kube import api_client, eventually, make_namespace
from tests.svc import Kube, http_get, running, service_config
from tests.test_deploy_rbac import as_identity, install_identity, remove_cluster_objects

pytestmark = pytest.mark.apiserver

LEASE_LOGGER = "shared_svc.kube.lease"
RESOURCES = ("clusterpolicies", "gpuclusters", "services", "daemonsets", "pods", "servicemonitors")


def sample(service: Service, metric: str, **labels: str) -> float | None:
    return service.metrics.registry.get_sample_value(metric, labels)


def lease_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == LEASE_LOGGER
        and r.levelno == logging.WARNING
        and r.getMessage() == "lease request failed"
    ]


async def status_of(service: Service) -> dict[str, Any]:
    code, text = await http_get(service.port or 0, "/status")
    assert code == 200, text
    out: dict[str, Any] = json.loads(text)
    return out


async def _errors_at_least(service: Service, n: int) -> bool:
    return (sample(service, "shared_svc_lease_errors_total") or 0) >= n


async def test_missing_lease_rbac_is_logged_once_shown_and_counted(
    control_plane: ControlPlane, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The chart's RBAC rendered without the Lease rules: everything else works (caches
    synced, ready), the Lease answers 403 on every attempt."""
    ident = install_identity(control_plane, tmp_path, "leaderElection.enabled=false", "replicas=1")
    try:
        await (await as_identity(control_plane, ident)).close()
        config = service_config(
            control_plane,
            ident.namespace,
            kubeconfig=str(ident.kubeconfig),
            pod_name="no-lease-rbac",
            leader_election=True,
            retry_period_seconds=0.2,
        )
        with caplog.at_level(logging.INFO, logger=LEASE_LOGGER):
            async with running(config) as svc:

                async def ready() -> bool:
                    return svc.ready()

                await eventually(ready, timeout=30)
                # Kept current by the caches themselves: nobody has asked for /status yet.
                assert {
                    r: sample(svc, "shared_svc_cache_synced", resource=r) for r in RESOURCES
                } == {r: 1.0 for r in RESOURCES}
                await eventually(lambda: _errors_at_least(svc, 5), timeout=30)
                status = await status_of(svc)
                assert status["leader"] is False
                assert status["leaseError"].startswith("403 Forbidden"), status["leaseError"]
                assert "leases" in status["leaseError"]
                _, metrics = await http_get(svc.port or 0, "/metrics")
                assert "shared_svc_lease_errors_total" in metrics
        warned = lease_warnings(caplog)
        assert len(warned) == 1, [r.__dict__.get("error") for r in warned]
        assert "403" in warned[0].__dict__["error"]
    finally:
        remove_cluster_objects(control_plane, ident)


async def test_unreachable_api_server_is_a_lease_error(
    control_plane: ControlPlane, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A kubeconfig pointing at a closed port: the Lease error says so, once in the log,
    in /status and in the counter; the caches report unsynced without /status being asked."""
    closed = kubeconfig_via(control_plane, f"https://127.0.0.1:{free_port()}", tmp_path / "kc")
    config = service_config(
        control_plane,
        "default",
        kubeconfig=str(closed),
        pod_name="unreachable",
        leader_election=True,
        retry_period_seconds=0.2,
    )
    with caplog.at_level(logging.INFO, logger=LEASE_LOGGER):
        async with running(config) as svc:
            await eventually(lambda: _errors_at_least(svc, 5), timeout=30)
            assert sample(svc, "shared_svc_cache_synced", resource="services") == 0.0
            status = await status_of(svc)
            assert status["leader"] is False and status["leaseHolder"] is None
            assert "Cannot connect" in status["leaseError"], status["leaseError"]
    warned = lease_warnings(caplog)
    assert len(warned) == 1, [r.__dict__.get("error") for r in warned]


async def test_a_frozen_leader_gives_up_before_the_standby_takes_over(
    control_plane: ControlPlane, kube: Kube, tmp_path: Path
) -> None:
    """The leader talks to the API server through a TCP proxy that stops forwarding (its
    requests hang, nothing fails): it must give up at its renew deadline, not when a
    request finally times out, so the standby never leads alongside it."""
    timing = {
        "leader_election": True,
        "lease_duration_seconds": 6.0,
        "renew_deadline_seconds": 3.0,
        "retry_period_seconds": 0.5,
    }
    proxy = await TcpProxy.start(control_plane)
    frozen_cfg = service_config(
        control_plane,
        kube.ns,
        pod_name="frozen",
        kubeconfig=str(kubeconfig_via(control_plane, proxy.url, tmp_path / "frozen")),
        **timing,
    )
    try:
        async with running(frozen_cfg) as a:

            async def a_leads() -> bool:
                return a.is_leader()

            await eventually(a_leads, timeout=15)
            async with running(
                service_config(control_plane, kube.ns, pod_name="standby", **timing)
            ) as b:
                await eventually(lambda: _ready(b), timeout=30)
                assert not b.is_leader()
                proxy.freeze()
                both = 0

                async def b_took_over() -> bool:
                    nonlocal both
                    if a.is_leader() and b.is_leader():
                        both += 1
                    return b.is_leader()

                await eventually(b_took_over, timeout=30, interval=0.05)
                assert not a.is_leader(), "the frozen replica still claims leadership"
                assert both == 0, f"two leaders in {both} samples"
                assert sample(a, "leader_election_master_status", name="shared-svc") == 0.0
                assert a.elector is not None and a.elector.last_error is not None
                assert "TimeoutError" in a.elector.last_error
                assert (sample(a, "shared_svc_lease_errors_total") or 0) >= 1
                proxy.thaw()  # let the frozen replica's caches stop cleanly
    finally:
        proxy.thaw()
        await proxy.close()


async def _ready(service: Service) -> bool:
    return service.ready()


async def test_a_leader_gives_up_while_etcd_does_not_answer() -> None:
    """Own control plane: etcd is paused (SIGSTOP) for a while, so every Lease request hangs
    in the API server. The leader must give up at its renew deadline, and lead again once
    etcd is back."""
    loop = asyncio.get_running_loop()
    cp = await loop.run_in_executor(None, testenv.start)
    try:
        admin = await api_client(cp)
        ns = await make_namespace(admin, "etcd-paused")
        await admin.close()
        config = service_config(
            cp,
            ns,
            pod_name="etcd-paused",
            leader_election=True,
            lease_duration_seconds=6.0,
            renew_deadline_seconds=3.0,
            retry_period_seconds=0.5,
        )
        async with running(config) as svc:

            async def leads() -> bool:
                return svc.is_leader()

            async def follows() -> bool:
                return not svc.is_leader()

            await eventually(leads, timeout=15)
            etcd = cp.processes["etcd"]
            os.killpg(etcd.pid, signal.SIGSTOP)
            try:
                await eventually(follows, timeout=20, interval=0.05)
                assert svc.elector is not None and svc.elector.last_error is not None
                assert "TimeoutError" in svc.elector.last_error
            finally:
                os.killpg(etcd.pid, signal.SIGCONT)
            await eventually(leads, timeout=60)
            assert svc.elector.last_error is None
    finally:
        cp.stop()


@contextlib.asynccontextmanager
async def _electing(
    control_plane: ControlPlane, tmp_path: Path, ns: str, identity: str
) -> AsyncIterator[tuple[ThrottlingProxy, LeaseElector]]:
    """An elector ``identity`` campaigning for the Lease ``renewals`` through a proxy that
    records its requests; stopped (its Lease released) and closed on the way out."""
    proxy = await ThrottlingProxy.start(control_plane)
    kc = kubeconfig_via(control_plane, proxy.url, tmp_path / f"{identity}.kubeconfig")
    api = await api_client(control_plane, str(kc))
    elector = LeaseElector(
        api,
        namespace=ns,
        name="renewals",
        identity=identity,
        lease_duration=6.0,
        renew_deadline=3.0,
        retry_period=0.2,
    )
    stop = asyncio.Event()
    task = asyncio.ensure_future(elector.run(stop))
    try:
        yield proxy, elector
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)
        await api.close()
        await proxy.close()


def _lease_calls(proxy: ThrottlingProxy, ns: str) -> list[str]:
    path = f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
    return [m for m, p in proxy.requests if p in (path, f"{path}/renewals")]


async def test_a_leader_renews_with_one_put_and_no_get(
    control_plane: ControlPlane, kube: Kube, tmp_path: Path
) -> None:
    """As client-go's leaderelection: the leader renews the record it last wrote with one PUT
    (its resourceVersion guards the race); it does not read the Lease before every renewal."""
    async with _electing(control_plane, tmp_path, kube.ns, "renewer") as (proxy, elector):

        async def led_and_renewed() -> bool:
            return elector.is_leader and _lease_calls(proxy, kube.ns).count("PUT") >= 8

        await eventually(led_and_renewed, timeout=30)
        calls = _lease_calls(proxy, kube.ns)
        assert calls[:2] == ["GET", "POST"], calls  # the first attempt finds no Lease
        assert "GET" not in calls[2:], calls
        assert elector.errors == 0 and elector.last_error is None


async def test_a_lease_written_by_another_is_read_again_on_conflict(
    control_plane: ControlPlane, kube: Kube, tmp_path: Path
) -> None:
    """Someone else writes the Lease: the leader's PUT with the old resourceVersion gets 409,
    it reads the Lease again at once (no error counted). Still its own record (a label added):
    it renews; another holder's fresh record: it is a follower at once."""
    path = f"/apis/coordination.k8s.io/v1/namespaces/{kube.ns}/leases/renewals"
    async with _electing(control_plane, tmp_path, kube.ns, "first") as (proxy, elector):

        async def leads() -> bool:
            return elector.is_leader

        await eventually(leads, timeout=30)
        lease = await raw_request(kube.api, "GET", path)
        lease["metadata"].setdefault("labels", {})["touched"] = "yes"
        await raw_request(kube.api, "PUT", path, body=lease)
        seen = len(proxy.requests)

        async def renewed_after_reading() -> bool:
            calls = [m for m, p in proxy.requests[seen:] if p == path]
            return "GET" in calls and calls[calls.index("GET") :].count("PUT") >= 2

        await eventually(renewed_after_reading, timeout=30)
        calls = [m for m, p in proxy.requests[seen:] if p == path]
        assert calls[:3] == ["PUT", "GET", "PUT"], calls  # 409, read again, renewed
        assert elector.is_leader and elector.errors == 0
        lease = await raw_request(kube.api, "GET", path)
        assert lease["metadata"]["labels"] == {"touched": "yes"}

        lease["spec"].update({"holderIdentity": "second", "renewTime": lease_now()})
        await raw_request(kube.api, "PUT", path, body=lease)

        async def follows() -> bool:
            return not elector.is_leader and elector.holder == "second"

        await eventually(follows, timeout=30, interval=0.02)
        assert elector.errors == 0
        lease = await raw_request(kube.api, "GET", path)
        assert lease["spec"]["holderIdentity"] == "second"


async def test_a_leader_that_loses_the_race_to_recreate_a_deleted_lease_steps_down_at_once(
    control_plane: ControlPlane, kube: Kube, tmp_path: Path
) -> None:
    """Kept from the soak (issue 44): the Lease deleted, every replica races to create it
    again. When a standby's POST lands first, the leader's gets 409: it reads the Lease and
    follows the new holder at once, counting no error (before, the 409 was an error and it
    kept leading until its renew deadline, beside the new leader)."""
    leases = f"/apis/coordination.k8s.io/v1/namespaces/{kube.ns}/leases"
    raced: list[str] = []

    async def standby_first(method: str, path: str) -> None:
        if method == "POST" and path == leases and not raced:
            raced.append(path)
            body = {
                "metadata": {"name": "renewals", "namespace": kube.ns},
                "spec": {
                    "holderIdentity": "second",
                    "leaseDurationSeconds": 6,
                    "renewTime": lease_now(),
                    "acquireTime": lease_now(),
                },
            }
            await raw_request(kube.api, "POST", leases, body=body)

    async with _electing(control_plane, tmp_path, kube.ns, "first") as (proxy, elector):

        async def leads() -> bool:
            return elector.is_leader

        await eventually(leads, timeout=30)
        assert elector.errors == 0
        proxy.before = standby_first
        await raw_request(kube.api, "DELETE", f"{leases}/renewals")

        async def follows() -> bool:
            return not elector.is_leader and elector.holder == "second"

        await eventually(follows, timeout=30, interval=0.02)
        assert raced, "the leader's POST met the standby's Lease"
        assert elector.errors == 0, elector.last_error
        lease = await raw_request(kube.api, "GET", f"{leases}/renewals")
        assert lease["spec"]["holderIdentity"] == "second"


async def test_a_deleted_lease_is_not_taken_by_a_standby_while_its_leader_may_lead(
    control_plane: ControlPlane, kube: Kube, tmp_path: Path
) -> None:
    """Kept from the soak (issue 44): the Lease deleted under its leader. The standby, which
    watched the leader renew, does not create it at once (that made two leaders until the
    old one's next renewal); the leader creates it again at its next renewal and leads on.
    The leader renews every 2 s, the standby tries every 0.2 s: before, the standby won."""
    api = await api_client(control_plane)
    leases = f"/apis/coordination.k8s.io/v1/namespaces/{kube.ns}/leases"

    def elector(identity: str, retry: float) -> LeaseElector:
        return LeaseElector(
            api,
            namespace=kube.ns,
            name="deleted",
            identity=identity,
            lease_duration=6.0,
            renew_deadline=3.0,
            retry_period=retry,
        )

    leader, standby = elector("leader", 2.0), elector("standby", 0.2)
    stop = asyncio.Event()
    tasks = [asyncio.ensure_future(leader.run(stop))]
    both: list[float] = []
    try:

        async def leads() -> bool:
            return leader.is_leader

        await eventually(leads, timeout=30, interval=0.05)
        tasks.append(asyncio.ensure_future(standby.run(stop)))  # the standby second

        async def settled() -> bool:
            return leader.is_leader and standby.holder == "leader"

        await eventually(settled, timeout=30, interval=0.05)
        await raw_request(kube.api, "DELETE", f"{leases}/deleted")

        async def recreated() -> bool:
            if leader.is_leader and standby.is_leader:
                both.append(asyncio.get_running_loop().time())
            try:
                lease = await raw_request(kube.api, "GET", f"{leases}/deleted")
            except ApiException:
                return False
            return bool(lease["spec"].get("holderIdentity"))

        await eventually(recreated, timeout=30, interval=0.02)
        lease = await raw_request(kube.api, "GET", f"{leases}/deleted")
        assert lease["spec"]["holderIdentity"] == "leader"
        assert both == [] and leader.is_leader and not standby.is_leader
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await api.close()
