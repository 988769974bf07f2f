"""Stand-ins for the real gpu-operator upgrade flow (issue 14): what a cluster would do
around gpu-operator and its upgrade library (k8s-operator-libs), on a control plane with
no kubelet and no controllers.

:class:`Cluster` plays, in one loop (so the three never race each other):

- the **DaemonSet controller**, for gpu-operator's DaemonSets and the test's own: a
  ControllerRevision per pod template (named ``<ds>-<hash>``, labelled with the
  DaemonSet's selector, ``revision`` = newest + 1: what the upgrade library compares the
  driver pods' ``controller-revision-hash`` with), one pod per eligible node
  (``nodeSelector`` and required node affinity, so the parked label moves a prepared
  DaemonSet off a node), pods on nodes no longer eligible deleted (with their own grace
  period), ``OnDelete`` left alone and ``RollingUpdate`` replaced, and the status
  (``desiredNumberScheduled`` = the pods it wants, which the library checks against the
  driver pods it finds);
- the **kubelet**: pods bound to a node become Running with every container Ready (a
  replacement driver pod only once the driver-manager is done); a terminating pod is
  finished (deleted with grace 0, the kubelet's confirmation) once its containers have
  stopped: ``stop_seconds(pod)`` after it was asked to go, at most its termination grace
  period (then they are killed). After a change it touches a harmless node
  label (:data:`BEAT`): the upgrade flow does not watch pods and re-checks them only on
  its 2-minute requeue or on a node label change;
- the **driver-manager** (the new driver pod's init container): on a node whose driver
  was loaded, it parks the operands (``nvidia.com/gpu.deploy.*`` ``true`` ->
  ``paused-for-driver-upgrade``), waits until their pods are gone, unloads the driver
  (which waits while a GPU consumer is still on the node: recorded in ``at_unload``),
  restores the labels, and the driver container starts. When the new pod's
  ``DRIVER_CONFIG_DIGEST`` is the loaded driver's (gpu-operator >= v26.7.0's
  ``shouldSkipUninstall``: the restart-only path) it skips the unload, the modules stay
  loaded and consumers stay (counted in ``in_place``).

:class:`Recorder` watches nodes and pods and keeps every event with its resourceVersion;
with one etcd the resourceVersions are its global revisions, so they order a pod's
deletion against a node's state-label change exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

import testenv
from shared_svc.config import Config
from shared_svc.kube.writer import MERGE_PATCH, raw_request
from testenv import ControlPlane
from testenv import gpu_operator as gpu_env
from testenv import upgrade_examples as ex
from testenv import upgrade_libs as libs_env
from tests.conftest import UPSTREAM_CRDS
from tests.kube import api_client, eventually, watch_events
from tests.svc import service_config

K8sObject = dict[str, Any]

OPERATOR_NS = "gpu-operator"
STATE = "nvidia.com/gpu-driver-upgrade-state"
PARKED = "nvidia.com/gpu-driver-upgrade.parked"
RECORD = "shared-svc.nvidia.com/gpu-driver-upgrade-freed"
DRIVER_DS = "nvidia-driver-daemonset"
# Every driver pod and DaemonSet carries it, ClusterPolicy's and each NVIDIADriver's.
DRIVER_COMPONENT = ("app.kubernetes.io/component", "nvidia-driver")
VALIDATOR_APP = "nvidia-operator-validator"
HASH = "controller-revision-hash"
BEAT = "upgrade-flow.test/kubelet-beat"
PAUSED = "paused-for-driver-upgrade"
# What k8s-driver-manager parks before it unloads the driver (its fetchCurrentLabels).
DEPLOY_KEYS = tuple(
    f"nvidia.com/gpu.deploy.{name}"
    for name in (
        "operator-validator",
        "container-toolkit",
        "device-plugin",
        "gpu-feature-discovery",
        "dcgm-exporter",
        "dcgm",
        "mig-manager",
        "nvsm",
        "sandbox-validator",
        "sandbox-device-plugin",
        "vgpu-device-manager",
    )
)
# The operand pods it waits for (app=...), in the operator namespace.
OPERAND_APPS = (
    VALIDATOR_APP,
    "nvidia-container-toolkit-daemonset",
    "nvidia-device-plugin-daemonset",
    "gpu-feature-discovery",
    "nvidia-dcgm-exporter",
    "nvidia-dcgm",
)
# Field managers of the stand-ins (their node writes are told apart in managedFields).
KUBELET = "test-kubelet"
DS_CONTROLLER = "test-daemonset-controller"
DRIVER_MANAGER = "test-driver-manager"


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _labels(obj: K8sObject) -> dict[str, str]:
    return dict(obj.get("metadata", {}).get("labels") or {})


def _controller_uid(obj: K8sObject) -> str | None:
    for ref in obj["metadata"].get("ownerReferences") or []:
        if ref.get("controller"):
            uid: str = ref["uid"]
            return uid
    return None


def is_driver(obj: K8sObject) -> bool:
    """A driver pod or DaemonSet of gpu-operator, in either mode."""
    key, value = DRIVER_COMPONENT
    labels = _labels(obj)
    return labels.get(key) == value or labels.get("app") == DRIVER_DS


def is_ready(pod: K8sObject) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running":
        return False
    statuses = status.get("containerStatuses") or []
    return bool(statuses) and all(s.get("ready") for s in statuses)


def _expression_holds(expr: dict[str, Any], labels: dict[str, str]) -> bool:
    key, op, values = expr["key"], expr["operator"], expr.get("values") or []
    if op == "In":
        return key in labels and labels[key] in values
    if op == "NotIn":
        return key not in labels or labels[key] not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    raise AssertionError(f"node affinity operator {op} not played by the stand-in")


def node_eligible(template_spec: dict[str, Any], node: K8sObject) -> bool:
    """The DaemonSet controller's placement: nodeSelector and required node affinity
    (terms ORed, expressions ANDed); enforced on running pods too."""
    labels = _labels(node)
    selector = template_spec.get("nodeSelector") or {}
    if any(labels.get(k) != v for k, v in selector.items()):
        return False
    required = (
        ((template_spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"
        )
        or {}
    ).get("nodeSelectorTerms")
    if not required:
        return True
    return any(
        all(_expression_holds(e, labels) for e in term.get("matchExpressions") or [])
        for term in required
    )


def driver_digest(pod_spec: dict[str, Any]) -> str | None:
    """The driver container's ``DRIVER_CONFIG_DIGEST`` (what driver-manager compares with
    the loaded driver's), or None."""
    for container in pod_spec.get("containers") or []:
        for env in container.get("env") or []:
            if env.get("name") == "DRIVER_CONFIG_DIGEST" and env.get("value"):
                return str(env["value"])
    return None


def template_hash(template: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


async def list_items(api: ApiClient, path: str) -> list[K8sObject]:
    items: list[K8sObject] = (await raw_request(api, "GET", path))["items"]
    return items


async def patch_node_labels(
    api: ApiClient, node: str, labels: dict[str, str | None], manager: str
) -> None:
    await raw_request(
        api,
        "PATCH",
        f"/api/v1/nodes/{node}",
        body={"metadata": {"labels": labels}},
        content_type=MERGE_PATCH,
        query=[("fieldManager", manager)],
    )


@dataclass
class _Unload:
    """The driver-manager's progress on one replacement driver pod."""

    node: str
    parked: list[str] = field(default_factory=list)
    phase: str = "park"
    keep_loaded: bool = False  # the new pod's driver config is the loaded one


class Cluster:
    """DaemonSet controller, kubelet and driver-manager for ``nodes`` (see the module doc).

    ``stop_seconds(pod)``: how long the pod's containers take to stop once asked (its
    grace period caps it). ``consumer(pod)``: the pod keeps the driver from unloading.
    ``leave(obj)``: a DaemonSet, or a pod, that another stand-in runs (the driver-manager
    still waits for such an operand pod to go before it unloads)."""

    def __init__(
        self,
        api: ApiClient,
        nodes: tuple[str, ...],
        *,
        namespaces: tuple[str, ...],
        stop_seconds: Callable[[K8sObject], float],
        consumer: Callable[[K8sObject], bool],
        tick: float = 0.1,
        leave: Callable[[K8sObject], bool] = lambda obj: False,
    ) -> None:
        self.api = api
        self.nodes = nodes
        self.namespaces = (OPERATOR_NS, *namespaces)
        self.stop_seconds = stop_seconds
        self.consumer = consumer
        self.tick = tick
        self.leave = leave
        self.errors: list[str] = []
        # node -> names of consumers still on it when its driver was to be unloaded
        self.at_unload: dict[str, list[list[str]]] = {}
        # node -> driver restarts that kept the modules loaded (the digest was the loaded one)
        self.in_place: dict[str, int] = {}
        # nodes whose driver module is loaded -> the DRIVER_CONFIG_DIGEST it was installed with
        self._loaded: dict[str, str | None] = {}
        self._unloads: dict[str, _Unload] = {}  # replacement driver pod uid -> progress
        self._unloaded: set[str] = set()  # replacement driver pods whose unload is done
        self._terminating: dict[str, float] = {}  # pod uid -> monotonic time it may go
        self._beats: set[str] = set()
        self._beat = itertools.count()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.step()
            except (ApiException, aiohttp.ClientError, TimeoutError) as exc:
                # A conflict or a blip: the next tick looks again (as the real ones do).
                self.errors.append(f"{type(exc).__name__}: {getattr(exc, 'status', exc)}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.tick)

    async def step(self) -> None:
        nodes = {
            n["metadata"]["name"]: n
            for n in await list_items(self.api, "/api/v1/nodes")
            if n["metadata"]["name"] in self.nodes
        }
        every = [p for p in await list_items(self.api, "/api/v1/pods") if self._ours(p)]
        if await self._kubelet_finish([p for p in every if not self.leave(p)]):
            every = [p for p in await list_items(self.api, "/api/v1/pods") if self._ours(p)]
        pods = [p for p in every if not self.leave(p)]
        daemonsets = [
            d
            for d in await list_items(self.api, "/apis/apps/v1/daemonsets")
            if d["metadata"]["namespace"] in self.namespaces and not self.leave(d)
        ]
        revisions = await list_items(self.api, "/apis/apps/v1/controllerrevisions")
        for ds in daemonsets:
            await self._daemonset(ds, nodes, pods, revisions)
        await self._driver_manager(nodes, every)
        await self._kubelet_start(pods)
        beats, self._beats = self._beats, set()
        for node in sorted(beats):
            await patch_node_labels(self.api, node, {BEAT: str(next(self._beat))}, KUBELET)

    def _ours(self, pod: K8sObject) -> bool:
        return (
            pod["spec"].get("nodeName") in self.nodes
            and pod["metadata"]["namespace"] in self.namespaces
        )

    # --- kubelet ---

    async def _kubelet_finish(self, pods: list[K8sObject]) -> bool:
        """Finishes terminating pods whose containers stopped; True if any went."""
        went = False
        clock = time.monotonic()
        for pod in pods:
            meta = pod["metadata"]
            if not meta.get("deletionTimestamp"):
                continue
            grace = float(meta.get("deletionGracePeriodSeconds") or 0)
            due = self._terminating.setdefault(
                meta["uid"], clock + min(self.stop_seconds(pod), grace)
            )
            if clock < due:
                continue
            path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
            body = {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}}
            try:
                await raw_request(self.api, "DELETE", path, body=body)
            except ApiException as exc:
                if exc.status not in (404, 409):
                    raise
            self._terminating.pop(meta["uid"], None)
            self._beats.add(pod["spec"]["nodeName"])
            went = True
        return went

    async def _kubelet_start(self, pods: list[K8sObject]) -> None:
        for pod in pods:
            meta = pod["metadata"]
            node = pod["spec"]["nodeName"]
            driver = is_driver(pod)
            if driver and is_ready(pod):
                self._loaded[node] = driver_digest(pod["spec"])
            if meta.get("deletionTimestamp") or is_ready(pod):
                continue
            if driver:
                if node in self._loaded and meta["uid"] not in self._unloaded:
                    digest = driver_digest(pod["spec"])
                    keep = digest is not None and digest == self._loaded[node]
                    self._unloads.setdefault(meta["uid"], _Unload(node, keep_loaded=keep))
                    continue  # its init container (the driver-manager) is still at work
                self._loaded[node] = driver_digest(pod["spec"])
            await self.make_ready(pod)
            self._beats.add(node)

    async def make_ready(self, pod: K8sObject) -> None:
        meta = pod["metadata"]
        started = now_rfc3339()
        statuses = [
            {
                "name": c["name"],
                "image": c.get("image") or "unknown",
                "imageID": "",
                "ready": True,
                "started": True,
                "restartCount": 0,
                "state": {"running": {"startedAt": started}},
            }
            for c in pod["spec"]["containers"]
        ]
        status = {
            "status": {
                "phase": "Running",
                "hostIP": "192.0.2.10",
                "podIP": "10.244.0.10",
                "startTime": started,
                "conditions": [
                    {"type": t, "status": "True", "lastTransitionTime": started}
                    for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
                ],
                "containerStatuses": statuses,
            }
        }
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status"
        try:
            await raw_request(self.api, "PATCH", path, body=status, content_type=MERGE_PATCH)
        except ApiException as exc:
            if exc.status != 404:
                raise

    # --- driver-manager ---

    async def _driver_manager(self, nodes: dict[str, K8sObject], pods: list[K8sObject]) -> None:
        live = {p["metadata"]["uid"] for p in pods}
        for uid, unload in list(self._unloads.items()):
            if uid not in live:
                del self._unloads[uid]
                continue
            node = nodes.get(unload.node)
            if node is None:
                continue
            labels = _labels(node)
            if unload.phase == "park":
                unload.parked = [k for k in DEPLOY_KEYS if labels.get(k) == "true"]
                if unload.parked:
                    await patch_node_labels(
                        self.api, unload.node, dict.fromkeys(unload.parked, PAUSED), DRIVER_MANAGER
                    )
                unload.phase = "operands"
            elif unload.phase == "operands":
                if not any(
                    p["spec"]["nodeName"] == unload.node
                    and p["metadata"]["namespace"] == OPERATOR_NS
                    and _labels(p).get("app") in OPERAND_APPS
                    for p in pods
                ):
                    unload.phase = "unload"
            elif unload.phase == "unload" and unload.keep_loaded:
                # shouldSkipUninstall: the same driver config is loaded; nothing to unload
                self.in_place[unload.node] = self.in_place.get(unload.node, 0) + 1
                if unload.parked:
                    await patch_node_labels(
                        self.api, unload.node, dict.fromkeys(unload.parked, "true"), DRIVER_MANAGER
                    )
                self._unloaded.add(uid)
                del self._unloads[uid]
            elif unload.phase == "unload":
                holding = sorted(
                    f"{p['metadata']['namespace']}/{p['metadata']['name']}"
                    for p in pods
                    if p["spec"]["nodeName"] == unload.node and self.consumer(p)
                )
                attempts = self.at_unload.setdefault(unload.node, [])
                if not attempts or attempts[-1] != holding:
                    attempts.append(holding)
                if not holding:  # rmmod succeeds; else it retries (the module is busy)
                    if unload.parked:
                        await patch_node_labels(
                            self.api,
                            unload.node,
                            dict.fromkeys(unload.parked, "true"),
                            DRIVER_MANAGER,
                        )
                    self._unloaded.add(uid)
                    del self._unloads[uid]

    # --- DaemonSet controller ---

    async def _daemonset(
        self,
        ds: K8sObject,
        nodes: dict[str, K8sObject],
        pods: list[K8sObject],
        revisions: list[K8sObject],
    ) -> None:
        meta, spec = ds["metadata"], ds["spec"]
        name, ns, uid = meta["name"], meta["namespace"], meta["uid"]
        template = spec["template"]
        current = template_hash(template)
        await self._revision(ds, current, revisions)
        owned = [p for p in pods if _controller_uid(p) == uid]
        strategy = (spec.get("updateStrategy") or {}).get("type", "RollingUpdate")
        wanted = 0
        for node_name, node in sorted(nodes.items()):
            here = [p for p in owned if p["spec"]["nodeName"] == node_name]
            live = [p for p in here if not p["metadata"].get("deletionTimestamp")]
            if not node_eligible(template["spec"], node):
                for pod in live:
                    await self._delete(pod)
                continue
            if not here and is_driver(ds) and self._other_driver(ds, node_name, pods):
                continue  # not this DaemonSet's node yet (see _other_driver)
            wanted += 1
            if strategy == "RollingUpdate":
                for pod in live:
                    if _labels(pod).get(HASH) != current:
                        await self._delete(pod)
            if not here:
                await self._create_pod(ds, node_name, current)
        updated = [p for p in owned if _labels(p).get(HASH) == current]
        ready = sum(1 for p in owned if is_ready(p) and not p["metadata"].get("deletionTimestamp"))
        status = {
            "observedGeneration": meta.get("generation", 1),
            "desiredNumberScheduled": wanted,
            "currentNumberScheduled": len(owned),
            "updatedNumberScheduled": len(updated),
            "numberMisscheduled": 0,
            "numberReady": ready,
            "numberAvailable": ready,
            "numberUnavailable": max(wanted - ready, 0),
        }
        old = ds.get("status") or {}
        if any(old.get(k, 0) != v for k, v in status.items()):
            await raw_request(
                self.api,
                "PATCH",
                f"/apis/apps/v1/namespaces/{ns}/daemonsets/{name}/status",
                body={"status": status},
                content_type=MERGE_PATCH,
                query=[("fieldManager", DS_CONTROLLER)],
            )

    @staticmethod
    def _other_driver(ds: K8sObject, node: str, pods: list[K8sObject]) -> bool:
        """Another driver pod is on the node (an orphaned ClusterPolicy driver pod after the
        switch to NVIDIADriver mode, another NVIDIADriver's): the node is not this
        DaemonSet's yet (not scheduled, not counted in ``desiredNumberScheduled``); it gets
        its driver pod once that one is gone (the upgrade flow deletes an orphaned driver
        pod in pod-restart-required), as one node runs one driver."""
        uid = ds["metadata"]["uid"]
        return any(
            p["spec"].get("nodeName") == node and is_driver(p) and _controller_uid(p) != uid
            for p in pods
        )

    async def _revision(self, ds: K8sObject, current: str, revisions: list[K8sObject]) -> None:
        meta = ds["metadata"]
        mine = [r for r in revisions if _controller_uid(r) == meta["uid"]]
        newest = max((int(r.get("revision", 0)) for r in mine), default=0)
        name = f"{meta['name']}-{current}"
        found = next((r for r in mine if r["metadata"]["name"] == name), None)
        path = f"/apis/apps/v1/namespaces/{meta['namespace']}/controllerrevisions"
        if found is None:
            body = {
                "apiVersion": "apps/v1",
                "kind": "ControllerRevision",
                "metadata": {
                    "name": name,
                    "namespace": meta["namespace"],
                    "labels": {**ds["spec"]["selector"]["matchLabels"], HASH: current},
                    "ownerReferences": [self._owner(ds)],
                },
                "data": {"spec": {"template": ds["spec"]["template"]}},
                "revision": newest + 1,
            }
            await raw_request(self.api, "POST", path, body=body)
        elif int(found.get("revision", 0)) != newest:
            await raw_request(
                self.api,
                "PATCH",
                f"{path}/{name}",
                body={"revision": newest + 1},
                content_type=MERGE_PATCH,
            )
        else:
            return
        # A new revision is what starts an upgrade; the flow notices on a node label change.
        self._beats.update(self.nodes)

    @staticmethod
    def _owner(ds: K8sObject) -> dict[str, Any]:
        return {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "name": ds["metadata"]["name"],
            "uid": ds["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }

    async def _create_pod(self, ds: K8sObject, node: str, current: str) -> None:
        template = ds["spec"]["template"]
        tmeta = template.get("metadata") or {}
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "generateName": f"{ds['metadata']['name']}-",
                "namespace": ds["metadata"]["namespace"],
                "labels": {
                    **(tmeta.get("labels") or {}),
                    HASH: current,
                    "pod-template-generation": str(ds["metadata"].get("generation", 1)),
                },
                "annotations": dict(tmeta.get("annotations") or {}),
                "ownerReferences": [self._owner(ds)],
            },
            "spec": {**template["spec"], "nodeName": node},
        }
        await raw_request(
            self.api,
            "POST",
            f"/api/v1/namespaces/{ds['metadata']['namespace']}/pods",
            body=body,
            query=[("fieldManager", DS_CONTROLLER)],
        )

    async def _delete(self, pod: K8sObject) -> None:
        meta = pod["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        body = {"preconditions": {"uid": meta["uid"]}}  # the pod's own grace period
        try:
            await raw_request(self.api, "DELETE", path, body=body)
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise


# --- the recorder ---


@dataclass
class Event:
    kind: str  # "node" or "pod"
    type: str  # ADDED, MODIFIED, DELETED
    rv: int
    at: float  # monotonic, when it arrived
    obj: K8sObject

    @property
    def name(self) -> str:
        name: str = self.obj["metadata"]["name"]
        return name

    @property
    def uid(self) -> str:
        uid: str = self.obj["metadata"]["uid"]
        return uid


class Recorder:
    """Every node and pod event from the moment it started (list, then watch from there)."""

    def __init__(self, api: ApiClient) -> None:
        self.api = api
        self.events: list[Event] = []
        self.start_rv = 0
        self._ready = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        lists = [await raw_request(self.api, "GET", p) for p in ("/api/v1/nodes", "/api/v1/pods")]
        self.start_rv = min(int(data["metadata"]["resourceVersion"]) for data in lists)
        watches = [
            asyncio.ensure_future(self._watch(kind, path, data["metadata"]["resourceVersion"]))
            for kind, path, data in zip(
                ("node", "pod"), ("/api/v1/nodes", "/api/v1/pods"), lists, strict=True
            )
        ]
        self._ready.set()
        try:
            await stop.wait()
        finally:
            failed = [t.exception() for t in watches if t.done() and not t.cancelled()]
            for task in watches:
                task.cancel()
            await asyncio.gather(*watches, return_exceptions=True)
        for exc in failed:  # a watch that ended early: the record would have a hole
            raise AssertionError(f"the recorder's watch ended early: {exc!r}")

    async def started(self) -> None:
        await self._ready.wait()

    async def _watch(self, kind: str, path: str, rv: str) -> None:
        async for event in watch_events(self.api, path, rv, seconds=600):
            obj = event.get("object") or {}
            if event.get("type") not in ("ADDED", "MODIFIED", "DELETED"):
                raise AssertionError(f"{kind} watch: {event}")
            rv_now = int(obj["metadata"]["resourceVersion"])
            self.events.append(Event(kind, event["type"], rv_now, time.monotonic(), obj))

    # --- questions ---

    def node_events(self, node: str) -> list[Event]:
        return [e for e in self.events if e.kind == "node" and e.name == node]

    def states(self, node: str) -> list[tuple[int, str | None]]:
        """The node's state-label values in order, each with the revision it appeared at."""
        out: list[tuple[int, str | None]] = []
        for e in self.node_events(node):
            value = _labels(e.obj).get(STATE)
            if not out or out[-1][1] != value:
                out.append((e.rv, value))
        return out

    def reached(self, node: str, state: str) -> int | None:
        """The revision at which ``node`` first had ``state``."""
        return next((rv for rv, value in self.states(node) if value == state), None)

    def reached_after(self, node: str, state: str, after: int) -> int:
        """The revision at which ``node`` first had ``state`` after revision ``after``."""
        rv = next((r for r, value in self.states(node) if value == state and r > after), None)
        assert rv is not None, f"{node} never reached {state} after {after}: {self.states(node)}"
        return rv

    def not_through_restart(self, nodes: tuple[str, ...], after: int) -> str | None:
        """Which of ``nodes`` has not been in pod-restart-required since ``after``, or None."""
        for node in nodes:
            if not any(v == "pod-restart-required" and r > after for r, v in self.states(node)):
                return f"{node} not through pod-restart-required yet: {self.states(node)}"
        return None

    def label_changes(self, node: str, key: str) -> list[tuple[int, str | None]]:
        out: list[tuple[int, str | None]] = []
        for e in self.node_events(node):
            value = _labels(e.obj).get(key)
            if not out or out[-1][1] != value:
                out.append((e.rv, value))
        return out

    def pod_deleted(self, uid: str) -> int | None:
        """The revision at which the pod with ``uid`` was removed (its DELETED event)."""
        return next(
            (e.rv for e in self.events if e.kind == "pod" and e.type == "DELETED" and e.uid == uid),
            None,
        )

    def pod_deletion_requested(self, uid: str) -> int | None:
        """The revision at which the pod first had a deletionTimestamp."""
        return next(
            (
                e.rv
                for e in self.events
                if e.kind == "pod" and e.uid == uid and e.obj["metadata"].get("deletionTimestamp")
            ),
            None,
        )

    def managers_of_node_keys(self, node: str) -> dict[str, set[str]]:
        """For each field manager: every label/annotation/spec field it owned in any
        version of the node seen (``labels:<key>``, ``annotations:<key>``, ``spec:<f>``)."""
        owned: dict[str, set[str]] = {}
        for e in self.node_events(node):
            for entry in e.obj["metadata"].get("managedFields") or []:
                fields = owned.setdefault(entry["manager"], set())
                meta = (entry.get("fieldsV1") or {}).get("f:metadata") or {}
                for section in ("labels", "annotations"):
                    for key in meta.get(f"f:{section}") or {}:
                        if key.startswith("f:"):
                            fields.add(f"{section}:{key[2:]}")
                for key in (entry.get("fieldsV1") or {}).get("f:spec") or {}:
                    fields.add(f"spec:{key[2:]}")
        return owned

    def dropped_keys(self, node: str) -> set[str]:
        """Every label or annotation (``labels:<key>``, ``annotations:<key>``) that one
        version of the node had and the next did not."""
        dropped: set[str] = set()
        previous: set[str] | None = None
        for e in self.node_events(node):
            meta = e.obj["metadata"]
            keys = {f"labels:{k}" for k in meta.get("labels") or {}} | {
                f"annotations:{k}" for k in meta.get("annotations") or {}
            }
            if previous is not None:
                dropped |= previous - keys
            previous = keys
        return dropped

    def timeline(self, namespaces: tuple[str, ...]) -> str:
        """The recorded node state/parked/cordon changes and the pod deletions in
        ``namespaces``, one line each (for failure messages)."""
        lines: list[str] = []
        seen: dict[str, tuple[Any, ...]] = {}
        t0 = self.events[0].at if self.events else 0.0
        for e in self.events:
            meta = e.obj["metadata"]
            if e.kind == "node":
                labels = meta.get("labels") or {}
                what: tuple[Any, ...] = (
                    labels.get(STATE),
                    f"parked={labels.get(PARKED)}",
                    f"record={RECORD in (meta.get('annotations') or {})}",
                    f"cordoned={bool(e.obj['spec'].get('unschedulable'))}",
                )
                if seen.get(e.name) == what:
                    continue
                seen[e.name] = what
            elif meta["namespace"] in namespaces and (
                e.type == "DELETED" or meta.get("deletionTimestamp")
            ):
                key = f"{meta['namespace']}/{e.name}"
                what = ("gone",) if e.type == "DELETED" else ("terminating",)
                if seen.get(key) == what:
                    continue
                seen[key] = what
            else:
                continue
            lines.append(
                f"{e.at - t0:7.3f}s rv {e.rv} {e.kind} {e.name}: {' '.join(map(str, what))}"
            )
        return "\n".join(lines)


@contextlib.contextmanager
def explained(rec: Recorder, namespaces: tuple[str, ...]) -> Iterator[None]:
    """A failed assertion inside comes with the recorded timeline."""
    try:
        yield
    except AssertionError as exc:
        raise AssertionError(f"{exc}\ntimeline:\n{rec.timeline(namespaces)}") from None


# --- the GPU consumers of the flow tests, and waiting for the flow ---
#
# On each node: a declared consumer pod, a pod of a DaemonSet prepared with
# ``shared-svc upgrade prepare-daemonset``, both with a 5 s termination grace period they use
# in full (or 3 s), and an unrelated pod. The flows run on these two nodes.

NODES = ("gpu-node-0", "gpu-node-1")
APPS = "ml"  # the consumers' namespace
CONSUMER_KEY = "nvidia.com/gpu-driver-upgrade.consumer"
CONSUMER = {CONSUMER_KEY: "true"}
EXPORTER = "gpu-exporter"  # the prepared DaemonSet
GRACE = 5
FLOW_TIMEOUT = 240.0  # the flow's own 2-minute requeue fits in it, should a beat be missed


# The upgrade policy of the flow tests: one node at a time, gpu-operator's defaults else
# (the gate is set by `shared-svc upgrade configure-gate`, or removed, by each test).
UPGRADE_POLICY: dict[str, Any] = {
    "autoUpgrade": True,
    "maxParallelUpgrades": 1,
    "podDeletion": {"force": False, "timeoutSeconds": 300, "deleteEmptyDir": False},
    "drain": {"enable": False, "force": False, "timeoutSeconds": 300},
}


@contextlib.contextmanager
def libs_plane(workdir: Path) -> Iterator[ControlPlane]:
    """A control plane of a libs-flow module's own (the flow acts on every node): the GPU
    nodes, and gpu-operator v26.7's NVIDIADriver CRD, which its chart installs in every mode
    (the libs' driver watches NVIDIADrivers as its upgrade controller does)."""
    try:
        cp = testenv.start(workdir)
        cp.install_crds([UPSTREAM_CRDS / "nvidia.com_nvidiadrivers.yaml"])
    except testenv.ControlPlaneError as exc:
        pytest.fail(f"control plane for the upgrade libs did not start: {exc}", pytrace=False)
    try:
        for node in NODES:
            gpu_env.add_gpu_node(
                cp,
                node,
                labels={
                    "nvidia.com/gpu.deploy.driver": "true",
                    "nvidia.com/gpu.deploy.operator-validator": "true",
                },
            )
        yield cp
    finally:
        cp.stop()


@contextlib.asynccontextmanager
async def libs_stand_ins(
    cp: ControlPlane, stop_seconds: Callable[[K8sObject], float], **libs: Any
) -> AsyncIterator[tuple[libs_env.UpgradeLibs, ApiClient, Cluster]]:
    """The libs' state machine running against ``cp`` (``libs``: ``libs_env.start``'s
    options), a client, and the stand-ins (:class:`Cluster`) running until the block ends."""
    try:
        driver = await asyncio.to_thread(libs_env.start, cp, **libs)
    except testenv.ControlPlaneError as exc:
        pytest.fail(f"upgrade-libs did not start: {exc}", pytrace=False)
    api = await api_client(cp)
    stop = asyncio.Event()
    cluster = Cluster(
        api, NODES, namespaces=(APPS,), stop_seconds=stop_seconds, consumer=is_consumer
    )
    task = asyncio.ensure_future(cluster.run(stop))
    try:
        yield driver, api, cluster
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await api.close()
        driver.stop()


def upgrade_service_config(cp: ControlPlane) -> Config:
    """shared-svc's upgrade controller alone, polling a node its consumers leave every 0.5 s."""
    return service_config(
        cp,
        OPERATOR_NS,
        services_controller=False,
        upgrade_controller=True,
        upgrade_poll_seconds=0.5,
        upgrade_resync_seconds=10.0,
    )


CHART = "helm.sh/chart"
DRIVER_GRACE = 3  # the driver pod's termination grace period


def flow_driver_daemonset(version: str, chart: str) -> dict[str, Any]:
    """gpu-operator's driver DaemonSet as its ClusterPolicy controller writes it (the parts
    the flow reads): its labels, ``OnDelete``, the digest of the driver ``version`` on both
    containers (``digest-<version>``: what gpu-operator hashes), gpu-operator's ``chart``
    label on the template (a ``helm upgrade`` changes only that)."""
    ds = ex.driver_daemonset(f"digest-{version}")
    for key in ("uid", "resourceVersion", "generation"):
        del ds["metadata"][key]
    spec = ds["spec"]["template"]["spec"]
    spec["terminationGracePeriodSeconds"] = DRIVER_GRACE
    spec["containers"][0]["image"] = f"nvcr.io/nvidia/driver:{version}-ubuntu22.04"
    ds["spec"]["template"]["metadata"]["labels"][CHART] = chart
    return ds


def consumer_stop_seconds(pod: K8sObject) -> float:
    """How long a consumer takes to stop once asked (0 for any other pod). They hold the
    GPU: on gpu-node-0 the declared pod uses its whole grace period and the DaemonSet pod
    stops after 3 s, on gpu-node-1 the other way round, so on each node another kind is the
    last to go (and alone holds the gate at the end)."""
    if pod["metadata"]["namespace"] != APPS:
        return 0.0
    app = str((pod["metadata"].get("labels") or {}).get("app"))
    last = {"trainer": NODES[0], EXPORTER: NODES[1]}.get(app)
    if last is None:
        return float(GRACE)
    return float(GRACE) if pod["spec"]["nodeName"] == last else 3.0


def is_consumer(pod: K8sObject) -> bool:
    labels = pod["metadata"].get("labels") or {}
    return pod["metadata"]["namespace"] == APPS and labels.get(CONSUMER_KEY) == "true"


async def post(api: ApiClient, path: str, body: dict[str, Any]) -> None:
    """Creates ``body`` (already there: fine)."""
    try:
        await raw_request(api, "POST", path, body=body)
    except ApiException as exc:
        if exc.status != 409:
            raise


def exporter_daemonset() -> dict[str, Any]:
    """A GPU-consumer DaemonSet (a standalone dcgm-exporter, say), not yet prepared."""
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": EXPORTER, "namespace": APPS},
        "spec": {
            "selector": {"matchLabels": {"app": EXPORTER}},
            "template": {
                "metadata": {"labels": {"app": EXPORTER}},
                "spec": {
                    "terminationGracePeriodSeconds": GRACE,
                    "containers": [{"name": "exporter", "image": "registry.invalid/exporter:1"}],
                },
            },
        },
    }


def validator_daemonset() -> dict[str, Any]:
    """gpu-operator's validator DaemonSet (the flow waits for its pod in validation-required)."""
    labels = {"app": VALIDATOR_APP}
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": VALIDATOR_APP, "namespace": OPERATOR_NS, "labels": labels},
        "spec": {
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeSelector": {"nvidia.com/gpu.deploy.operator-validator": "true"},
                    "containers": [{"name": "validator", "image": "validator:1"}],
                },
            },
        },
    }


def bare_pod(name: str, node: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": APPS, "labels": labels},
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": GRACE,
            "containers": [{"name": "c", "image": "registry.invalid/app:1"}],
        },
    }


async def workloads(api: ApiClient) -> tuple[dict[str, K8sObject], ...]:
    """The declared pod and the unrelated pod on each node (created if an earlier upgrade
    evicted them), all Ready; returns them (node -> pod) and the prepared DaemonSet's pods,
    as (declared, exporter, unrelated)."""
    for node in NODES:
        for name, labels in (
            (f"trainer-{node}", {"app": "trainer", **CONSUMER}),
            (f"web-{node}", {"app": "web"}),
        ):
            await post(api, f"/api/v1/namespaces/{APPS}/pods", bare_pod(name, node, labels))

    async def ready() -> tuple[dict[str, K8sObject], ...] | None:
        pods = await list_items(api, f"/api/v1/namespaces/{APPS}/pods")
        out: tuple[dict[str, K8sObject], ...] = ({}, {}, {})
        for pod in pods:
            if pod["metadata"].get("deletionTimestamp") or not is_ready(pod):
                continue
            app = str((pod["metadata"].get("labels") or {}).get("app"))
            index = {"trainer": 0, EXPORTER: 1, "web": 2}[app]
            out[index][pod["spec"]["nodeName"]] = pod
        return out if all(len(part) == len(NODES) for part in out) else None

    result: tuple[dict[str, K8sObject], ...] = await eventually(ready, timeout=60)
    for pod in result[1].values():  # the prepare-daemonset template: label and affinity
        assert pod["metadata"]["labels"][CONSUMER_KEY] == "true"
        terms = pod["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]["nodeSelectorTerms"]
        assert all(
            {"key": PARKED, "operator": "DoesNotExist"} in t["matchExpressions"] for t in terms
        )
    return result


async def node_events(api: ApiClient, node: str, reason: str, after: int = 0) -> list[K8sObject]:
    """The Events of ``reason`` regarding the Node ``node`` written after revision ``after``."""
    items = await list_items(api, "/apis/events.k8s.io/v1/namespaces/default/events")
    return [
        e
        for e in items
        if e.get("reason") == reason
        and (e.get("regarding") or {}).get("kind") == "Node"
        and e["regarding"]["name"] == node
        and int(e["metadata"]["resourceVersion"]) > after
    ]


def pod_key(pod: K8sObject) -> str:
    return f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"


async def wait_until(
    what: str, check: Callable[[], Awaitable[str | None]], context: Callable[[], str]
) -> None:
    """Polls ``check`` (what is missing, or None) until it says nothing is, at most
    FLOW_TIMEOUT seconds; fails with the last answer and ``context()``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + FLOW_TIMEOUT
    while (missing := await check()) is not None:
        if loop.time() > deadline:
            raise AssertionError(f"{what} not done within {FLOW_TIMEOUT}s: {missing}; {context()}")
        await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def recording(api: ApiClient) -> AsyncIterator[Recorder]:
    """A :class:`Recorder` watching from now until the block ends."""
    rec = Recorder(api)
    stop = asyncio.Event()
    task = asyncio.ensure_future(rec.run(stop))
    try:
        await rec.started()
        yield rec
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def newest_revision_hashes(revisions: list[K8sObject]) -> dict[str, str]:
    """By DaemonSet uid, the hash of its newest ControllerRevision among ``revisions``
    (what the upgrade library compares the driver pods' ``controller-revision-hash`` with)."""
    newest: dict[str, K8sObject] = {}
    for r in revisions:
        owner = _controller_uid(r)
        if owner and (owner not in newest or int(r["revision"]) > int(newest[owner]["revision"])):
            newest[owner] = r
    return {owner: str(_labels(r).get(HASH)) for owner, r in newest.items()}


async def newest_driver_hashes(api: ApiClient) -> dict[str, str]:
    """By driver DaemonSet uid (ClusterPolicy's, or each NVIDIADriver's), the hash of its
    newest ControllerRevision."""
    path = f"/apis/apps/v1/namespaces/{OPERATOR_NS}/controllerrevisions"
    return newest_revision_hashes(await list_items(api, path))


def unsettled(
    nodes: dict[str, K8sObject],
    pods: list[K8sObject],
    newest: dict[str, str],
    names: tuple[str, ...] = NODES,
    apps: tuple[str, ...] = (VALIDATOR_APP, EXPORTER),
) -> str | None:
    """What is missing before every node of ``names`` is upgrade-done, uncordoned, on the
    newest driver revision (``newest``: :func:`newest_revision_hashes`) with its driver pod
    Ready and a Ready pod of each of ``apps``, with nothing of shared-svc's left on it; None
    when all that holds."""
    for name in names:
        meta = nodes[name]["metadata"]
        labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
        if labels.get(STATE) != "upgrade-done":
            return f"{name}: state {labels.get(STATE)}"
        if PARKED in labels or RECORD in annotations:
            return f"{name}: shared-svc's keys still there"
        if nodes[name]["spec"].get("unschedulable"):
            return f"{name}: still cordoned"
        here = [p for p in pods if p["spec"].get("nodeName") == name]
        driver = [p for p in here if is_driver(p)]
        if len(driver) != 1 or not is_ready(driver[0]):
            return f"{name}: driver pods {[p['metadata']['name'] for p in driver]} not Ready"
        wanted = newest.get(str(_controller_uid(driver[0])))
        if _labels(driver[0]).get(HASH) != wanted:
            return f"{name}: driver pod not of the newest revision {wanted}"
        for app in apps:
            if not any(_labels(p).get("app") == app and is_ready(p) for p in here):
                return f"{name}: no Ready {app} pod"
    return None


async def unsettled_nodes(api: ApiClient) -> str | None:
    """:func:`unsettled` of the flow tests' nodes, read now."""
    newest = await newest_driver_hashes(api)
    nodes = {n["metadata"]["name"]: n for n in await list_items(api, "/api/v1/nodes")}
    return unsettled(nodes, await list_items(api, "/api/v1/pods"), newest)
