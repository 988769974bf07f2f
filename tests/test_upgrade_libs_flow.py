"""shared-svc on the real driver-upgrade state machine of gpu-operator v26.7.0 (issue 28).

k8s-operator-libs at the pseudo-version gpu-operator v26.7.0 vendors, driven as gpu-operator
drives it, with its restart-only rule (``testenv/upgrade_libs.py``, ``testenv/upgrade-libs/``),
on a control plane of this module's own: 2 GPU nodes, a ClusterPolicy with ``autoUpgrade:
true``, ``maxParallelUpgrades: 1`` and the gate set by ``shared-svc upgrade configure-gate
--apply``, and gpu-operator's driver DaemonSet (``OnDelete``, ``DRIVER_CONFIG_DIGEST`` on the
driver container and the driver-manager init container) and validator DaemonSet, as its
ClusterPolicy controller writes them. The test plays the DaemonSet controller, the kubelet
and the driver-manager (tests/upgrade_flow.py: on a new driver pod whose digest is the
loaded driver's it keeps the modules loaded, as driver-manager >= v0.12.0 does); shared-svc
runs its upgrade controller (``Service``), and is restarted in the middle of each upgrade.

- A driver change (a new version, a new digest): the full path. On every node the freed
  consumers are gone before ``pod-restart-required`` (the gate holding) and the driver
  unloads with none left; shared-svc restores at ``upgrade-done``.
- A cosmetic change of the driver DaemonSet's template (a chart label, the digest unchanged):
  the restart-only path. Every node goes ``upgrade-required`` -> ``pod-restart-required``
  (no ``cordon-required``) to ``upgrade-done``, the driver restarts in place, and shared-svc
  evicts no pod, parks no DaemonSet, records nothing as freed, and says so once per node.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient

import testenv
from shared_svc.cli import main as cli
from shared_svc.kube.writer import MERGE_PATCH, raw_request
from testenv import upgrade_examples as ex
from testenv import upgrade_libs as libs_env
from tests.kube import eventually
from tests.svc import running
from tests.upgrade_flow import (
    APPS,
    DRIVER_DS,
    EXPORTER,
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
    flow_driver_daemonset,
    libs_plane,
    libs_stand_ins,
    node_events,
    pod_key,
    post,
    recording,
    unsettled_nodes,
    upgrade_service_config,
    validator_daemonset,
    wait_until,
    workloads,
)

pytestmark = [pytest.mark.apiserver, pytest.mark.upgrade_libs]

CP_PATH = f"/apis/nvidia.com/v1/clusterpolicies/{libs_env.CLUSTER_POLICY}"
DRIVER_PATH = f"/apis/apps/v1/namespaces/{OPERATOR_NS}/daemonsets/{DRIVER_DS}"
DEPLOY_DRIVER = "nvidia.com/gpu.deploy.driver"
DEPLOY_VALIDATOR = "nvidia.com/gpu.deploy.operator-validator"
DRIVER_STOP_SECONDS = 1.5  # a driver pod stops in this once deleted (its grace period: 3 s)
SKIPPED = ("cordon-required", "wait-for-jobs-required", "pod-deletion-required", "drain-required")


@dataclass
class World:
    cp: testenv.ControlPlane
    libs: libs_env.UpgradeLibs
    api: ApiClient
    cluster: Cluster
    version: str = "580.82.07"
    chart: str = "gpu-operator-v26.7.0"

    @property
    def digest(self) -> str:
        return f"digest-{self.version}"  # what gpu-operator hashes: the driver config

    def log(self) -> str:
        return f"upgrade-libs log {self.libs.log}; stand-in errors {self.cluster.errors[-5:]}"


def _stop_seconds(pod: K8sObject) -> float:
    if (pod["metadata"].get("labels") or {}).get("app") == DRIVER_DS:
        return DRIVER_STOP_SECONDS
    return consumer_stop_seconds(pod)


def _driver_daemonset(w: World) -> dict[str, Any]:
    return flow_driver_daemonset(w.version, w.chart)


def _cluster_policy() -> dict[str, Any]:
    policy = ex.cluster_policy(libs_env.CLUSTER_POLICY, auto_upgrade=True)
    for key in ("uid", "resourceVersion", "creationTimestamp"):
        del policy["metadata"][key]
    policy["spec"]["driver"] = {"enabled": True, "upgradePolicy": dict(UPGRADE_POLICY)}
    return policy


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[testenv.ControlPlane]:
    with libs_plane(tmp_path_factory.mktemp("upgrade-libs")) as cp:
        yield cp


@pytest.fixture(scope="module")
async def world(plane: testenv.ControlPlane) -> AsyncIterator[World]:
    """The libs' state machine running, the driver installed on both nodes (the stand-ins
    running), the gate set, and the prepared consumer DaemonSet on both."""
    cp = plane
    async with libs_stand_ins(cp, _stop_seconds) as (libs, api, cluster):
        w = World(cp, libs, api, cluster)
        kubeconfig = ["--kubeconfig", str(cp.kubeconfig)]
        for ns in (OPERATOR_NS, APPS):
            await post(api, "/api/v1/namespaces", {"metadata": {"name": ns}})
        await post(api, "/apis/nvidia.com/v1/clusterpolicies", _cluster_policy())
        await post(api, f"/apis/apps/v1/namespaces/{OPERATOR_NS}/daemonsets", _driver_daemonset(w))
        await post(api, f"/apis/apps/v1/namespaces/{OPERATOR_NS}/daemonsets", validator_daemonset())
        await post(api, f"/apis/apps/v1/namespaces/{APPS}/daemonsets", exporter_daemonset())
        for args in (
            ["upgrade", "prepare-daemonset", f"{APPS}/{EXPORTER}"],
            ["upgrade", "configure-gate", "--apply"],
        ):
            assert await asyncio.to_thread(cli, [*args, *kubeconfig]) == 0
        await wait_until("driver install", lambda: _unsettled(w), w.log)
        yield w


async def _unsettled(w: World) -> str | None:
    assert w.libs.alive(), f"upgrade-libs exited:\n{w.libs.tail()}"
    return await unsettled_nodes(w.api)


async def _record(w: World, node: str) -> dict[str, Any] | None:
    obj = await raw_request(w.api, "GET", f"/api/v1/nodes/{node}")
    raw = (obj["metadata"].get("annotations") or {}).get(RECORD)
    return None if raw is None else dict(json.loads(raw))


async def _change_driver(w: World, *, version: str | None = None, chart: str | None = None) -> int:
    """Patches the driver DaemonSet's template as gpu-operator would after a ClusterPolicy
    change (``version``: a new driver, so a new digest) or a ``helm upgrade`` of
    gpu-operator (``chart``: its chart label only); returns the patch's resourceVersion."""
    w.version, w.chart = version or w.version, chart or w.chart
    ds = _driver_daemonset(w)
    body = {"spec": {"template": ds["spec"]["template"]}}
    patched = await raw_request(w.api, "PATCH", DRIVER_PATH, body=body, content_type=MERGE_PATCH)
    return int(patched["metadata"]["resourceVersion"])


@dataclass
class Run:
    """One upgrade, seen by the recorder from ``started_rv`` (the driver change) on."""

    rec: Recorder
    started_rv: int
    declared: dict[str, K8sObject]
    exporter: dict[str, K8sObject]
    unrelated: dict[str, K8sObject]
    at_unload: dict[str, list[list[str]]] = field(default_factory=dict)
    in_place: dict[str, int] = field(default_factory=dict)

    def states(self, node: str) -> list[str | None]:
        """The node's states from the change on (its state then first)."""
        seen = self.rec.states(node)
        before = [v for rv, v in seen if rv <= self.started_rv][-1:]
        return before + [v for rv, v in seen if rv > self.started_rv]

    def reached(self, node: str, state: str, after: int | None = None) -> int:
        return self.rec.reached_after(node, state, self.started_rv if after is None else after)

    def asked_to_go(self) -> set[str]:
        """The consumers' namespace's pods given a deletionTimestamp after the change."""
        return {
            e.uid
            for e in self.rec.events
            if e.kind == "pod"
            and e.obj["metadata"]["namespace"] == APPS
            and e.obj["metadata"].get("deletionTimestamp")
            and e.rv > self.started_rv
        }

    def node_versions(self, node: str) -> list[K8sObject]:
        return [e.obj for e in self.rec.node_events(node) if e.rv > self.started_rv]


async def _reported(w: World, run: Run, node: str, reason: str) -> list[K8sObject]:
    return await node_events(w.api, node, reason, after=run.started_rv)


async def _done(run: Run, node: str) -> str | None:
    """None once ``node`` reached upgrade-done after pod-restart-required of this upgrade."""
    seen = [(r, v) for r, v in run.rec.states(node) if r > run.started_rv]
    restarted = [r for r, v in seen if v == "pod-restart-required"]
    if restarted and any(v == "upgrade-done" and r > restarted[0] for r, v in seen):
        return None
    return f"{node}: {[v for _, v in seen]}"


async def _all_through(w: World, run: Run) -> str | None:
    return run.rec.not_through_restart(NODES, run.started_rv) or await _unsettled(w)


async def test_a_driver_change_frees_before_the_driver_restarts_and_restores_after_a_restart(
    world: World,
) -> None:
    """The full path; shared-svc stops once it freed the first node, and starts again once
    that node is upgrade-done (the gate holds the second node for the consumers meanwhile)."""
    w = world
    declared, exporter, unrelated = await workloads(w.api)
    w.cluster.at_unload.clear()
    async with recording(w.api) as rec:
        async with running(upgrade_service_config(w.cp)):
            started = await _change_driver(w, version="580.95.05")
            run = Run(rec, started, declared, exporter, unrelated)

            async def freeing() -> str | None:
                for node in NODES:
                    record = await _record(w, node)
                    if (
                        record
                        and record["pods"]
                        and run.asked_to_go() >= {declared[node]["metadata"]["uid"]}
                    ):
                        return node
                return None

            first = await eventually(freeing, timeout=120)
        # shared-svc is down: the first node goes on, the second waits at the gate.
        await wait_until(f"{first} upgrade-done, shared-svc down", lambda: _done(run, first), w.log)
        async with running(upgrade_service_config(w.cp)):
            await wait_until("upgrade", lambda: _all_through(w, run), w.log)
    with explained(rec, (APPS,)):
        for node in NODES:
            cordon = run.reached(node, "cordon-required")
            waiting = run.reached(node, "wait-for-jobs-required")
            deleting = run.reached(node, "pod-deletion-required")
            restart = run.reached(node, "pod-restart-required")
            done = run.reached(node, "upgrade-done", after=restart)
            parked = rec.label_changes(node, PARKED)  # from the recorder's start on
            assert [v for _, v in parked] == [None, "true", None], parked
            (_, _), (set_at, _), (removed_at, _) = parked
            assert cordon < set_at < restart and removed_at > done, parked
            for pod in (declared[node], exporter[node]):
                uid = pod["metadata"]["uid"]
                asked, gone = rec.pod_deletion_requested(uid), rec.pod_deleted(uid)
                assert asked is not None and gone is not None, pod_key(pod)
                assert cordon < asked < restart, (node, pod_key(pod), asked)
                assert waiting < gone < deleting < restart, (node, pod_key(pod), gone)
            # The driver was unloaded (the full path), with no consumer on the node.
            assert w.cluster.at_unload[node] == [[]], w.cluster.at_unload
            # Freed is seen at a poll after the consumers went: the first node's by nobody
            # (shared-svc was down), the second's by the restarted service.
            if node != first:
                assert await _reported(w, run, node, "GPUConsumersFreed"), node
            await eventually(
                lambda n=node: _reported(w, run, n, "GPUConsumersRestored"), timeout=10
            )
            assert not await _reported(w, run, node, "UpgradeRestartOnly"), node
            assert all(
                "restartOnly" not in json.loads(v["metadata"]["annotations"][RECORD])
                for v in run.node_versions(node)
                if RECORD in (v["metadata"].get("annotations") or {})
            )
        freed = {p["metadata"]["uid"] for n in NODES for p in (declared[n], exporter[n])}
        assert run.asked_to_go() == freed  # the unrelated pods were never asked
    assert w.libs.alive(), w.libs.tail()


async def test_a_cosmetic_template_change_restarts_the_driver_in_place_and_frees_nothing(
    world: World,
) -> None:
    """The restart-only path; shared-svc stops once it recorded its verdict on the first
    node, and starts again at once (that node is between its verdict and upgrade-done)."""
    w = world
    declared, exporter, unrelated = await workloads(w.api)
    w.cluster.at_unload.clear()
    in_place = dict(w.cluster.in_place)
    digest = w.digest
    async with recording(w.api) as rec:
        async with running(upgrade_service_config(w.cp)) as service:
            started = await _change_driver(w, chart="gpu-operator-v26.7.1")
            assert w.digest == digest
            run = Run(rec, started, declared, exporter, unrelated)

            async def recorded() -> tuple[str, dict[str, Any]] | None:
                for node in NODES:
                    if (record := await _record(w, node)) is not None:
                        return node, record
                return None

            # The first thing shared-svc writes in this upgrade: the verdict, nothing freed.
            first, record = await eventually(recorded, timeout=120)
            with explained(rec, (APPS, OPERATOR_NS)):
                assert "restartOnly" in record and record["pods"] == [], (first, record)
            shown = service.status()["upgrade"]["nodes"][first]
            assert (shown["path"], shown["phase"]) == ("restart-only", "restart-only"), shown
            assert shown["driverDaemonset"] == f"{OPERATOR_NS}/{DRIVER_DS}"
        # `upgrade status` says so too, from the record, with shared-svc down.
        status = await asyncio.to_thread(_upgrade_status, w)
        assert any(n["node"] == first and n["path"] == "restart-only" for n in status["nodes"])
        async with running(upgrade_service_config(w.cp)):
            await wait_until("restart-only upgrade", lambda: _all_through(w, run), w.log)
    with explained(rec, (APPS, OPERATOR_NS)):
        for node in NODES:
            states = run.states(node)
            # The libs' restart-only path: upgrade-required -> pod-restart-required, cordoned.
            assert "upgrade-required" in states and "upgrade-done" in states[1:], states
            assert not set(SKIPPED) & set(states), states
            required = states.index("upgrade-required")
            assert states[required + 1] == "pod-restart-required", states
            # The driver restarted in place: no unload, the modules kept loaded.
            assert w.cluster.in_place.get(node, 0) == in_place.get(node, 0) + 1
            assert node not in w.cluster.at_unload, w.cluster.at_unload
            # Nothing parked, nothing recorded as freed; said once.
            assert not [rv for rv, v in rec.label_changes(node, PARKED) if rv > started and v]
            for version in run.node_versions(node):
                raw = (version["metadata"].get("annotations") or {}).get(RECORD)
                if raw is not None:
                    record = json.loads(raw)
                    assert record["restartOnly"]["digest"] == digest, record
                    assert record["pods"] == [] and record["parkedLabel"] is False, record
                    assert record["freedAt"] is None, record
            said = await _reported(w, run, node, "UpgradeRestartOnly")
            assert len(said) == 1 and said[0]["type"] == "Normal", said
            for reason in (
                "GPUConsumersFreed",
                "UpgradePathGuessed",
                "GPUConsumersAtDriverRestart",
            ):
                assert not await _reported(w, run, node, reason), (node, reason)
        # No consumer (nor any other pod of theirs) was asked to go.
        assert run.asked_to_go() == set()
    assert w.libs.alive(), w.libs.tail()


def _upgrade_status(w: World) -> dict[str, Any]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli(["upgrade", "status", "-o", "json", "--kubeconfig", str(w.cp.kubeconfig)])
    assert code == 0
    return dict(json.loads(out.getvalue()))
