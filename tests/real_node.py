"""Helpers of the tests on the real node (tests/test_real_node_*.py, marker ``node``): the
chart installed with the helm CLI from the checkout, gpu-operator's Services and writes
(``SimulatedOperator``, under its own ServiceAccount), pods run from the project's image,
the API server's admission metrics, and watches recorded while something happens."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client import ApiClient

from shared_svc import __version__
from testenv import ControlPlane
from testenv.node import CGROUP_ROOT, Node, cgroup_mounts
from testenv.workloads import cp_body
from tests.admission import SimulatedOperator, guard_effective
from tests.kube import api_client, eventually

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy" / "chart" / "shared-svc"
NS = "gpu-operator"
RELEASE = "shared-svc"
SERVICES = ("nvidia-dcgm", "nvidia-dcgm-exporter")
SELECTOR = f"app.kubernetes.io/name=shared-svc,app.kubernetes.io/instance={RELEASE}"
IMAGE = f"shared-svc:{__version__}"  # the chart's default (repository shared-svc, appVersion)
REBUILT = f"{__version__}-rebuilt"  # images.sh's second build: another image id
DELETE_GUARD = "delete-guard.shared-svc.nvidia.com"


def helm(node: Node, *args: str, timeout: float = 600) -> str:
    proc = node.helm(*args, timeout=timeout)
    if proc.returncode != 0:
        namespace = args[args.index("-n") + 1] if "-n" in args else NS
        raise AssertionError(
            f"helm {' '.join(args)}: exit {proc.returncode}\n{proc.stderr}{proc.stdout}\n"
            f"{describe(node, namespace)}"
        )
    return proc.stdout


def describe(node: Node, namespace: str) -> str:
    """What a failure message needs: the namespace's pods and Events, and the pods' logs."""
    out = []
    for args in (
        ("get", "pods,jobs,deployments", "-o", "wide", "-n", namespace),
        ("get", "events", "-n", namespace, "--sort-by=.lastTimestamp"),
        ("logs", "-n", namespace, "-l", SELECTOR, "--tail=20", "--all-containers", "--prefix"),
    ):
        proc = node.kubectl(*args)
        out.append(f"$ kubectl {' '.join(args)}\n{proc.stdout}{proc.stderr}")
    return "\n".join(out)


def install(
    node: Node, *sets: str, namespace: str = NS, release: str = RELEASE, chart: Path = CHART
) -> str:
    """``helm install --wait`` of the checkout's chart (its defaults, plus ``sets``)."""
    args = ["install", release, str(chart), "-n", namespace, "--create-namespace"]
    for s in sets:
        args += ["--set", s]
    return helm(node, *args, "--wait", "--timeout", "3m")


def uninstall(node: Node, *, namespace: str = NS, release: str = RELEASE) -> None:
    """``helm uninstall`` if the release is there (a module's clean-up). When it fails (its
    pre-delete hook Job cannot run, say), the release is removed without hooks, for the
    tests after it, and the failure is raised."""
    if node.helm("status", release, "-n", namespace).returncode != 0:
        return
    try:
        helm(node, "uninstall", release, "-n", namespace, "--wait", "--timeout", "3m")
    except AssertionError:
        node.helm("uninstall", release, "-n", namespace, "--no-hooks", "--wait", "--timeout", "3m")
        raise


@dataclass
class OperatorWorld:
    """A ClusterPolicy, and gpu-operator's two DCGM Services as it creates them (its
    ServiceAccount, field manager and controller owner reference) before shared-svc."""

    writer: SimulatedOperator
    owner: dict[str, Any]
    created: dict[str, dict[str, Any]]  # name -> the Service as gpu-operator created it

    def cluster_ip(self, name: str) -> str:
        return str(self.created[name]["spec"]["clusterIP"])

    def uid(self, name: str) -> str:
        return str(self.created[name]["metadata"]["uid"])


async def gpu_operator_world(cp: ControlPlane, namespace: str, directory: Path) -> OperatorWorld:
    """A fresh world on the session's node: the Services an earlier module's world left
    (``helm uninstall`` leaves them, by design) are deleted first, so gpu-operator creates
    its own again."""
    cp.ensure_namespace(namespace)
    for name in SERVICES:
        status, body = cp.request("DELETE", f"/api/v1/namespaces/{namespace}/services/{name}")
        assert status in (200, 202, 404), (name, status, body)

    async def gone() -> bool:
        await asyncio.sleep(0)
        return all(service(cp, name, namespace) is None for name in SERVICES)

    await eventually(gone, timeout=60)
    body = cp_body(
        dcgm={"enabled": True},
        dcgmExporter={"enabled": True, "service": {"internalTrafficPolicy": "Cluster"}},
    )
    status, owner = cp.request("POST", "/apis/nvidia.com/v1/clusterpolicies", body)
    if status == 409:
        status, owner = cp.request("GET", "/apis/nvidia.com/v1/clusterpolicies/cluster-policy")
    assert status in (200, 201), owner
    writer = await SimulatedOperator.start(cp, directory, namespace, owner)
    created = {}
    for name in SERVICES:
        new = writer.body(
            name, {"metadata": {"resourceVersion": None}, "spec": {"clusterIP": None}}
        )
        out = await writer.core.create_namespaced_service(
            namespace, new, field_manager=SimulatedOperator.FIELD_MANAGER
        )
        created[name] = writer.api.sanitize_for_serialization(out)
    return OperatorWorld(writer, owner, created)


@contextlib.asynccontextmanager
async def operator_world(
    cp: ControlPlane, namespace: str, directory: Path
) -> AsyncIterator[OperatorWorld]:
    """``gpu_operator_world`` for a block: gpu-operator's client closed at its end."""
    world = await gpu_operator_world(cp, namespace, directory)
    try:
        yield world
    finally:
        await world.writer.close()


def get(cp: ControlPlane, path: str) -> dict[str, Any] | None:
    status, body = cp.request("GET", path)
    assert status in (200, 404), (path, status, body)
    return body if status == 200 else None


def service(cp: ControlPlane, name: str, namespace: str = NS) -> dict[str, Any] | None:
    return get(cp, f"/api/v1/namespaces/{namespace}/services/{name}")


def pods(cp: ControlPlane, namespace: str = NS, selector: str = SELECTOR) -> list[dict[str, Any]]:
    status, body = cp.request(
        "GET", f"/api/v1/namespaces/{namespace}/pods?labelSelector={selector}"
    )
    assert status == 200, body
    items: list[dict[str, Any]] = body["items"]
    return items


def ready(pod: dict[str, Any]) -> bool:
    conditions = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", [])}
    return conditions.get("Ready") == "True" and not pod["metadata"].get("deletionTimestamp")


def lease(cp: ControlPlane, namespace: str = NS) -> dict[str, Any]:
    body = get(cp, f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/shared-svc")
    assert body is not None, "no Lease shared-svc"
    return body


def holder(cp: ControlPlane, namespace: str = NS) -> str:
    return str(lease(cp, namespace)["spec"].get("holderIdentity") or "")


def pod_status(cp: ControlPlane, pod: str, namespace: str = NS) -> dict[str, Any]:
    """The pod's own ``/status``, through the API server's pod proxy (the pod's IP)."""
    status, body = cp.request("GET", f"/api/v1/namespaces/{namespace}/pods/{pod}:8080/proxy/status")
    assert status == 200, (pod, status, body)
    out: dict[str, Any] = body if isinstance(body, dict) else json.loads(body)
    return out


def metric_samples(cp: ControlPlane, name: str) -> list[tuple[dict[str, str], float]]:
    """The API server's own samples of the metric ``name`` (its /metrics)."""
    status, text = cp.request("GET", "/metrics")
    assert status == 200, text
    out = []
    for line in str(text).splitlines():
        if line.startswith(name + "{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            out.append((labels, float(line.rsplit(" ", 1)[1])))
    return out


def guard_answers(cp: ControlPlane) -> dict[str, float]:
    """The API server's calls of the delete guard's webhook, by answer code (a call that
    reached no server is ``fail-open``)."""
    out: dict[str, float] = {}
    for labels, value in metric_samples(cp, "apiserver_admission_webhook_request_total"):
        if labels.get("name") == DELETE_GUARD:
            out[labels["code"]] = out.get(labels["code"], 0) + value
    for labels, value in metric_samples(cp, "apiserver_admission_webhook_fail_open_count"):
        if labels.get("name") == DELETE_GUARD:
            out["fail-open"] = out.get("fail-open", 0) + value
    return out


async def guard_holds(cp: ControlPlane, world: OperatorWorld, namespace: str = NS) -> None:
    """The guard, served by the release's pods behind its webhook Service, as gpu-operator
    meets it through the API server: its delete of ``nvidia-dcgm`` (a ClusterPolicy needs
    it) is answered 404 by the delete guard (counted by the API server, no call failing
    open) and changes nothing; its whole-object PUT of each Service changes nothing (the
    update guard puts shared-svc's shape back)."""
    writer = world.writer

    async def guarded() -> bool:
        return await writer.delete("nvidia-dcgm", dry_run=True) == 404

    await eventually(guarded, timeout=90, interval=0.5)
    before = guard_answers(cp)
    assert await writer.delete("nvidia-dcgm") == 404
    after = guard_answers(cp)
    assert after.get("404", 0) == before.get("404", 0) + 1, (before, after)
    assert after.get("fail-open", 0) == before.get("fail-open", 0)
    live = service(cp, "nvidia-dcgm", namespace)
    assert live is not None and live["metadata"]["uid"] == world.uid("nvidia-dcgm")
    await guard_effective(lambda: writer.put("nvidia-dcgm", dry_run=True), timeout=60)
    for name in SERVICES:
        was = service(cp, name, namespace)
        assert was is not None
        answered = await writer.put(name)
        assert answered["metadata"]["resourceVersion"] == was["metadata"]["resourceVersion"]
        assert service(cp, name, namespace) == was


def pod_manifest(name: str, command: list[str] | None = None, **spec: Any) -> dict[str, Any]:
    """A pod of the project's image (the chart's name and pull policy: never pulled),
    running ``command`` (None: the image's entry point); ``container`` adds to the
    container, the rest to the pod's spec."""
    container: dict[str, Any] = {
        "name": "main",
        "image": IMAGE,
        "imagePullPolicy": "IfNotPresent",
        **({"command": command} if command is not None else {}),
        **spec.pop("container", {}),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, **spec.pop("metadata", {})},
        "spec": {"restartPolicy": "Never", "containers": [container], **spec},
    }


async def run_pod(cp: ControlPlane, namespace: str, manifest: dict[str, Any]) -> str:
    """Runs a pod to its end; returns its log. Fails with the pod's state otherwise."""
    cp.ensure_namespace(namespace)
    name = manifest["metadata"]["name"]
    base = f"/api/v1/namespaces/{namespace}/pods"
    status, out = cp.request("POST", base, manifest)
    assert status == 201, out

    async def finished() -> str | None:
        pod = get(cp, f"{base}/{name}") or {}
        phase = pod.get("status", {}).get("phase")
        return phase if phase in ("Succeeded", "Failed") else None

    try:
        phase = await eventually(finished, timeout=180, interval=0.5)
        status, log = cp.request("GET", f"{base}/{name}/log")
        assert status == 200, log
        text = log if isinstance(log, str) else json.dumps(log)  # a log that is JSON, parsed
        assert phase == "Succeeded", f"pod {name} {phase}: {text}\n{get(cp, f'{base}/{name}')}"
        return text
    finally:
        cp.request("DELETE", f"{base}/{name}?gracePeriodSeconds=0")


@dataclass
class Timeline:
    """Watch events of one kind, in the order the API server sent them."""

    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    listed: int = 0  # the first ``listed`` events are the list (ADDED)

    def of(self, name: str) -> list[tuple[str, dict[str, Any]]]:
        return [(t, o) for t, o in self.events if o["metadata"]["name"] == name]

    def kinds(self, name: str) -> list[str]:
        return [t for t, _ in self.of(name)]


@contextlib.asynccontextmanager
async def watching(
    cp: ControlPlane, lister: Callable[[ApiClient], Any], *args: Any, **kwargs: Any
) -> AsyncIterator[Timeline]:
    """Records the watch of ``lister(api)(*args, **kwargs)`` (a list call of the admin
    client) from now until the block ends: its list first (as ADDED), then each event."""
    api = await api_client(cp)
    timeline = Timeline()
    started = asyncio.Event()

    async def run() -> None:
        call = lister(api)
        listed = await call(*args, **kwargs)
        rv = listed.metadata.resource_version
        for item in listed.items:
            timeline.events.append(("ADDED", api.sanitize_for_serialization(item)))
        timeline.listed = len(listed.items)
        started.set()
        while True:
            w = watch.Watch()
            async with w.stream(
                call, *args, resource_version=rv, timeout_seconds=600, **kwargs
            ) as stream:
                async for event in stream:
                    obj = api.sanitize_for_serialization(event["object"])
                    rv = obj["metadata"]["resourceVersion"]
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        timeline.events.append((event["type"], obj))

    task = asyncio.create_task(run())
    try:
        await asyncio.wait_for(started.wait(), timeout=30)
        yield timeline
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        await api.close()


def services_of(api: ApiClient) -> Any:
    return client.CoreV1Api(api).list_namespaced_service


def pods_of(api: ApiClient) -> Any:
    return client.CoreV1Api(api).list_namespaced_pod


def leases_of(api: ApiClient) -> Any:
    return client.CoordinationV1Api(api).list_namespaced_lease


def process_field(pid: int, name: str) -> list[str]:
    """A field of a process's /proc status (``Uid``, ``Gid``, ``Groups``), split."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return next(line for line in status if line.startswith(name + ":")).split()[1:]


def process_identity(pid: int) -> tuple[list[str], list[str]]:
    """A process's real, effective, saved and filesystem uids, and its root mount's options."""
    uids = process_field(pid, "Uid")
    mounts = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
    root = next(line for line in mounts if line.split()[4] == "/")
    return uids, root.split()[5].split(",")


def container_pids(node: Node, running: list[dict[str, Any]]) -> list[int]:
    """The main process of each pod's container, found by its cgroup on the host."""
    pids = []
    mounts = cgroup_mounts()
    hierarchy = mounts.get("pids") or next(iter(mounts.values()))
    for pod in running:
        (state,) = pod["status"]["containerStatuses"]
        cid = state["containerID"].split("://", 1)[1]
        # os.walk passes over the cgroups the kubelet removes meanwhile (rglob raises)
        found = [
            Path(top) / cid for top, dirs, _ in os.walk(hierarchy / CGROUP_ROOT) if cid in dirs
        ]
        (directory,) = found or [None]
        assert directory is not None, f"no cgroup of container {cid}"
        procs = [int(p) for p in (directory / "cgroup.procs").read_text().split()]
        assert procs, f"no process in {directory}"
        pids.append(min(procs))
    return pids
