"""The Services controller's process life: two replicas and the Lease handover, a graceful
stop and SIGTERM, the order parts start and stop in (the shared caches among them, each
listed once and all at once), a crashed controller, the HTTP endpoints, the upgrade
controller inside the service, and bad configuration or kubeconfig (one line, exit 2)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import ssl
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import testenv
from shared_svc.controllers.services import caches
from shared_svc.controllers.services.reconciler import ServicesReconciler
from shared_svc.controllers.upgrade import caches as upgrade_caches
from shared_svc.controllers.upgrade.caches import node_resources
from shared_svc.kube.registry import CacheRunnable
from shared_svc.kube.writer import raw_request
from shared_svc.runtime.controller import Controller
from shared_svc.service import Service
from testenv import ControlPlane
from tests.apiproxy import ThrottlingProxy, kubeconfig_via
from tests.kube import eventually
from tests.svc import (
    Kube,
    cp_body,
    http_get,
    running,
    service_config,
    services_runtime,
    settle,
)


@pytest.mark.apiserver
async def test_a_crashed_controller_exits_non_zero_after_releasing_the_lease(
    control_plane: ControlPlane, kube: Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shared_svc.service import ControllerCrashed

    async def crash(self: Controller[str], stop: asyncio.Event) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(Controller, "run", crash)
    config = service_config(control_plane, kube.ns, leader_election=True, pod_name="crashy")
    with pytest.raises(ControllerCrashed, match="boom"):
        async with running(config) as svc:
            await asyncio.sleep(1.0)
            assert svc.elector is not None


@pytest.mark.apiserver
def test_run_exits_1_with_one_line_when_a_controller_crashes(control_plane: ControlPlane) -> None:
    code = (
        "import asyncio, sys\n"
        "from shared_svc.runtime.controller import Controller\n"
        "async def crash(self, stop): raise RuntimeError('boom')\n"
        "Controller.run = crash\n"
        "from shared_svc.cli import main\n"
        f"sys.exit(main(['run', '--kubeconfig', {str(control_plane.kubeconfig)!r}, '--port', '0',"
        " '--leader-election', 'false', '--namespace', 'crash']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert (
        proc.stderr.strip().splitlines()[-1]
        == "shared-svc: a controller ended unexpectedly: RuntimeError('boom')"
    )


@pytest.mark.apiserver
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


@pytest.mark.apiserver
async def test_a_replica_is_ready_only_once_it_has_planned(
    control_plane: ControlPlane, kube: Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every replica serves the delete guard's webhook, which answers from the last plan
    (``needed_by``; none yet: allowed). Synced caches are not enough for Ready: a pod
    taking the API server's calls before its first plan would let gpu-operator's delete
    through."""
    hold = asyncio.Event()
    planning = asyncio.Event()
    original = ServicesReconciler._plan_and_act

    async def held(self: ServicesReconciler, world: Any) -> tuple[str, int]:
        planning.set()
        await hold.wait()
        return await original(self, world)

    monkeypatch.setattr(ServicesReconciler, "_plan_and_act", held)
    await kube.create_cr(cp_body())
    async with running(service_config(control_plane, kube.ns)) as svc:
        try:
            await asyncio.wait_for(planning.wait(), timeout=30)
            ctrl = svc.controller
            assert ctrl is not None and ctrl.caches_synced() and ctrl.needed_by() is None
            # every other part ready (ServiceMonitor discovery may still switch its cache)
            others = [r for r in svc.runnables() if r is not services_runtime(svc)]
            await eventually(lambda: _true(all(r.ready() for r in others)), timeout=30)
            port = svc.port or 0
            assert (await http_get(port, "/readyz"))[0] == 503
            assert not svc.ready()
        finally:
            hold.set()
        await eventually(lambda: _true(svc.ready()), timeout=30)
        assert (await http_get(port, "/readyz"))[0] == 200
        needed = ctrl.needed_by()
        assert needed is not None
        assert needed[("Service", "nvidia-dcgm")] == ("ClusterPolicy/cluster-policy",)


@pytest.mark.apiserver
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


async def lease_of(kube: Kube, name: str) -> dict[str, Any]:
    lease: dict[str, Any] = await raw_request(
        kube.api, "GET", f"/apis/coordination.k8s.io/v1/namespaces/{kube.ns}/leases/{name}"
    )
    return lease


@pytest.mark.apiserver
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
    lease = await lease_of(kube, "shared-svc")
    assert lease["spec"]["holderIdentity"] == ""


@pytest.mark.apiserver
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
    # Its own process: what the caches listed is frozen out of the collector's scans
    # once they have synced (runtime/heap.py), once here (no cache re-listed).
    frozen = [json.loads(line) for line in log.splitlines() if "are frozen out of" in line]
    assert len(frozen) == 1 and frozen[0]["objects"] > 10_000, log


ListKey = tuple[str, str]  # (collection path, label selector) of a list request


class ListingProxy(ThrottlingProxy):
    """Counts the lists sent through it (``lists``: a GET of a collection with ``limit``,
    not a watch) and holds each list of ``held`` until every one of them has arrived
    (``most_in_flight``: how many were held at once; after ``HOLD_SECONDS`` a list goes on
    anyway, so lists sent one after another are seen, not hung)."""

    HOLD_SECONDS = 20.0

    def __init__(self, cp: ControlPlane) -> None:
        super().__init__(cp)
        self.lists: Counter[ListKey] = Counter()
        self.held: set[ListKey] = set()
        self._in_flight: set[ListKey] = set()
        self.most_in_flight = 0
        self._all_in = asyncio.Event()

    async def _handle(self, request: Any) -> Any:
        query = request.query
        if request.method == "GET" and "limit" in query and "watch" not in query:
            key = (request.rel_url.path, query.get("labelSelector", ""))
            self.lists[key] += 1
            if key in self.held and not self._all_in.is_set():
                self._in_flight.add(key)
                self.most_in_flight = max(self.most_in_flight, len(self._in_flight))
                if self._in_flight == self.held:
                    self._all_in.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._all_in.wait(), self.HOLD_SECONDS)
        return await super()._handle(request)


def list_keys(cache: CacheRunnable) -> set[ListKey]:
    """The lists of one cache: one per label selector (a union: one per part)."""
    r = cache.cache.resource
    return {(r.path, selector) for selector in (r.any_of or (r.label_selector or "",))}


@pytest.mark.apiserver
async def test_every_cache_is_listed_once_and_all_at_once_though_both_controllers_read_some(
    control_plane: ControlPlane, kube: Kube, tmp_path: Path
) -> None:
    """The Manager starts the shared registry's caches (issue 21): DaemonSets and
    ClusterPolicies, read by both controllers, are listed once; every cache's first list
    is in flight before any is answered (start-up time, issue 22)."""
    config = service_config(control_plane, kube.ns, upgrade_controller=True)
    declared = caches.declare(config)
    expected = [
        *declared.values(),
        *node_resources("gpu"),
        upgrade_caches.NVIDIA_DRIVERS,
        upgrade_caches.NVIDIA_DRIVER_CRD_RESOURCE,
    ]
    proxy = await ListingProxy.start(control_plane)
    proxy.held = {
        (r.path, selector) for r in expected for selector in (r.any_of or (r.label_selector or "",))
    }
    config = config.model_copy(
        update={"kubeconfig": str(kubeconfig_via(control_plane, proxy.url, tmp_path / "kc"))}
    )
    try:
        async with running(config) as svc:
            await eventually(lambda: _true(svc.ready()), timeout=40)
            assert svc.manager is not None
            cache_runnables = [r for r in svc.manager.runnables if isinstance(r, CacheRunnable)]
            lists = dict(proxy.lists)
    finally:
        await proxy.close()
    assert [c.cache.resource for c in cache_runnables] == expected, "each cache once"
    assert (
        set().union(*map(list_keys, cache_runnables))
        == proxy.held
        == {(declared["pods"].path, s) for s in declared["pods"].any_of}
        | {(r.path, r.label_selector or "") for r in expected if not r.any_of}
    )
    assert {key: lists.get(key) for key in proxy.held} == dict.fromkeys(proxy.held, 1)
    assert proxy.most_in_flight == len(proxy.held) == 14, "every cache lists at once"


@pytest.mark.apiserver
@pytest.mark.parametrize("compression", [False, True], ids=["default", "api_compression"])
async def test_the_api_server_is_asked_for_uncompressed_answers_unless_configured(
    control_plane: ControlPlane, kube: Kube, tmp_path: Path, compression: bool
) -> None:
    """The API server gzips a list answer over 128 KiB for a client that accepts it, as
    aiohttp does by default: more than half of its CPU while a 5,000-node fleet's caches
    listed (issue 22). By default every request of ``run`` accepts only ``identity``,
    and the pod cache's first list (a pod of 200 KiB) comes uncompressed;
    ``api_compression`` gives aiohttp's default back, and that answer is gzipped."""
    await kube.core.create_namespaced_pod(
        kube.ns,
        {
            "metadata": {
                "name": "big-dcgm",
                "labels": {"app": "nvidia-dcgm"},
                "annotations": {"filler": "x" * 200_000},
            },
            "spec": {"nodeName": "node-1", "containers": [{"name": "c", "image": "i"}]},
        },
    )
    proxy = await ThrottlingProxy.start(control_plane)
    config = service_config(control_plane, kube.ns).model_copy(
        update={
            "kubeconfig": str(kubeconfig_via(control_plane, proxy.url, tmp_path / "kc")),
            "api_compression": compression,
        }
    )
    pods = f"/api/v1/namespaces/{kube.ns}/pods"
    try:
        async with running(config) as svc:
            await eventually(lambda: _true(svc.ready()), timeout=40)
            seen = list(proxy.encodings)
    finally:
        await proxy.close()
    pod_lists = [answered for path, _, answered in seen if path == pods]
    assert pod_lists, seen
    if compression:
        assert all("gzip" in asked for _, asked, _ in seen), seen
        assert "gzip" in pod_lists, seen
    else:
        assert {asked for _, asked, _ in seen} == {"identity"}, seen
        assert set(pod_lists) == {""}, seen


@pytest.mark.apiserver
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
    # The caches of the shared registry, each once (DaemonSets and ClusterPolicies are read
    # by both controllers), in the order first asked for, before their readers.
    state, parked = (r.label_selector for r in node_resources("gpu"))
    assert started == [
        "http",
        "lease",
        "cache ClusterPolicy",
        "cache GPUCluster",
        f"cache Service in {kube.ns}",
        "cache DaemonSet",
        f"cache Pod in {kube.ns}",
        f"cache Node ({state})",
        f"cache Node ({parked})",
        "cache NVIDIADriver",
        "cache CustomResourceDefinition",
        "admission-webhook",
        "webhook-certificate",
        "admission-guard",
        "servicemonitor-discovery",
        f"cache ServiceMonitor in {kube.ns}",  # switched on by discovery while served
        "shared-services",
        "upgrade-gate",
        "upgrade",
    ]
    # SIGTERM: the controllers first, then the gate's review, the ServiceMonitor cache and
    # discovery, then the guard's parts, then the caches, then the Lease (released), then
    # the HTTP server.
    assert svc.manager.stopped == started[::-1]
    assert svc.elector is not None and not svc.elector.is_leader
    lease = await lease_of(kube, config.lease_name)
    assert lease["spec"]["holderIdentity"] == "", "released"


@pytest.mark.apiserver
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


@pytest.mark.apiserver
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


@pytest.mark.apiserver
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


@pytest.mark.apiserver
async def test_a_tls_connection_to_the_api_server_reads_into_64_kib_not_256(
    control_plane: ControlPlane, kube: Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    """asyncio gives each TLS connection a read buffer of ``SSLProtocol.max_size``, 256 KiB:
    a wave's 100 connections held 25 MiB of them (issue 22). ``run`` makes it 64 KiB, and
    the client's lists still read whole."""
    from asyncio import sslproto

    from shared_svc.kubeconfig import TLS_READ_BUFFER_BYTES, small_tls_reads

    monkeypatch.setattr(sslproto.SSLProtocol, "max_size", 256 * 1024)  # restored after
    small_tls_reads()
    assert sslproto.SSLProtocol.max_size == TLS_READ_BUFFER_BYTES == 64 * 1024
    host, port = control_plane.url.removeprefix("https://").split(":")
    ctx = ssl.create_default_context(cafile=str(control_plane.workdir / "certs" / "apiserver.crt"))
    transport, _ = await asyncio.get_running_loop().create_connection(
        asyncio.Protocol, host, int(port), ssl=ctx
    )
    try:
        assert len(transport._ssl_protocol._ssl_buffer) == 64 * 1024  # type: ignore[attr-defined]
    finally:
        transport.close()
    big = {"filler": "x" * 200_000}
    await kube.core.create_namespaced_config_map(
        kube.ns, {"metadata": {"name": "big", "annotations": big}}
    )
    listed = await raw_request(kube.api, "GET", f"/api/v1/namespaces/{kube.ns}/configmaps")
    assert [
        m["metadata"]["annotations"] for m in listed["items"] if m["metadata"]["name"] == "big"
    ] == [big]
