"""shared-svc on the real gpu-operator upgrade flow (issue 14, "What it must show").

The real gpu-operator (its upgrade controller runs k8s-operator-libs' state machine) on a
control plane of this module's own, 2 GPU nodes, ClusterPolicy with the driver on,
``autoUpgrade: true``, ``maxParallelUpgrades: 1`` and ``daemonsets.updateStrategy:
OnDelete``; a driver version bump starts each upgrade. The test plays the DaemonSet
controller, the kubelet and the driver-manager (tests/upgrade_flow.py); shared-svc runs
its upgrade controller (``Service``) against it. On each node: a declared consumer pod, a
pod of a DaemonSet prepared with ``shared-svc upgrade prepare-daemonset``, both with a 5 s
termination grace period they use in full, and an unrelated pod.

- With the gate set by ``shared-svc upgrade configure-gate --apply``: on every node each
  freed consumer is gone (its DELETED event) before the node reaches
  ``pod-restart-required``, and the driver unloads with no consumer left; shared-svc
  restores at ``upgrade-done``; nothing else is evicted; its node writes are its own keys.
- Without the gate: ``GPUConsumerGateMissing`` on the ClusterPolicy when shared-svc
  starts, and ``GPUConsumersAtDriverRestart`` on each node, where a freed consumer was
  indeed still there at ``pod-restart-required``.
- The dashboard's two upgrade panels agree (issue 46), read from the real Prometheus that
  scrapes both parties (static jobs with the labels their ServiceMonitors give:
  ``gpu-operator`` in its namespace, shared-svc's metrics job): shared-svc's "done, total,
  failed" and gpu-operator's own ``gpu_operator_nodes_upgrades_*`` show both nodes done,
  none failed, in progress or pending; every gpu-operator query of the dashboard returns
  its series here.

Pod deletions and state-label changes are ordered by their resourceVersions (one etcd:
its global revision), not by clocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

import testenv
from shared_svc.cli import main as cli
from shared_svc.controllers.upgrade.io import FIELD_MANAGER
from shared_svc.kube.writer import MERGE_PATCH, raw_request
from testenv import ControlPlane
from testenv import gpu_operator as gpu_env
from testenv import prometheus as prom_env
from tests.kube import api_client, eventually
from tests.svc import running
from tests.test_monitoring_prometheus import JOB, dashboard_queries, problems
from tests.upgrade_flow import (
    APPS,
    DRIVER_DS,
    EXPORTER,
    GRACE,
    NODES,
    OPERATOR_NS,
    PARKED,
    RECORD,
    UPGRADE_POLICY,
    Cluster,
    K8sObject,
    Recorder,
    consumer_stop_seconds,
    explained,
    exporter_daemonset,
    is_consumer,
    list_items,
    node_events,
    pod_key,
    post,
    recording,
    unsettled_nodes,
    upgrade_service_config,
    wait_until,
    workloads,
)

pytestmark = [pytest.mark.apiserver, pytest.mark.gpu_operator, pytest.mark.prometheus]

CP_PATH = f"/apis/nvidia.com/v1/clusterpolicies/{gpu_env.CLUSTER_POLICY}"
SPEC: dict[str, Any] = {
    "daemonsets": {"updateStrategy": "OnDelete", "rollingUpdate": None},
    "driver": {
        "enabled": True,
        "upgradePolicy": UPGRADE_POLICY,
    },
    # Only the driver and the validator (always deployed): less to play.
    "dcgm": {"enabled": False},
    "dcgmExporter": {"enabled": False},
}
# The upgrade library's own annotations it removes again (start times of its timeouts).
TIMERS = {
    "annotations:nvidia.com/gpu-driver-upgrade-wait-for-pod-completion-start-time",
    "annotations:nvidia.com/gpu-driver-upgrade-validation-start-time",
}


@pytest.fixture(scope="module")
def gpu_operator_nodes() -> tuple[str, ...]:
    return NODES


@dataclass
class World:
    cp: ControlPlane
    op: gpu_env.GpuOperator
    api: ApiClient
    cluster: Cluster
    prom: prom_env.Prometheus
    metrics_port: int  # shared-svc's, which Prometheus scrapes as the chart's job
    versions: list[str] = field(default_factory=lambda: ["580.82.07"])

    def log(self) -> str:
        return f"gpu-operator log {self.op.log}; stand-in errors {self.cluster.errors[-5:]}"

    def panel(self, title: str) -> list[str]:
        """The queries of the dashboard's panel ``title`` (of either party's series)."""
        queries = dashboard_queries(OPERATOR_NS) + dashboard_queries(OPERATOR_NS, gpu_operator=True)
        return [q for t, q in queries if t == title]

    def values(self, title: str) -> list[float | None]:
        """What the panel ``title`` shows now: each query's one value (None: no data)."""
        out: list[float | None] = []
        for query in self.panel(title):
            result = self.prom.get("/api/v1/query", query=query)["result"]
            out.append(float(result[0]["value"][1]) if result else None)
        return out


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        text: str = r.read().decode()
        return text


OURS = "Driver upgrade: done, total, failed"
THEIRS = "Driver upgrade, gpu-operator's count: done, in progress, failed, pending"


def prometheus_of(op: gpu_env.GpuOperator, metrics_port: int) -> prom_env.Prometheus:
    """Prometheus scraping gpu-operator's /metrics as the ServiceMonitor gpu-operator makes
    for itself would (job ``gpu-operator``, its namespace) and shared-svc's at
    ``metrics_port`` as the chart's ServiceMonitor would (job and namespace)."""
    jobs = (("gpu-operator", op.metrics_address), (JOB, f"127.0.0.1:{metrics_port}"))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": job,
                "scrape_interval": "1s",
                "scrape_timeout": "1s",
                "static_configs": [{"targets": [target], "labels": {"namespace": OPERATOR_NS}}],
            }
            for job, target in jobs
        ],
    }
    return prom_env.start_with(config)


async def _driver_pods(api: ApiClient) -> list[K8sObject]:
    return await list_items(
        api, f"/api/v1/namespaces/{OPERATOR_NS}/pods?labelSelector=app%3D{DRIVER_DS}"
    )


async def _unsettled(w: World, *, version: str) -> str | None:
    """What is missing before the driver DaemonSet is at ``version`` and every node is
    settled on it (``unsettled_nodes``); None when all that holds."""
    assert w.op.alive(), f"gpu-operator exited:\n{w.op.tail()}"
    try:
        ds = await raw_request(
            w.api, "GET", f"/apis/apps/v1/namespaces/{OPERATOR_NS}/daemonsets/{DRIVER_DS}"
        )
    except ApiException as exc:
        if exc.status == 404:
            return "no driver DaemonSet yet"
        raise
    images = [c["image"] for c in ds["spec"]["template"]["spec"]["containers"]]
    if not any(version in image for image in images):
        return f"driver DaemonSet not at {version}: {images}"
    return await unsettled_nodes(w.api)


@pytest.fixture(scope="module")
async def world(gpu_operator: gpu_env.GpuOperator) -> AsyncIterator[World]:
    """gpu-operator with the driver installed on both nodes (the stand-ins running), and
    the prepared consumer DaemonSet (``shared-svc upgrade prepare-daemonset``) on both."""
    cp = gpu_operator.control_plane
    api = await api_client(cp)
    stop = asyncio.Event()
    cluster = Cluster(
        api,
        NODES,
        namespaces=(APPS,),
        stop_seconds=consumer_stop_seconds,
        consumer=is_consumer,
    )
    task = asyncio.ensure_future(cluster.run(stop))
    metrics_port = testenv.free_port()
    try:
        prom = prometheus_of(gpu_operator, metrics_port)
    except testenv.ControlPlaneError as exc:
        pytest.fail(f"Prometheus did not start: {exc}")
    w = World(cp, gpu_operator, api, cluster, prom, metrics_port)
    try:
        await post(api, "/api/v1/namespaces", {"metadata": {"name": APPS}})
        await post(
            api,
            "/apis/node.k8s.io/v1/runtimeclasses",
            {"metadata": {"name": "nvidia"}, "handler": "nvidia"},
        )
        spec = gpu_env.deep_merge(SPEC, {"driver": {"version": w.versions[-1]}})
        await asyncio.to_thread(gpu_env.apply_cluster_policy, cp, spec)
        await post(api, f"/apis/apps/v1/namespaces/{APPS}/daemonsets", exporter_daemonset())
        code = await asyncio.to_thread(
            cli,
            [
                "upgrade",
                "prepare-daemonset",
                f"{APPS}/{EXPORTER}",
                "--kubeconfig",
                str(cp.kubeconfig),
            ],
        )
        assert code == 0
        await wait_until("driver install", lambda: _unsettled(w, version=w.versions[-1]), w.log)
        yield w
    finally:
        prom.stop()
        stop.set()
        await asyncio.wait_for(task, 30)
        await api.close()


@dataclass
class Upgrade:
    """What one driver upgrade did, seen by the recorder."""

    rec: Recorder
    declared: dict[str, K8sObject]  # node -> the declared consumer pod on it
    exporter: dict[str, K8sObject]  # node -> the prepared DaemonSet's pod on it
    unrelated: dict[str, K8sObject]  # node -> the unrelated pod on it
    started_rv: int  # the bump
    gate: dict[str, Any]
    status: dict[str, Any]
    panels: dict[str, list[float | None]]  # the two upgrade panels once both nodes are done

    def freed(self, node: str) -> list[K8sObject]:
        return [self.declared[node], self.exporter[node]]

    def reached(self, node: str, state: str, after: int | None = None) -> int:
        """The revision at which ``node`` first had ``state`` after the bump (or ``after``)."""
        return self.rec.reached_after(node, state, self.started_rv if after is None else after)


async def _gate_events(api: ApiClient, reason: str) -> dict[str, K8sObject]:
    items = await list_items(api, "/apis/events.k8s.io/v1/namespaces/default/events")
    return {
        f"{e['metadata']['name']}@{e['metadata']['resourceVersion']}": e
        for e in items
        if e.get("reason") == reason
    }


async def _upgrade(w: World, *, gate: bool) -> Upgrade:
    """Sets the gate (configure-gate --apply) or removes it, starts shared-svc and the
    recorder, bumps the driver version and waits until both nodes are upgraded and
    shared-svc has restored them."""
    declared, exporter, unrelated = await workloads(w.api)
    if gate:
        code = await asyncio.to_thread(
            cli, ["upgrade", "configure-gate", "--apply", "--kubeconfig", str(w.cp.kubeconfig)]
        )
        assert code == 0
    else:
        await raw_request(
            w.api,
            "PATCH",
            CP_PATH,
            body={"spec": {"driver": {"upgradePolicy": {"waitForCompletion": None}}}},
            content_type=MERGE_PATCH,
        )
    before = await _gate_events(w.api, "GPUConsumerGateMissing")
    config = upgrade_service_config(w.cp).model_copy(update={"port": w.metrics_port})
    async with recording(w.api) as rec, running(config) as service:
        upgrades = service.upgrade
        assert upgrades is not None

        async def gate_seen() -> dict[str, Any] | None:
            check = upgrades.gate_review.gate
            return None if check is None else check.as_dict()

        verdict: dict[str, Any] = await eventually(gate_seen, timeout=30)
        if not gate:
            # The Warning on the ClusterPolicy at start (a new Event, or the series bumped).
            async def warned() -> list[K8sObject]:
                now = await _gate_events(w.api, "GPUConsumerGateMissing")
                return [e for k, e in now.items() if k not in before]

            fresh = await eventually(warned, timeout=30)
            assert fresh[0]["type"] == "Warning"
            assert fresh[0]["regarding"]["kind"] == "ClusterPolicy"
            assert fresh[0]["regarding"]["name"] == gpu_env.CLUSTER_POLICY
            assert "races the driver restart" in fresh[0]["note"]
        w.cluster.at_unload.clear()
        version = f"580.95.{len(w.versions):02d}"
        w.versions.append(version)
        bumped = await raw_request(
            w.api,
            "PATCH",
            CP_PATH,
            body={"spec": {"driver": {"version": version}}},
            content_type=MERGE_PATCH,
        )
        started_rv = int(bumped["metadata"]["resourceVersion"])
        await wait_until("upgrade", lambda: _both_upgraded(w, rec, started_rv, version), w.log)
        status = service.status()
        panels = await _panels_done(w)
    return Upgrade(rec, declared, exporter, unrelated, started_rv, verdict, status, panels)


async def _panels_done(w: World) -> dict[str, list[float | None]]:
    """The two upgrade panels once both show every node done (gpu-operator sets its gauges
    on its next upgrade reconcile, a node label change away); what they show after 60 s
    otherwise, for the assertion to name."""
    done = {OURS: [2.0, 2.0, 0.0], THEIRS: [2.0, 0.0, 0.0, 0.0]}
    shown: dict[str, list[float | None]] = {}

    async def agree() -> bool:
        for title in done:
            shown[title] = await asyncio.to_thread(w.values, title)
        return shown == done

    with contextlib.suppress(AssertionError):
        await eventually(agree, timeout=60, interval=0.5)
    return dict(shown)


async def _both_upgraded(w: World, rec: Recorder, after: int, version: str) -> str | None:
    return rec.not_through_restart(NODES, after) or await _unsettled(w, version=version)


async def _reported(w: World, up: Upgrade, node: str, reason: str) -> list[K8sObject]:
    """shared-svc's Events of ``reason`` on ``node`` written during this upgrade."""
    return await node_events(w.api, node, reason, after=up.started_rv)


async def _check_common(w: World, up: Upgrade) -> None:
    """What holds with or without the gate: one node at a time, shared-svc parks at the
    first freeing state and restores at upgrade-done, evicts nothing else, writes only
    its own node keys, and never a key of another writer."""
    rec = up.rec
    for node in NODES:
        cordon = up.reached(node, "cordon-required")
        restart = up.reached(node, "pod-restart-required")
        done = up.reached(node, "upgrade-done", after=restart)
        assert cordon < restart
        parked = rec.label_changes(node, PARKED)  # from before the bump
        assert [v for _, v in parked] == [None, "true", None], parked
        (_, _), (set_at, _), (removed_at, _) = parked
        assert cordon < set_at, (node, rec.states(node), parked)
        assert removed_at > done, (node, rec.states(node), parked)
        record = [
            (e.rv, RECORD in (e.obj["metadata"].get("annotations") or {}))
            for e in rec.node_events(node)
            if e.rv > up.started_rv
        ]
        assert any(present for _, present in record) and not record[-1][1]
        # Nothing else evicted: the unrelated pod was never asked to go.
        web = up.unrelated[node]
        assert rec.pod_deletion_requested(web["metadata"]["uid"]) is None, pod_key(web)
        # Written by shared-svc on the node: its parked label and record, nothing else.
        owned = rec.managers_of_node_keys(node)
        assert owned.get(FIELD_MANAGER) == {f"labels:{PARKED}", f"annotations:{RECORD}"}, owned
        others = {key for m, keys in owned.items() if m != FIELD_MANAGER for key in keys}
        assert f"labels:{PARKED}" not in others and f"annotations:{RECORD}" not in others
        # Nobody's key was dropped but shared-svc's own and the flow's timers.
        assert rec.dropped_keys(node) <= {f"labels:{PARKED}", f"annotations:{RECORD}", *TIMERS}
        # And it said so on the node (Events follow the writes: a bounded wait).
        await eventually(lambda n=node: _reported(w, up, n, "GPUConsumersRestored"), timeout=10)
    # maxParallelUpgrades 1: the second node starts only when the first is done.
    first, second = sorted(NODES, key=lambda n: up.reached(n, "cordon-required"))
    first_done = up.reached(first, "upgrade-done", after=up.reached(first, "cordon-required"))
    assert first_done < up.reached(second, "cordon-required")
    # Among the pods of the consumers' namespace only the freed ones were asked to go.
    asked = {
        e.uid
        for e in rec.events
        if e.kind == "pod"
        and e.obj["metadata"]["namespace"] == APPS
        and e.obj["metadata"].get("deletionTimestamp")
        and e.rv > up.started_rv
    }
    freed = {p["metadata"]["uid"] for n in NODES for p in up.freed(n)}
    assert asked == freed, (asked, freed)
    assert w.op.alive(), w.op.tail()


async def test_with_the_gate_every_freed_consumer_is_gone_before_the_driver_restarts(
    world: World,
) -> None:
    up = await _upgrade(world, gate=True)
    with explained(up.rec, (APPS,)):
        await _check_gated(world, up)


async def _check_gated(world: World, up: Upgrade) -> None:
    assert up.gate["state"] == "ok", up.gate
    # The dashboard: shared-svc's count and gpu-operator's own agree, every node done.
    assert up.panels == {OURS: [2.0, 2.0, 0.0], THEIRS: [2.0, 0.0, 0.0, 0.0]}, up.panels
    found: list[str] = []
    for title, query in dashboard_queries(OPERATOR_NS, gpu_operator=True):
        found += await asyncio.to_thread(problems, world.prom, title, query, returns=True)
    assert dashboard_queries(OPERATOR_NS, gpu_operator=True) and not found, found
    # The gauges gpu-operator exposes are the ones testenv names (the panel's four and
    # _available), read from its own /metrics.
    text = await asyncio.to_thread(_get, f"http://{world.op.metrics_address}/metrics")
    exposed = set(re.findall(r"^(gpu_operator_nodes_upgrades_\w+) ", text, re.M))
    assert exposed == set(gpu_env.UPGRADE_GAUGES), exposed
    rec = up.rec
    for node in NODES:
        cordon = up.reached(node, "cordon-required")
        waiting = up.reached(node, "wait-for-jobs-required")
        deleting = up.reached(node, "pod-deletion-required")
        restart = up.reached(node, "pod-restart-required")
        parked_at = rec.label_changes(node, PARKED)[1][0]
        assert parked_at < restart
        for pod in up.freed(node):
            uid = pod["metadata"]["uid"]
            asked = rec.pod_deletion_requested(uid)
            gone = rec.pod_deleted(uid)
            assert asked is not None and gone is not None, pod_key(pod)
            # Asked to go in a freeing state; gone (the kubelet confirmed) while the flow
            # held the node in wait-for-jobs-required, so before the driver restart.
            assert cordon < asked < restart, (node, pod_key(pod), asked)
            assert waiting < gone < deleting < restart, (node, pod_key(pod), gone)
        # The driver unloaded with no consumer on the node; freed reported, no Warning.
        assert world.cluster.at_unload[node] == [[]], world.cluster.at_unload
        assert await _reported(world, up, node, "GPUConsumersFreed"), node
        assert not await _reported(world, up, node, "GPUConsumersAtDriverRestart")
    assert up.status["upgrade"]["gate"]["state"] == "ok"
    await _check_common(world, up)


async def test_without_the_gate_shared_svc_warns_at_start_and_per_node(world: World) -> None:
    up = await _upgrade(world, gate=False)
    with explained(up.rec, (APPS,)):
        await _check_ungated(world, up)


async def _check_ungated(world: World, up: Upgrade) -> None:
    assert up.gate["state"] == "missing", up.gate
    rec = up.rec
    for node in NODES:
        restart = up.reached(node, "pod-restart-required")
        late = sorted(
            pod_key(p)
            for p in up.freed(node)
            if (rec.pod_deleted(p["metadata"]["uid"]) or 0) > restart
        )
        # The race is real: a freed consumer was still on the node at pod-restart-required
        # (and the driver-manager found it when it came to unload the driver).
        assert late, (node, rec.states(node))
        assert any(world.cluster.at_unload[node]), world.cluster.at_unload
        fresh = await _reported(world, up, node, "GPUConsumersAtDriverRestart")
        assert fresh, node
        assert fresh[0]["type"] == "Warning"
        # It names the consumer that was certainly still there (the one using its whole
        # grace period on this node), and only consumers freed on this node.
        last = next(p for p in up.freed(node) if consumer_stop_seconds(p) == GRACE)
        named = set(re.findall(rf"{APPS}/[a-z0-9.-]+[a-z0-9]", fresh[0]["note"]))
        assert pod_key(last) in named, (pod_key(last), fresh[0]["note"])
        assert named <= {pod_key(p) for p in up.freed(node)}, fresh[0]["note"]
    await _check_common(world, up)
