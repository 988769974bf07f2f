"""The guard judged from the API server's side (issue 43), on the real API server.

The guard's webhooks are behind the chart's Service, as installed by default (no ``url``):
the API server resolves the Service ``<fullname>-webhook`` and calls it. Here that Service
is an ExternalName Service naming 127.0.0.1 (the API server calls an ExternalName
Service's name on the port of the webhook's ``clientConfig``; kube-apiserver refuses
loopback addresses in EndpointSlices), in front of a TCP proxy to shared-svc's own
webhook server, with a serving certificate for ``shared-svc-webhook.<namespace>.svc``.
shared-svc runs as the chart's ServiceAccount with the chart's RBAC, as in a cluster:
its dry runs are what the chart's ``matchConditions`` admit.

Two faults, in policy and in webhook mode: the Service pointing at an address where
nothing serves the port (connection refused), and a server that stops answering (the
proxy holds every byte: the API server's call times out). Each is reported as failing
open within two probe checks (the leader's ``/status``, the metric, a Warning Event;
the API server itself counts the calls that failed open), and served again within two
checks of the fault's end. No probe changes or deletes an object.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shared_svc.cli import main
from shared_svc.service import Service
from testenv import ControlPlane
from tests.admission import ADMISSION_API, Tls, guard_docs, install, make_tls, uninstall
from tests.apiproxy import TcpProxy
from tests.kube import eventually
from tests.svc import (
    Kube,
    apiserver_dry_run_count,
    apiserver_write_count,
    cp_body,
    metric,
    running,
    service_config,
    settle,
)
from tests.test_admission_guard import free_port
from tests.test_deploy_chart import rbac_docs, render_docs

pytestmark = pytest.mark.apiserver

RELEASE = "shared-svc"
WEBHOOK_SERVICE = f"{RELEASE}-webhook"
DELETE_GUARD = "delete-guard.shared-svc.nvidia.com"
NAMES = ("nvidia-dcgm", "nvidia-dcgm-exporter")
MODES = {"policy": "policy", "webhook": "webhook"}


@dataclass
class Rig:
    cp: ControlPlane
    kube: Kube
    svc: Service
    proxy: TcpProxy
    kubeconfig: Path
    docs: list[dict[str, Any]]
    config: Any

    @property
    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = self.svc.status()["admissionGuard"]
        return out

    def reason(self, guard: str) -> str:
        return str(self.status["probe"][guard]["reason"])

    async def checks(self, n: int = 2) -> None:
        """Waits until ``n`` more checks of the guard monitor have completed (the first
        may have started before the change; the second started after it)."""
        assert self.svc.admission is not None
        monitor = self.svc.admission.monitor
        start = monitor.checks

        async def done() -> bool:
            await asyncio.sleep(0)
            return monitor.checks >= start + n

        await eventually(done, timeout=60, interval=0.05)

    async def point_service_at(self, address: str) -> None:
        """The webhook Service names another address; the connections the API server
        keeps to the old one end (as when a pod goes), so its next call resolves anew."""
        await self.kube.core.patch_namespaced_service(
            WEBHOOK_SERVICE, self.kube.ns, {"spec": {"externalName": address}}
        )
        self.proxy.drop()

    def guard_name(self, kind: str) -> str:
        return next(d["metadata"]["name"] for d in self.docs if d["kind"] == kind)


def guard_sets(mode: str, tls: Tls) -> tuple[str, ...]:
    """The guard behind the chart's Service (no url), with an external certificate."""
    return (
        f"admission.mutation={mode}",
        "admission.webhook.enabled=true",
        "admission.certificate.source=external",
        f"admission.webhook.caBundle={tls.ca_bundle}",
        "admission.webhook.timeoutSeconds=1",
    )


def identity(cp: ControlPlane, namespace: str, directory: Path) -> Path:
    """The chart's RBAC for release shared-svc in ``namespace``, and a kubeconfig with a
    real token of its ServiceAccount."""
    cp.apply_manifests(rbac_docs(render_docs(name=RELEASE, namespace=namespace)))
    token = cp.service_account_token(namespace, RELEASE)
    return cp.write_kubeconfig(directory / "shared-svc.kubeconfig", token)


@contextlib.asynccontextmanager
async def guarded(
    cp: ControlPlane, kube: Kube, tmp_path: Path, mode: str, **overrides: Any
) -> AsyncIterator[Rig]:
    ns = kube.ns
    tls = make_tls(tmp_path / "tls", dns_names=(f"{WEBHOOK_SERVICE}.{ns}.svc",))
    kubeconfig = identity(cp, ns, tmp_path)
    config = service_config(
        cp,
        ns,
        kubeconfig=str(kubeconfig),
        webhook_cert_file=tls.cert_file,
        webhook_key_file=tls.key_file,
        webhook_port=free_port(),
        discovery_seconds=0.5,
        **overrides,
    )
    docs = guard_docs(ns, *guard_sets(mode, tls))
    assert {d["kind"] for d in docs} >= {"ValidatingWebhookConfiguration"}
    async with running(config) as svc:
        assert svc.admission is not None and svc.admission.webhook_port is not None
        proxy = await TcpProxy.start_to(svc.admission.webhook_port)
        await kube.core.create_namespaced_service(
            ns,
            {
                "metadata": {"name": WEBHOOK_SERVICE},
                "spec": {"type": "ExternalName", "externalName": "127.0.0.1"},
            },
        )
        for doc in docs:
            for hook in doc.get("webhooks") or []:
                service = hook["clientConfig"]["service"]
                assert service["name"] == WEBHOOK_SERVICE and "url" not in hook["clientConfig"]
                service["port"] = proxy.port
        install(cp, docs)
        try:
            yield Rig(cp, kube, svc, proxy, kubeconfig, docs, config)
        finally:
            uninstall(cp, docs)
            await proxy.close()
            for plural, name in (("clusterrolebindings", RELEASE), ("clusterroles", RELEASE)):
                cp.request("DELETE", f"/apis/rbac.authorization.k8s.io/v1/{plural}/{name}")


async def served(rig: Rig, guards: tuple[str, ...] = ("delete", "update")) -> bool:
    await asyncio.sleep(0)
    return all(rig.reason(g) == "served" for g in guards)


async def until_served(rig: Rig) -> None:
    try:
        await eventually(lambda: served(rig), timeout=60)
    except AssertionError:
        log = (rig.cp.workdir / "kube-apiserver.log").read_text(errors="replace")
        calls = [line for line in log.splitlines() if "guard" in line or "match" in line][-5:]
        raise AssertionError(f"never served: {rig.status}\n" + "\n".join(calls)) from None


def fail_open_calls(cp: ControlPlane, webhook: str) -> float:
    """The API server's own count of calls to ``webhook`` that failed open."""
    status, text = cp.request("GET", "/metrics")
    assert status == 200
    total = 0.0
    for line in str(text).splitlines():
        if line.startswith("apiserver_admission_webhook_fail_open_count{") and (
            f'name="{webhook}"' in line
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def warnings(kube: Kube, kind: str, name: str) -> list[dict[str, Any]]:
    """The AdmissionGuardFailsOpen Warnings about one guard object (in ``default``)."""
    events = await kube.events_for("AdmissionGuardFailsOpen", namespace="default")
    return [e for e in events if (e["regarding"]["kind"], e["regarding"]["name"]) == (kind, name)]


def occurrences(events: list[dict[str, Any]]) -> int:
    """Times the Warnings were sent (a repeat of the same Event bumps its series)."""
    return sum(int((e.get("series") or {}).get("count", 1)) for e in events)


async def kept(kube: Kube) -> dict[str, tuple[str, str]]:
    out = {}
    for name in NAMES:
        live = await kube.service(name)
        assert live is not None, f"{name} deleted"
        out[name] = (live["metadata"]["uid"], live["metadata"]["resourceVersion"])
    return out


async def make_unreachable(rig: Rig, fault: str) -> None:
    if fault == "service-to-nothing":
        await rig.point_service_at("127.0.0.2")  # nothing listens there
    else:
        rig.proxy.freeze()  # connections accepted, nothing answered


async def make_reachable(rig: Rig, fault: str) -> None:
    if fault == "service-to-nothing":
        await rig.point_service_at("127.0.0.1")
    else:
        rig.proxy.thaw()


@pytest.mark.parametrize("fault", ["service-to-nothing", "server-stops-answering"])
@pytest.mark.parametrize("mode", sorted(MODES))
async def test_a_guard_the_api_server_cannot_reach_is_reported_failing_open_and_recovers(
    control_plane: ControlPlane, kube: Kube, tmp_path: Path, mode: str, fault: str
) -> None:
    cp = control_plane
    await kube.create_cr(cp_body())
    async with guarded(cp, kube, tmp_path, mode) as rig:
        await settle(rig.svc)
        await until_served(rig)
        assert rig.status["failsOpen"] is False
        assert rig.status["probe"]["delete"]["target"] in NAMES
        before = await kept(kube)
        writes = apiserver_write_count(cp, ("services", "servicemonitors"))
        dry_runs = apiserver_dry_run_count(cp)
        failed_open = fail_open_calls(cp, DELETE_GUARD)

        await make_unreachable(rig, fault)
        await rig.checks(2)
        assert rig.reason("delete") == "fails_open", rig.status["probe"]
        # the update guard: the policy is applied inside the API server; the webhook is not
        assert rig.reason("update") == ("served" if mode == "policy" else "fails_open")
        assert rig.status["failsOpen"] is True
        # the alert's series: the leader's verdict
        assert (
            metric(rig.svc, "shared_svc_admission_guard_probe", guard="delete", reason="fails_open")
            == 1
        )
        assert (
            metric(rig.svc, "shared_svc_admission_guard_probe", guard="delete", reason="served")
            == 0
        )
        validating = (
            "ValidatingWebhookConfiguration",
            rig.guard_name("ValidatingWebhookConfiguration"),
        )
        warned = await eventually(lambda: warnings(kube, *validating), timeout=15)
        assert all(e["type"] == "Warning" for e in warned)
        assert all("delete guard" in e["note"] and "fails_open" in e["note"] for e in warned)
        if mode == "webhook":
            mutating = (
                "MutatingWebhookConfiguration",
                rig.guard_name("MutatingWebhookConfiguration"),
            )
            assert await warnings(kube, *mutating)
        episode = occurrences(warned)
        # the API server agrees: it counted calls to the delete guard that failed open
        assert fail_open_calls(cp, DELETE_GUARD) > failed_open

        await make_reachable(rig, fault)
        await rig.checks(2)
        assert await served(rig), rig.status["probe"]
        assert rig.status["failsOpen"] is False
        assert (
            metric(rig.svc, "shared_svc_admission_guard_probe", guard="delete", reason="fails_open")
            == 0
        )
        await rig.checks(2)
        # one Warning for the episode, not one per check
        assert occurrences(await warnings(kube, *validating)) == episode

        # nothing the probes did changed or deleted an object: only dry runs
        assert await kept(kube) == before
        own = 2 if fault == "service-to-nothing" else 0  # the test's patches of its Service
        assert apiserver_write_count(cp, ("services", "servicemonitors")) == writes + own
        assert apiserver_dry_run_count(cp) > dry_runs


async def test_the_probe_command_passes_on_a_served_guard_and_fails_on_an_unreachable_one(
    control_plane: ControlPlane, kube: Kube, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``shared-svc admission probe`` (the chart's ``helm test``), as shared-svc's
    ServiceAccount: exit 0 while the guard is served, 1 while it fails open."""
    await kube.create_cr(cp_body())
    async with guarded(control_plane, kube, tmp_path, "webhook") as rig:
        await settle(rig.svc)
        await until_served(rig)

        def probe() -> Callable[[], Awaitable[int]]:
            args = [
                "admission",
                "probe",
                "--namespace",
                kube.ns,
                "--kubeconfig",
                str(rig.kubeconfig),
            ]
            return lambda: asyncio.to_thread(main, args)

        assert await probe()() == 0
        out = capsys.readouterr().out
        assert "delete guard: served" in out and "update guard: served" in out
        before = await kept(kube)
        await rig.point_service_at("127.0.0.2")
        await rig.checks(1)
        assert await probe()() == 1
        out = capsys.readouterr().out
        assert "delete guard: fails_open" in out and "update guard: fails_open" in out
        await rig.point_service_at("127.0.0.1")
        assert await eventually(lambda: _zero(probe()), timeout=30)
        assert await kept(kube) == before


async def _zero(run: Callable[[], Awaitable[int]]) -> bool:
    return await run() == 0


async def test_the_guard_never_blocks_shared_svcs_own_deletes(
    control_plane: ControlPlane, kube: Kube, tmp_path: Path
) -> None:
    """The matchConditions admit shared-svc's dry runs only: once no CR needs the Services,
    shared-svc's real deletes go through the served guard."""
    await kube.create_cr(cp_body())
    async with guarded(control_plane, kube, tmp_path, "webhook") as rig:
        await settle(rig.svc)
        await until_served(rig)
        await kube.delete_cr("ClusterPolicy", "cluster-policy")
        await settle(rig.svc)
        assert set(await kube.services()) == {WEBHOOK_SERVICE}, "shared-svc deleted its Services"
        await rig.checks(2)
        assert rig.reason("delete") == "not_probed"  # nothing to guard


async def test_a_policy_the_api_server_no_longer_applies_is_reported_failing_open(
    control_plane: ControlPlane, kube: Kube, tmp_path: Path
) -> None:
    """Policy mode: the MutatingAdmissionPolicy gone from under its binding (the binding
    is what shared-svc lists): the update guard fails open; the delete guard is served."""
    cp = control_plane
    await kube.create_cr(cp_body())
    async with guarded(cp, kube, tmp_path, "policy") as rig:
        await settle(rig.svc)
        await until_served(rig)
        binding = (
            "MutatingAdmissionPolicyBinding",
            rig.guard_name("MutatingAdmissionPolicyBinding"),
        )
        before = occurrences(await warnings(kube, *binding))  # a guard being loaded at start
        [policy] = [d for d in rig.docs if d["kind"] == "MutatingAdmissionPolicy"]
        path = f"{ADMISSION_API}/mutatingadmissionpolicies/{policy['metadata']['name']}"
        code, _ = cp.request("DELETE", path)
        assert code == 200
        await eventually(lambda: _reason_is(rig, "update", "fails_open"), timeout=30)
        await rig.checks(1)
        assert rig.reason("delete") == "served" and rig.status["failsOpen"] is True

        async def warned() -> list[dict[str, Any]]:
            found = await warnings(kube, *binding)
            return found if occurrences(found) > before else []

        assert all("update guard" in e["note"] for e in await eventually(warned, timeout=15))
        install(cp, [policy])
        await until_served(rig)


async def _reason_is(rig: Rig, guard: str, reason: str) -> bool:
    await asyncio.sleep(0)
    return rig.reason(guard) == reason


async def test_only_the_leader_probes(
    control_plane: ControlPlane, kube: Kube, tmp_path: Path
) -> None:
    """Two replicas: the leader probes and says served; the standby sends no dry run and
    says not_probed, so the alert's max is the leader's verdict."""
    await kube.create_cr(cp_body())
    async with guarded(control_plane, kube, tmp_path, "webhook", leader_election=True) as rig:
        await eventually(lambda: _leads(rig.svc), timeout=30)
        standby_config = rig.config.model_copy(
            update={"pod_name": "shared-svc-standby", "webhook_port": free_port()}
        )
        async with running(standby_config) as standby:
            await settle(rig.svc)
            await until_served(rig)
            assert standby.admission is not None
            monitor = standby.admission.monitor
            start = monitor.checks
            await eventually(lambda: _checked(monitor, start + 2), timeout=30)
            assert not standby.is_leader()
            status = standby.status()["admissionGuard"]
            assert {g: v["reason"] for g, v in status["probe"].items()} == {
                "delete": "not_probed",
                "update": "not_probed",
            }
            assert status["failsOpen"] is None
            name = "shared_svc_admission_guard_probe"
            assert metric(standby, name, guard="delete", reason="not_probed") == 1
            assert metric(standby, name, guard="delete", reason="fails_open") == 0
            assert metric(rig.svc, name, guard="delete", reason="served") == 1


async def _leads(svc: Service) -> bool:
    await asyncio.sleep(0)
    return svc.is_leader()


async def _checked(monitor: Any, n: int) -> bool:
    await asyncio.sleep(0)
    return bool(monitor.checks >= n)
