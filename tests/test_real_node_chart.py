"""The chart and the image as users run them, on the real node (issue 30, items 1-4): the
checkout's chart with its defaults installed by the helm CLI, the project's image built
from the Dockerfile, two pods under a real kubelet, the webhook called by kube-apiserver
through the chart's Service, the hook Jobs making the certificate, the probes deciding
readiness, the leader handing over when its pod goes.

gpu-operator is played by the test under its own ServiceAccount, as in
tests/test_admission_guard.py (``SimulatedOperator``). The tests of this module run in
order on one release: install, failover, upgrade, uninstall; each needs only the release
(the module's fixture installs it when a test runs alone)."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest

from testenv.node import Node
from tests.admission import ADMISSION_API
from tests.kube import eventually
from tests.real_node import (
    CHART,
    IMAGE,
    NS,
    REBUILT,
    RELEASE,
    SELECTOR,
    SERVICES,
    OperatorWorld,
    container_pids,
    get,
    gpu_operator_world,
    guard_answers,
    guard_holds,
    helm,
    holder,
    install,
    lease,
    leases_of,
    pod_status,
    pods,
    pods_of,
    process_identity,
    ready,
    service,
    services_of,
    uninstall,
    watching,
)

pytestmark = pytest.mark.node

GUARD = f"{RELEASE}-{NS}-guard"


@pytest.fixture(scope="module")
async def world(
    real_node: Node, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[OperatorWorld]:
    w = await gpu_operator_world(real_node.control_plane, NS, tmp_path_factory.mktemp("operator"))
    try:
        yield w
    finally:
        await w.writer.close()


class Release:
    """The module's release: installed once (lazily), uninstalled at the end if a test
    has not done it."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.installed = False
        self.output = ""

    async def ensure(self) -> None:
        """Installed, and both replicas Ready (an earlier test's roll or eviction done)."""
        if not self.installed:
            self.output = install(self.node)
            self.installed = True
        cp = self.node.control_plane
        await eventually(
            lambda: asyncio.sleep(0, len([p for p in pods(cp) if ready(p)]) == 2), timeout=180
        )


@pytest.fixture(scope="module")
def release(real_node: Node, world: OperatorWorld) -> Any:
    r = Release(real_node)
    try:
        yield r
    finally:
        uninstall(real_node)


class DeleteProbe:
    """gpu-operator's delete of ``nvidia-dcgm`` (a dry run), every 0.2 s while the block
    runs: ``answers`` are the codes, ``fail_open`` the API server's calls of the guard that
    reached no server meanwhile (its ``apiserver_admission_webhook_fail_open_count``)."""

    def __init__(self, cp: Any, world: OperatorWorld) -> None:
        self.cp, self.world = cp, world
        self.answers: list[int] = []
        self.fail_open = 0.0

    async def __aenter__(self) -> DeleteProbe:
        self._before = guard_answers(self.cp).get("fail-open", 0)
        self._done = asyncio.Event()
        self._task = asyncio.create_task(self._probe())
        return self

    async def _probe(self) -> None:
        while not self._done.is_set():
            self.answers.append(await self.world.writer.delete("nvidia-dcgm", dry_run=True))
            await asyncio.sleep(0.2)

    async def __aexit__(self, *_: object) -> None:
        self._done.set()
        await self._task
        self.fail_open = guard_answers(self.cp).get("fail-open", 0) - self._before

    def held(self) -> bool:
        """Every delete answered 404 by a serving replica."""
        return bool(self.answers) and set(self.answers) == {404} and self.fail_open == 0


def deployment(node: Node) -> dict[str, Any]:
    body = get(node.control_plane, f"/apis/apps/v1/namespaces/{NS}/deployments/{RELEASE}")
    assert body is not None
    return body


async def test_chart_defaults_on_the_built_image_install_serve_the_guard_and_adopt(
    real_node: Node, world: OperatorWorld, release: Release
) -> None:
    cp = real_node.control_plane
    await release.ensure()  # helm install --wait: hook Jobs, then the Deployment Ready

    # 2/2 Ready, decided by the chart's probes, on the image built from the Dockerfile.
    status = deployment(real_node)["status"]
    assert (status.get("readyReplicas"), status.get("availableReplicas")) == (2, 2), status
    running = pods(cp)
    assert len(running) == 2 and all(ready(p) for p in running), running
    for pod in running:
        (container,) = pod["spec"]["containers"]
        assert container["image"] == IMAGE
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
        (state,) = pod["status"]["containerStatuses"]
        assert state["ready"] and state["restartCount"] == 0, state
        assert state["image"] == f"docker.io/library/{IMAGE}", state
    # The processes run as the image's user, on a read-only root (the host's view of them).
    for pid in container_pids(real_node, running):
        uids, root_options = process_identity(pid)
        assert uids == ["65532"] * 4, uids
        assert "ro" in root_options, root_options

    # The service reads its settings from the chart's environment, and nothing else: no
    # Service of the namespace adds SHARED_SVC_* variables (Docker links).
    for pod in running:
        status, log = cp.request(
            "GET", f"/api/v1/namespaces/{NS}/pods/{pod['metadata']['name']}/log"
        )
        assert status == 200 and "is not a setting" not in str(log), log

    # One leader holds the Lease: one of the two pods, and only it says so.
    names = {p["metadata"]["name"] for p in running}
    leader = holder(cp)
    assert leader in names
    says = {n: pod_status(cp, n)["leader"] for n in names}
    assert says == {n: n == leader for n in names}, says

    # The certificate hook Jobs ran: the Secret they make, the caBundle they patched (the
    # chart renders none), the Jobs' completion (deleted by their hook-succeeded policy).
    secret = get(cp, f"/api/v1/namespaces/{NS}/secrets/{RELEASE}-webhook-tls")
    assert secret is not None and secret["type"] == "kubernetes.io/tls"
    validating = get(cp, f"{ADMISSION_API}/validatingwebhookconfigurations/{GUARD}")
    assert validating is not None
    ca_bundle = validating["webhooks"][0]["clientConfig"]["caBundle"]
    assert ca_bundle == secret["data"]["ca.crt"] and base64.b64decode(ca_bundle).startswith(
        b"-----BEGIN"
    )
    events = get(cp, f"/api/v1/namespaces/{NS}/events") or {"items": []}
    completed = {
        e["involvedObject"]["name"]
        for e in events["items"]
        if e["involvedObject"]["kind"] == "Job" and e["reason"] == "Completed"
    }
    assert {f"{RELEASE}-certs-pre", f"{RELEASE}-certs-post"} <= completed, completed
    # Kubernetes 1.36 serves the MutatingAdmissionPolicy: auto rendered it, not the webhook.
    assert get(cp, f"{ADMISSION_API}/mutatingadmissionpolicybindings/{GUARD}") is not None
    assert get(cp, f"{ADMISSION_API}/mutatingwebhookconfigurations/{GUARD}") is None

    # gpu-operator's Services adopted: same objects, same clusterIPs, our shape.
    for name in SERVICES:
        live = service(cp, name)
        assert live is not None
        assert live["metadata"]["uid"] == world.uid(name)
        assert live["spec"]["clusterIP"] == world.cluster_ip(name)
        assert live["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "shared-svc"
        refs = live["metadata"]["ownerReferences"]
        assert [r["uid"] for r in refs] == [world.owner["metadata"]["uid"]]
        assert not any(r.get("controller") for r in refs), refs

    # The guard, served by the pods behind the chart's Service: gpu-operator's delete of a
    # Service its ClusterPolicy needs is answered 404 and changes nothing, its whole-object
    # PUT changes nothing (the policy puts our shape back).
    await guard_holds(cp, world)


async def test_failover_by_pod_delete_and_by_container_kill_converges_once(
    real_node: Node, world: OperatorWorld, release: Release
) -> None:
    cp = real_node.control_plane
    await release.ensure()
    first = holder(cp)
    patch = "/apis/nvidia.com/v1/clusterpolicies/cluster-policy"

    def set_traffic_policy(value: str) -> None:
        body = {"spec": {"dcgmExporter": {"service": {"internalTrafficPolicy": value}}}}
        status, out = cp.request("PATCH", patch, body, content_type="application/merge-patch+json")
        assert status == 200, out

    def exporter_policy() -> str:
        live = service(cp, "nvidia-dcgm-exporter") or {}
        return str(live.get("spec", {}).get("internalTrafficPolicy"))

    async with (
        watching(cp, services_of, NS) as services,
        watching(cp, leases_of, NS) as leases,
    ):
        # 1. The leader's pod deleted: it releases the Lease on SIGTERM and another replica
        #    takes it: the standby (warm caches) or the Deployment's replacement pod,
        #    whichever campaigns first; a CR change made meanwhile converges.
        #    gpu-operator's deletes meanwhile all meet a serving replica (the stopping pod
        #    serves through its preStop sleep).
        def new_leader() -> bool:
            lead = holder(cp)
            return (
                bool(lead) and lead != first and lead in {p["metadata"]["name"] for p in pods(cp)}
            )

        async with DeleteProbe(cp, world) as probe:
            status, out = cp.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{first}")
            assert status == 200, out
            set_traffic_policy("Local")
            await eventually(lambda: asyncio.sleep(0, new_leader()), timeout=60, interval=0.2)
            await eventually(
                lambda: asyncio.sleep(0, first not in {p["metadata"]["name"] for p in pods(cp)}),
                timeout=90,
            )
        assert probe.held(), (probe.fail_open, probe.answers)
        other = holder(cp)
        await eventually(lambda: asyncio.sleep(0, exporter_policy() == "Local"), timeout=60)

        def holders_seen() -> list[str]:
            return [o["spec"].get("holderIdentity") or "" for _, o in leases.of("shared-svc")]

        # the watch may deliver the hand-over after the GET above shows it
        await eventually(lambda: asyncio.sleep(0, other in holders_seen()), timeout=30)
        holders = holders_seen()
        assert first in holders and "" in holders[holders.index(first) :], (
            f"the Lease went from {first} to {other} without being released: {holders}"
        )

        # 2. The new leader's container killed (no SIGTERM, no release): the kubelet
        #    restarts it; a leader is back (the Lease expires, or the restarted container,
        #    the same identity, takes it again) and a second CR change converges.
        leader_pod = next(p for p in pods(cp) if p["metadata"]["name"] == other)
        (pid,) = container_pids(real_node, [leader_pod])
        os.kill(pid, signal.SIGKILL)
        set_traffic_policy("Cluster")

        async def restarted() -> bool:
            pod = next((p for p in pods(cp) if p["metadata"]["name"] == other), None)
            return bool(
                pod and pod["status"]["containerStatuses"][0]["restartCount"] == 1 and ready(pod)
            )

        await eventually(restarted, timeout=180, interval=0.5)
        await eventually(lambda: asyncio.sleep(0, exporter_policy() == "Cluster"), timeout=120)
        names = {p["metadata"]["name"] for p in pods(cp) if ready(p)}
        await eventually(lambda: asyncio.sleep(0, holder(cp) in names), timeout=60)
        renewed = lease(cp)["spec"]["renewTime"]
        await eventually(
            lambda: asyncio.sleep(0, lease(cp)["spec"]["renewTime"] != renewed), timeout=30
        )
        await asyncio.sleep(2)  # a late duplicate write would show in the watch now

    # Nothing written twice, nothing lost: one change of the exporter Service per CR
    # change (the standby did not write before it led, the new leader did not repeat the
    # old one's write), none of nvidia-dcgm.
    assert services.kinds("nvidia-dcgm") == ["ADDED"], services.of("nvidia-dcgm")
    changes = services.of("nvidia-dcgm-exporter")
    policies = [o["spec"]["internalTrafficPolicy"] for _, o in changes]
    assert [t for t, _ in changes] == ["ADDED", "MODIFIED", "MODIFIED"], changes
    assert policies == ["Cluster", "Local", "Cluster"], policies
    for name in SERVICES:
        live = service(cp, name)
        assert live is not None and live["metadata"]["uid"] == world.uid(name)


async def test_helm_upgrade_to_a_rebuilt_image_keeps_the_guard_and_the_services(
    real_node: Node, world: OperatorWorld, release: Release
) -> None:
    cp = real_node.control_plane
    await release.ensure()
    old = {p["metadata"]["name"]: p["status"]["containerStatuses"][0]["imageID"] for p in pods(cp)}
    before = {n: service(cp, n) for n in SERVICES}

    async with (
        watching(cp, services_of, NS) as services,
        watching(cp, pods_of, NS, label_selector=SELECTOR) as rolled,
        DeleteProbe(cp, world) as probe,  # gpu-operator's delete, all through the roll
    ):
        await asyncio.to_thread(
            helm, real_node, "upgrade", RELEASE, str(CHART), "-n", NS, "--reset-then-reuse-values",
            "--set", f"image.tag={REBUILT}", "--wait", "--timeout", "5m",
        )  # fmt: skip
        new = {p["metadata"]["name"] for p in pods(cp)}
        await eventually(
            lambda: asyncio.sleep(0, len([p for p in pods(cp) if ready(p)]) == 2), timeout=120
        )
        # The old pods gone, not only terminating (each serves through its preStop sleep,
        # then stops: the probe runs until then).
        await eventually(
            lambda: asyncio.sleep(0, not set(old) & {p["metadata"]["name"] for p in pods(cp)}),
            timeout=120,
        )
        await asyncio.sleep(1)

    # The new pods run the rebuilt image.
    now = pods(cp)
    assert len(now) == 2 and not set(old) & {p["metadata"]["name"] for p in now}, (old, new)
    for pod in now:
        state = pod["status"]["containerStatuses"][0]
        assert pod["spec"]["containers"][0]["image"] == f"shared-svc:{REBUILT}"
        assert state["imageID"] not in old.values(), state
    # One replica stayed Ready at every moment of the roll (the PodDisruptionBudget's
    # minAvailable 1): replay the pod watch.
    readiness: dict[str, bool] = {}
    counts = []
    for i, (kind, pod) in enumerate(rolled.events):
        readiness[pod["metadata"]["name"]] = kind != "DELETED" and ready(pod)
        if i + 1 >= rolled.listed:
            counts.append(sum(readiness.values()))
    assert len(counts) > 4 and min(counts) >= 1, f"ready replicas after each event: {counts}"
    # The guard served throughout: no delete got through while the pods rolled, and no
    # call of the API server's found a stopped server (the preStop sleep; a new pod Ready
    # only once it has planned).
    assert probe.held(), (probe.fail_open, probe.answers)
    # No Service changed.
    assert services.kinds("nvidia-dcgm") == ["ADDED"] and services.kinds(
        "nvidia-dcgm-exporter"
    ) == ["ADDED"]
    for name in SERVICES:
        assert service(cp, name) == before[name]

    # The PodDisruptionBudget holds: of two evictions in a row, the second is refused.
    names = [p["metadata"]["name"] for p in now]
    codes = []
    for name in names:
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": NS},
        }
        codes.append(cp.request("POST", f"/api/v1/namespaces/{NS}/pods/{name}/eviction", body)[0])
    assert codes == [201, 429], codes
    await release.ensure()  # the evicted replica replaced


async def test_helm_uninstall_removes_the_guard_first_and_leaves_the_services(
    real_node: Node, world: OperatorWorld, release: Release
) -> None:
    cp = real_node.control_plane
    await release.ensure()
    before = {n: service(cp, n) for n in SERVICES}
    leaders = {p["metadata"]["name"] for p in pods(cp)}
    guard_gone_while: list[bool] = []

    async def watch_guard() -> None:
        # when the validating webhook configuration goes, the Deployment still serves it
        async def gone() -> bool:
            return get(cp, f"{ADMISSION_API}/validatingwebhookconfigurations/{GUARD}") is None

        await eventually(gone, timeout=180, interval=0.05)
        deploy = get(cp, f"/apis/apps/v1/namespaces/{NS}/deployments/{RELEASE}")
        guard_gone_while.append(deploy is not None)

    task = asyncio.create_task(watch_guard())
    await asyncio.to_thread(
        helm, real_node, "uninstall", RELEASE, "-n", NS, "--wait", "--timeout", "3m"
    )
    await asyncio.wait_for(task, timeout=30)
    release.installed = False
    assert guard_gone_while == [True], "the guard must go before the Deployment"

    # The guard and its certificate, the Deployment, the webhook and metrics Services, the
    # PodDisruptionBudget, the RBAC objects: gone.
    for path in (
        f"{ADMISSION_API}/validatingwebhookconfigurations/{GUARD}",
        f"{ADMISSION_API}/mutatingwebhookconfigurations/{GUARD}",
        f"{ADMISSION_API}/mutatingadmissionpolicybindings/{GUARD}",
        f"{ADMISSION_API}/mutatingadmissionpolicies/{GUARD}",
        f"/api/v1/namespaces/{NS}/secrets/{RELEASE}-webhook-tls",
        f"/apis/apps/v1/namespaces/{NS}/deployments/{RELEASE}",
        f"/api/v1/namespaces/{NS}/services/{RELEASE}-webhook",
        f"/api/v1/namespaces/{NS}/services/{RELEASE}-metrics",
        f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/{RELEASE}",
        f"/api/v1/namespaces/{NS}/serviceaccounts/{RELEASE}",
        f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{RELEASE}",
    ):
        assert get(cp, path) is None, path
    await eventually(lambda: asyncio.sleep(0, pods(cp) == []), timeout=120)
    # The Lease stays with its last holder, no longer renewed: Helm deleted the Role in the
    # same pass as the Deployment, so the leader's release on SIGTERM was refused (403).
    left = lease(cp)["spec"]
    assert left.get("holderIdentity") in leaders, (left, leaders)
    await asyncio.sleep(3)  # a renewal (retry period 2 s) would show now
    assert lease(cp)["spec"]["renewTime"] == left["renewTime"]
    # The shared DCGM Services stay as they were: same objects, clusterIPs, our shape.
    for name in SERVICES:
        assert service(cp, name) == before[name]
    # With the guard gone, gpu-operator takes them back on its next reconcile.
    assert await world.writer.delete("nvidia-dcgm", dry_run=True) == 200
    taken = await world.writer.put("nvidia-dcgm-exporter")
    assert (
        taken["metadata"]["resourceVersion"]
        != before["nvidia-dcgm-exporter"]["metadata"]["resourceVersion"]
    )  # type: ignore[index]
    assert [r.get("controller") for r in taken["metadata"]["ownerReferences"]] == [True]
