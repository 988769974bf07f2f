"""The soak's driver-upgrade side (issue 44): the real upgrade state machine of gpu-operator
v26.7.0's libs (``testenv/upgrade-libs/``), next to the gpu-operator build without its own
upgrade controller (``testenv/gpu-operator/no-upgrade/``: the testenv gpu-operator predates
v26.7.0, and its upgrade controller would reset every upgrade for a ClusterPolicy without
``autoUpgrade``), and the stand-ins of tests/upgrade_flow.py (:class:`Cluster`: the
DaemonSet controller, kubelet and driver-manager of the driver, the validator and the
consumers; the DCGM pods stay the world's own stand-in's, which parks them with their
node's deploy labels).

- gpu-operator's driver DaemonSet is written here, as its ClusterPolicy controller writes
  it (tests/upgrade_flow.py ``flow_driver_daemonset``), under :data:`DRIVER_DS`: the
  testenv gpu-operator runs with its driver state off (no kubelet runs a driver), and
  deletes the DaemonSet of that state's own name while it is off. It is not owned by a
  ClusterPolicy, so deleting one does not uninstall the driver (each step's upgrade ends
  within the step, so a ClusterPolicy is never deleted in the middle of one).
- The GPU consumers, in :data:`CONSUMERS`: on each node a declared pod and an unrelated one
  (re-created, as the user's own controller would, once the node is schedulable and out of
  its upgrade), and a DaemonSet prepared with ``shared-svc upgrade prepare-daemonset``.
- So is its validator's (:data:`VALIDATOR_DS`), beside gpu-operator's own.
- The ClusterPolicies carry the gate (``tests.soak.model.UPGRADE_POLICY``).

After every step: the nodes settled (:meth:`Upgrades.unsettled`), and the step's upgrade
judged (:meth:`Upgrades.judge`): the timeline's verdicts (tests/soak/timeline.py), no driver
unload that had to wait for a consumer (the seed's stall), and a restart-only path that
restarted the driver in place on every node.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kubernetes_asyncio.client import ApiClient

from shared_svc.cli import main as cli
from testenv import ControlPlane
from testenv import upgrade_libs as libs_env
from tests.kube import api_client
from tests.soak import model as m
from tests.soak.api import items
from tests.soak.timeline import FREE, Timeline, Watcher
from tests.upgrade_flow import APPS as CONSUMERS
from tests.upgrade_flow import (
    CONSUMER,
    EXPORTER,
    PARKED,
    RECORD,
    STATE,
    VALIDATOR_APP,
    Cluster,
    bare_pod,
    consumer_stop_seconds,
    exporter_daemonset,
    flow_driver_daemonset,
    is_consumer,
    is_driver,
    is_ready,
    newest_revision_hashes,
    unsettled,
    validator_daemonset,
)

DRIVER_DS = "soak-driver-daemonset"
# The validator the flow waits for in validation-required, as gpu-operator's validator
# state writes it, under a name of its own: gpu-operator's own (nvidia-operator-validator)
# goes with the ClusterPolicy it reconciles, and it reconciles only the first one it saw.
VALIDATOR_DS = "soak-operator-validator"
DRIVER_STOP_SECONDS = 1.5  # a driver pod stops in this once deleted (its grace period: 3 s)
# The deploy labels gpu-operator put on its GPU nodes in an earlier life (it keeps a value
# it finds): the driver's and the validator's, which the upgrade flow needs from the start.
NODE_LABELS = {
    "nvidia.com/gpu.deploy.driver": "true",
    "nvidia.com/gpu.deploy.operator-validator": "true",
}


def driver_daemonset(driver: tuple[int, int], namespace: str) -> dict[str, Any]:
    version, chart = driver
    ds = flow_driver_daemonset(f"580.{95 + version}.05", f"gpu-operator-v26.7.{chart}")
    ds["metadata"].update(name=DRIVER_DS, namespace=namespace)
    return ds


def _prepare(cp: ControlPlane) -> None:
    """``shared-svc upgrade prepare-daemonset`` of the consumers' DaemonSet, as its user
    runs it once (its diff kept out of the soak's report)."""
    args = ["upgrade", "prepare-daemonset", f"{CONSUMERS}/{EXPORTER}"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli([*args, "--kubeconfig", str(cp.kubeconfig)])
    if code != 0:
        raise AssertionError(f"shared-svc {' '.join(args)}: exit {code}\n{out.getvalue()}")


def _stop_seconds(pod: dict[str, Any]) -> float:
    return DRIVER_STOP_SECONDS if is_driver(pod) else consumer_stop_seconds(pod)


@dataclass
class Upgrades:
    cp: ControlPlane
    namespace: str
    nodes: tuple[str, ...]
    libs: libs_env.UpgradeLibs
    api: ApiClient
    cluster: Cluster
    watcher: Watcher
    timeline: Timeline
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Future[Any]] = field(default_factory=list)
    driver: tuple[int, int] | None = None  # the driver DaemonSet as last applied
    in_place: dict[str, int] = field(default_factory=dict)  # Cluster.in_place at step start

    # --- the stand-ins' rounds (synchronous: the runner's thread) ---

    def sync(self, model: m.Model, nodes: dict[str, dict[str, Any]]) -> None:
        """The driver DaemonSet as ``model`` asks; the consumer pods the user re-creates
        (``nodes``: the world's round's, by name)."""
        if self.driver != model.driver:
            self.cp.apply_manifests(
                [driver_daemonset(model.driver, self.namespace)], field_manager="gpu-operator"
            )
            self.driver = model.driver
        pods = self._list(f"/api/v1/namespaces/{CONSUMERS}/pods")
        for node in self.nodes:
            meta = nodes[node]["metadata"]
            state = (meta.get("labels") or {}).get(STATE)
            if nodes[node]["spec"].get("unschedulable") or state in FREE:
                continue
            for name, labels in ((f"trainer-{node}", {"app": "trainer", **CONSUMER}),
                                 (f"web-{node}", {"app": "web"})):  # fmt: skip
                if not any(p["metadata"]["name"] == name for p in pods):
                    self.cp.request(
                        "POST",
                        f"/api/v1/namespaces/{CONSUMERS}/pods",
                        bare_pod(name, node, labels),
                    )

    def unsettled(self, model: m.Model) -> list[str]:
        """What does not hold yet of the upgrade side of a settled ``model``."""
        if not self.libs.alive():
            return [f"upgrade-libs exited: {self.libs.tail()}"]
        nodes = self._nodes()
        pods = self._list("/api/v1/pods")
        if model.active_policy() is not None:
            revisions = self._list(f"/apis/apps/v1/namespaces/{self.namespace}/controllerrevisions")
            newest = newest_revision_hashes(revisions)
            apps = (VALIDATOR_APP, EXPORTER, "trainer")
            missing = unsettled(nodes, pods, newest, self.nodes, apps)
            return [missing] if missing else []
        problems = []  # no ClusterPolicy: no upgrade flow; what shared-svc parked is back
        for name in self.nodes:
            meta = nodes[name]["metadata"]
            if STATE in (meta.get("labels") or {}):
                problems.append(f"{name}: state {meta['labels'][STATE]} with no ClusterPolicy")
            if PARKED in (meta.get("labels") or {}) or RECORD in (meta.get("annotations") or {}):
                problems.append(f"{name}: shared-svc's keys still there")
            if not any(
                p["spec"].get("nodeName") == name and is_consumer(p) and is_ready(p)
                for p in pods
                if (p["metadata"].get("labels") or {}).get("app") == EXPORTER
            ):
                problems.append(f"{name}: no Ready {EXPORTER} pod")
        return problems

    def _nodes(self) -> dict[str, dict[str, Any]]:
        return {n["metadata"]["name"]: n for n in self._list("/api/v1/nodes")}

    def _list(self, path: str) -> list[dict[str, Any]]:
        return items(self.cp, path)

    def dump(self) -> dict[str, Any]:
        """The upgrade side's objects for a violation's dump."""
        nodes = self._nodes()
        return {
            "nodes": {
                name: {
                    "labels": n["metadata"].get("labels"),
                    "annotations": n["metadata"].get("annotations"),
                    "unschedulable": n["spec"].get("unschedulable", False),
                }
                for name, n in nodes.items()
            },
            "pods": {
                f"{p['metadata']['namespace']}/{p['metadata']['name']}": {
                    "node": p["spec"].get("nodeName"),
                    "ready": is_ready(p),
                    "terminating": bool(p["metadata"].get("deletionTimestamp")),
                }
                for p in self._list("/api/v1/pods")
            },
            "stand-ins": {
                "errors": self.cluster.errors[-20:],
                "at_unload": self.cluster.at_unload,
                "in_place": self.cluster.in_place,
            },
            "upgrade-libs": self.libs.tail(40),
        }

    # --- the verdicts ---

    def begin(self) -> None:
        """A step starts: what its verdicts are measured from."""
        self.in_place = dict(self.cluster.in_place)

    def judge(self, path: str) -> list[str]:
        """The step's upgrade (``path``: ``tests.soak.model.upgrade_path``) and what the
        timeline saw in it."""
        problems = self.timeline.feed(self.watcher.take(), path)
        stalled = {n: a for n, a in self.cluster.at_unload.items() if any(a)}
        if stalled:
            problems.append(f"a driver unload waited for consumers: {stalled}")
        restarted = {
            n: self.cluster.in_place.get(n, 0) - self.in_place.get(n, 0) for n in self.nodes
        }
        want = 1 if path == "restart-only" else 0
        if any(count != want for count in restarted.values()):
            problems.append(f"in-place driver restarts {restarted} on a {path!r} step")
        return problems


async def start_upgrades(
    cp: ControlPlane,
    namespace: str,
    nodes: tuple[str, ...],
    leave: Callable[[dict[str, Any]], bool],
) -> Upgrades:
    """The libs' state machine, the consumers, the stand-ins and the watcher running;
    ``leave``: the pods and DaemonSets the world's own stand-in runs."""
    libs = await asyncio.to_thread(libs_env.start, cp, namespace=namespace)
    api = await api_client(cp)
    paths = {
        "node": "/api/v1/nodes",
        "pod": "/api/v1/pods",
        "service": f"/api/v1/namespaces/{namespace}/services",
    }
    cluster = Cluster(
        api,
        nodes,
        namespaces=(CONSUMERS,),
        stop_seconds=_stop_seconds,
        consumer=is_consumer,
        leave=leave,
    )
    up = Upgrades(
        cp,
        namespace,
        nodes,
        libs,
        api,
        cluster,
        Watcher(api, paths),
        Timeline(CONSUMERS, namespace),
    )
    try:
        await asyncio.to_thread(cp.ensure_namespace, CONSUMERS)
        validator = validator_daemonset()
        validator["metadata"].update(name=VALIDATOR_DS, namespace=namespace)
        await asyncio.to_thread(cp.apply_manifests, [exporter_daemonset(), validator])
        await asyncio.to_thread(_prepare, cp)
        up.tasks = [
            asyncio.ensure_future(cluster.run(up.stop)),
            asyncio.ensure_future(up.watcher.run(up.stop)),
        ]
        await asyncio.wait_for(up.watcher.started(), 60)
    except BaseException:
        await stop_upgrades(up)
        raise
    return up


async def stop_upgrades(up: Upgrades) -> None:
    up.stop.set()
    await asyncio.gather(*up.tasks, return_exceptions=True)
    await up.api.close()
    up.libs.stop()
