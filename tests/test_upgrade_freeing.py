"""The driver-upgrade controller against the real kube-apiserver (no kubelet, no controllers).

What the API server does without a kubelet (observed, kube-apiserver v1.36):
- An accepted eviction of a pod bound to a node (``spec.nodeName``) does not remove it:
  the pod gets ``deletionTimestamp`` and a 30 s grace period and stays, because only the
  kubelet finishes a graceful delete. A plain delete behaves the same. With
  ``gracePeriodSeconds: 0`` the pod is removed at once.
- A PodDisruptionBudget with no status yet refuses evictions with 429 ("still being
  processed"); once its status says ``disruptionsAllowed: 0`` a Running *and Ready* pod
  is refused with 429, while a pod that is not Ready may still be evicted
  (unhealthyPodEvictionPolicy IfHealthyBudget).
- A merge patch carrying a stale ``metadata.resourceVersion`` gets 409.

So these tests play the kubelet (finish terminating pods with grace 0) and the
DaemonSet controller (remove a declared DaemonSet's pod from a parked node) themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

import testenv
from shared_svc.cli import main
from shared_svc.config import Config
from shared_svc.controllers import shared_caches
from shared_svc.controllers.upgrade.io import pods_on_node
from shared_svc.controllers.upgrade.reconciler import UpgradeReconciler
from shared_svc.k8s.events import Report
from shared_svc.kube import writer as kube_writer
from shared_svc.kube.recorder import EventRecorder
from shared_svc.kube.writer import MERGE_PATCH, raw_request
from shared_svc.runtime.controller import controller_for
from shared_svc.runtime.manager import Manager
from shared_svc.wait.ratelimit import BucketRateLimiter
from testenv import upgrade_examples as ex
from tests.apiproxy import ThrottlingProxy, kubeconfig_via
from tests.kube import api_client, eventually, make_namespace, unique

pytestmark = pytest.mark.apiserver

STATE = "nvidia.com/gpu-driver-upgrade-state"
PARKED = "nvidia.com/gpu-driver-upgrade.parked"
RECORD = "shared-svc.nvidia.com/gpu-driver-upgrade-freed"
OPERATOR_NS = "gpu-operator"
CONSUMER = {"nvidia.com/gpu-driver-upgrade.consumer": "true"}


@pytest.fixture
async def ns(api: ApiClient) -> str:
    await make_namespace(api, OPERATOR_NS)
    try:  # pods naming a RuntimeClass are refused unless it exists
        body = {"metadata": {"name": "nvidia"}, "handler": "nvidia"}
        await raw_request(api, "POST", "/apis/node.k8s.io/v1/runtimeclasses", body=body)
    except ApiException as exc:
        if exc.status != 409:
            raise
    return await make_namespace(api, unique("upg"))


@pytest.fixture
async def nodes(api: ApiClient) -> AsyncIterator[Callable[..., Awaitable[str]]]:
    """Creates nodes; deletes them afterwards so later controllers never see them."""
    made: list[str] = []

    async def make(state: str | None = None, **kw: Any) -> str:
        name = unique("gpu-node")
        body = ex.node(name, state=state, **kw)
        for key in ("uid", "resourceVersion"):
            del body["metadata"][key]
        await raw_request(api, "POST", "/api/v1/nodes", body=body)
        made.append(name)
        return name

    yield make
    for name in made:
        with contextlib.suppress(ApiException):
            await raw_request(api, "DELETE", f"/api/v1/nodes/{name}")


def settings(**kw: Any) -> Config:
    base: dict[str, Any] = {
        "upgrade_controller": True,
        "namespace": OPERATOR_NS,
        "upgrade_detection": "evict",
        "upgrade_poll_seconds": 0.2,
        "upgrade_resync_seconds": 1.0,
        "upgrade_eviction_timeout_seconds": 300.0,
        "backoff_base_seconds": 0.05,
        "backoff_max_seconds": 1.0,
    }
    return Config(**{**base, **kw})


class Running:
    """A controller running in the background as the service runs it: its caches from a
    registry of its own, they and its parts run by a Manager; ``stop()`` ends it like
    SIGTERM."""

    def __init__(
        self, api: ApiClient, config: Config, wrap: Callable[[EventRecorder], Any] | None = None
    ) -> None:
        from shared_svc.controllers.upgrade import io as upgrade_io

        self.recorder = EventRecorder(api, reporting_instance=unique("test-upgrade"))
        sender = wrap(self.recorder) if wrap else self.recorder
        caches = shared_caches.registry(api, config)
        self.controller = UpgradeReconciler(
            config,
            sender,
            caches=caches,
            io=upgrade_io.KubeUpgradeIO(
                api,
                config.upgrade_driver_name,
                write_limiter=upgrade_io.upgrade_write_limiter(config),
            ),
        )
        self._stop = asyncio.Event()
        manager = Manager(
            [*caches.runnables(), *controller_for(self.controller).runnables()], lambda: True
        )
        self._task = asyncio.create_task(manager.run(self._stop))

    async def stop(self) -> None:
        self._stop.set()
        assert await asyncio.wait_for(self._task, 20) == []


@pytest.fixture
async def start(api: ApiClient) -> AsyncIterator[Callable[..., Running]]:
    running: list[Running] = []

    def make(**kw: Any) -> Running:
        r = Running(api, settings(**kw))
        running.append(r)
        return r

    yield make
    for r in running:
        await r.stop()


# --- helpers: the test plays kubelet and DaemonSet controller ---


async def create(api: ApiClient, obj: dict[str, Any], *, ready: bool = True) -> dict[str, Any]:
    meta = obj["metadata"]
    meta.pop("uid", None)
    meta.pop("resourceVersion", None)
    meta.pop("deletionTimestamp", None)
    if meta.get("ownerReferences"):
        for ref in meta["ownerReferences"]:
            ref["name"] = ref.get("name", "x")
    path = f"/api/v1/namespaces/{meta['namespace']}/pods"
    created: dict[str, Any] = await raw_request(api, "POST", path, body=obj)
    if ready:
        status = {
            "status": {
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True"}],
            }
        }
        await raw_request(
            api, "PATCH", f"{path}/{meta['name']}/status", body=status, content_type=MERGE_PATCH
        )
    return created


async def pod_state(api: ApiClient, namespace: str, name: str) -> str:
    try:
        pod = await raw_request(api, "GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
    except ApiException as exc:
        if exc.status == 404:
            return "gone"
        raise
    return "terminating" if pod["metadata"].get("deletionTimestamp") else "running"


async def kubelet_finishes(api: ApiClient, node: str) -> None:
    for pod in await pods_on_node(api, node):
        meta = pod["metadata"]
        if meta.get("deletionTimestamp"):
            path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
            try:
                await raw_request(api, "DELETE", path, body={"gracePeriodSeconds": 0})
            except ApiException as exc:
                if exc.status != 404:
                    raise


async def get_node(api: ApiClient, name: str) -> dict[str, Any]:
    node: dict[str, Any] = await raw_request(api, "GET", f"/api/v1/nodes/{name}")
    return node


async def set_state(api: ApiClient, node: str, state: str | None) -> None:
    await raw_request(
        api,
        "PATCH",
        f"/api/v1/nodes/{node}",
        body={"metadata": {"labels": {STATE: state}}},
        content_type=MERGE_PATCH,
    )


async def labels(api: ApiClient, node: str) -> dict[str, str]:
    return dict((await get_node(api, node))["metadata"].get("labels") or {})


async def events(api: ApiClient, node: str) -> list[dict[str, Any]]:
    data = await raw_request(api, "GET", "/apis/events.k8s.io/v1/namespaces/default/events")
    return [e for e in data.get("items", []) if e.get("regarding", {}).get("name") == node]


async def reasons(api: ApiClient, node: str) -> set[str]:
    return {e["reason"] for e in await events(api, node)}


async def has_reason(api: ApiClient, node: str, reason: str) -> bool:
    return reason in await reasons(api, node)


# --- the scenarios ---


async def test_whole_upgrade_sequence_frees_and_restores(
    api: ApiClient, ns: str, nodes: Callable[..., Awaitable[str]], start: Callable[..., Running]
) -> None:
    node = await nodes(state="upgrade-done")
    ds = ex.daemonset("dcgm-standalone", namespace=ns, declared=True)
    ds["metadata"].pop("uid")
    ds["metadata"].pop("resourceVersion")
    ds_live = await raw_request(api, "POST", f"/apis/apps/v1/namespaces/{ns}/daemonsets", body=ds)
    ds_pod = ex.daemonset_pod(ds_live, node_name=node)
    ds_pod["metadata"]["ownerReferences"][0]["name"] = ds_live["metadata"]["name"]
    await create(api, ds_pod)
    await create(api, ex.declared_pod("triton", namespace=ns, node_name=node))
    await create(api, ex.pod("vst", namespace=ns, node_name=node, runtime_class="nvidia"))
    await create(
        api,
        ex.pod(
            "trainer",
            namespace=ns,
            node_name=node,
            runtime_class="nvidia",
            resources={"limits": {"nvidia.com/gpu": "1"}},
        ),
    )
    await create(api, ex.pod("dcgm", namespace=OPERATOR_NS, node_name=node, runtime_class="nvidia"))
    await create(api, ex.pod("web", namespace=ns, node_name=node))
    start()

    await set_state(api, node, "upgrade-required")
    await asyncio.sleep(1.5)  # a resync and several polls: upgrade-required frees nothing
    assert PARKED not in await labels(api, node)
    assert await pod_state(api, ns, "triton") == "running"

    await set_state(api, node, "cordon-required")
    await eventually(lambda: pod_state_is(api, ns, "triton", "terminating"), 20)
    await eventually(lambda: pod_state_is(api, ns, "vst", "terminating"), 20)
    assert (await labels(api, node))[PARKED] == "true"
    assert RECORD in (await get_node(api, node))["metadata"]["annotations"]

    await kubelet_finishes(api, node)  # the kubelet ends the evicted pods
    await asyncio.sleep(1.0)
    assert not await has_reason(api, node, "GPUConsumersFreed")  # the DaemonSet pod still holds it
    ds_pod_name = ds_pod["metadata"]["name"]
    await raw_request(
        api, "DELETE", f"/api/v1/namespaces/{ns}/pods/{ds_pod_name}", body={"gracePeriodSeconds": 0}
    )
    await eventually(lambda: has_reason(api, node, "GPUConsumersFreed"), 20)

    for state in (
        "wait-for-jobs-required",
        "pod-deletion-required",
        "pod-restart-required",
        "validation-required",
        "uncordon-required",
    ):
        await set_state(api, node, state)
        await asyncio.sleep(0.3)
        assert (await labels(api, node))[PARKED] == "true"

    await set_state(api, node, "upgrade-done")
    await eventually(lambda: not_parked(api, node), 20)
    await eventually(lambda: has_reason(api, node, "GPUConsumersRestored"), 20)
    assert RECORD not in ((await get_node(api, node))["metadata"].get("annotations") or {})
    # Never touched: GPU-requesting pods, operator operands, unrelated pods.
    assert await pod_state(api, ns, "trainer") == "running"
    assert await pod_state(api, OPERATOR_NS, "dcgm") == "running"
    assert await pod_state(api, ns, "web") == "running"
    assert (await labels(api, node))[STATE] == "upgrade-done"


# DRA is GA from Kubernetes 1.34: resource.k8s.io/v1 served and the DynamicResourceAllocation
# gate on by default. Before, the gate is off and the API server drops a pod's
# spec.resourceClaims: no pod there holds a claim.
DRA_FROM = "1.34"


def minor_tuple(minor: str) -> tuple[int, ...]:
    return tuple(int(x) for x in minor.split("."))


async def serves(api: ApiClient, group_version: str) -> bool:
    try:
        await raw_request(api, "GET", f"/apis/{group_version}")
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


async def test_a_pod_with_dra_claims_is_left_to_gpu_operator(
    api: ApiClient, ns: str, nodes: Callable[..., Awaitable[str]], start: Callable[..., Running]
) -> None:
    """gpu-operator evicts a pod that holds DRA resource claims itself (its drain and pod
    deletion), so the upgrade controller never frees one: where the API server has DRA on
    (1.34 on: the claim made from a resource.k8s.io/v1 ResourceClaimTemplate, the pod
    keeping ``spec.resourceClaims``), such a pod with a GPU signal stays running through
    the freeing while the detected consumer beside it is evicted, and the node is freed
    without it. Where DRA is off (1.33) the API server drops the claims: the same pod is an
    ordinary detected consumer, and it is evicted."""
    dra = minor_tuple(testenv.kube_version()) >= minor_tuple(DRA_FROM)
    assert await serves(api, "resource.k8s.io/v1") is dra
    node = await nodes(state="upgrade-done")
    if dra:
        template = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": "gpu", "namespace": ns},
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [
                            {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}
                        ]
                    }
                }
            },
        }
        path = f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates"
        await raw_request(api, "POST", path, body=template)
    claimed = ex.pod(
        "claimed", namespace=ns, node_name=node, runtime_class="nvidia", resource_claims=True
    )
    claimed["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    stored = await create(api, claimed)
    assert bool(stored["spec"].get("resourceClaims")) is dra, stored["spec"]
    await create(api, ex.pod("vst", namespace=ns, node_name=node, runtime_class="nvidia"))
    start()

    await set_state(api, node, "cordon-required")
    await eventually(lambda: pod_state_is(api, ns, "vst", "terminating"), 20)
    if not dra:
        await eventually(lambda: pod_state_is(api, ns, "claimed", "terminating"), 20)
    await kubelet_finishes(api, node)
    await eventually(lambda: has_reason(api, node, "GPUConsumersFreed"), 20)
    assert await pod_state(api, ns, "claimed") == ("running" if dra else "gone")
    assert await pod_state(api, ns, "vst") == "gone"


async def pod_state_is(api: ApiClient, namespace: str, name: str, want: str) -> bool:
    return await pod_state(api, namespace, name) == want


async def not_parked(api: ApiClient, node: str) -> bool:
    return PARKED not in await labels(api, node)


async def test_two_nodes_at_once(
    api: ApiClient, ns: str, nodes: Callable[..., Awaitable[str]], start: Callable[..., Running]
) -> None:
    a, b = await nodes(), await nodes()
    await create(api, ex.declared_pod("a1", namespace=ns, node_name=a))
    await create(api, ex.declared_pod("b1", namespace=ns, node_name=b))
    running = start()
    await set_state(api, a, "pod-deletion-required")
    await set_state(api, b, "drain-required")
    await eventually(lambda: pod_state_is(api, ns, "a1", "terminating"), 20)
    await eventually(lambda: pod_state_is(api, ns, "b1", "terminating"), 20)
    status = running.controller.status()["nodes"]
    assert status[a]["phase"] == status[b]["phase"] == "freeing"
    await set_state(api, a, "upgrade-done")
    await eventually(lambda: not_parked(api, a), 20)
    assert (await labels(api, b))[PARKED] == "true"  # each node on its own


async def _blocked_pod(api: ApiClient, ns: str, node: str, name: str) -> None:
    await create(api, ex.declared_pod(name, namespace=ns, node_name=node, labels={"app": name}))
    pdb = {
        "metadata": {"name": name},
        "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": name}}},
    }
    path = f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets"
    await raw_request(api, "POST", path, body=pdb)
    status = {
        "status": {
            "disruptionsAllowed": 0,
            "currentHealthy": 1,
            "desiredHealthy": 1,
            "expectedPods": 1,
            "observedGeneration": 1,
        }
    }
    await raw_request(api, "PATCH", f"{path}/{name}/status", body=status, content_type=MERGE_PATCH)


async def test_pdb_blocks_eviction_warns_and_deletes_only_if_configured(
    api: ApiClient, ns: str, nodes: Callable[..., Awaitable[str]], start: Callable[..., Running]
) -> None:
    node = await nodes()
    await _blocked_pod(api, ns, node, "guarded")
    running = start(upgrade_eviction_timeout_seconds=1.0)
    await set_state(api, node, "cordon-required")
    await eventually(lambda: has_reason(api, node, "GPUConsumerEvictionBlocked"), 20)
    warning = next(
        e for e in await events(api, node) if e["reason"] == "GPUConsumerEvictionBlocked"
    )
    assert warning["type"] == "Warning" and f"{ns}/guarded" in warning["note"]
    await asyncio.sleep(1.0)
    assert await pod_state(api, ns, "guarded") == "running"  # refused, and not deleted
    assert running.controller.status()["nodes"][node]["blocked"] == [f"{ns}/guarded"]
    await running.stop()

    # Same node, a controller configured to delete after the timeout: the clock is in the record.
    start(upgrade_eviction_timeout_seconds=1.0, upgrade_delete_after_timeout=True)
    await eventually(lambda: pod_state_is(api, ns, "guarded", "terminating"), 20)


async def test_restart_in_the_middle_restores_exactly(
    api: ApiClient, ns: str, nodes: Callable[..., Awaitable[str]], start: Callable[..., Running]
) -> None:
    ours = await nodes()
    theirs = await nodes(parked=True)  # an admin parked it before: not ours to unpark
    await create(api, ex.declared_pod("x", namespace=ns, node_name=ours))
    first = start()
    await set_state(api, ours, "pod-restart-required")
    await set_state(api, theirs, "pod-restart-required")
    await eventually(lambda: pod_state_is(api, ns, "x", "terminating"), 20)
    await eventually(lambda: has_record(api, theirs), 20)
    await first.stop()

    await set_state(api, ours, "upgrade-done")
    await set_state(api, theirs, "upgrade-done")
    start()  # a new instance knows only what the nodes say
    await eventually(lambda: not_parked(api, ours), 20)
    await eventually(lambda: no_record(api, theirs), 20)
    assert (await labels(api, theirs))[PARKED] == "true"


async def has_record(api: ApiClient, node: str) -> bool:
    return RECORD in ((await get_node(api, node))["metadata"].get("annotations") or {})


async def no_record(api: ApiClient, node: str) -> bool:
    return not await has_record(api, node)


async def test_label_vanishing_mid_upgrade_restores(
    api: ApiClient, ns: str, nodes: Callable[..., Awaitable[str]], start: Callable[..., Running]
) -> None:
    node = await nodes()
    start()
    await set_state(api, node, "pod-restart-required")
    await eventually(lambda: has_record(api, node), 20)
    await set_state(api, node, None)  # gpu-operator's autoUpgrade turned off
    await eventually(lambda: not_parked(api, node), 20)
    await eventually(lambda: has_reason(api, node, "UpgradeAborted"), 20)
    assert not await has_record(api, node)


async def test_dry_run_writes_nothing(
    api: ApiClient, ns: str, nodes: Callable[..., Awaitable[str]], start: Callable[..., Running]
) -> None:
    node = await nodes(state="cordon-required")
    await create(api, ex.declared_pod("d", namespace=ns, node_name=node))
    running = start(dry_run=True)
    await eventually(lambda: pending(running, node, [f"{ns}/d"]), 20)
    await asyncio.sleep(0.5)
    assert PARKED not in await labels(api, node)
    assert await pod_state(api, ns, "d") == "running"


async def pending(running: Running, node: str, want: list[str]) -> bool:
    return bool(running.controller.status()["nodes"].get(node, {}).get("pending") == want)


# --- issue 10, items 15, 16 and 18 ---


async def status_command(
    cp: testenv.ControlPlane, capsys: pytest.CaptureFixture[str], *args: str
) -> str:
    """``shared-svc upgrade status`` as a user runs it (its own event loop, in a thread)."""
    capsys.readouterr()
    argv = ["upgrade", "status", "--kubeconfig", str(cp.kubeconfig), *args]
    assert await asyncio.to_thread(main, argv) == 0
    return capsys.readouterr().out


async def status_json(
    cp: testenv.ControlPlane, capsys: pytest.CaptureFixture[str], node: str
) -> dict[str, Any]:
    listed = json.loads(await status_command(cp, capsys, "-o", "json"))["nodes"]
    found: dict[str, Any] = next(s for s in listed if s["node"] == node)
    return found


def event_of(all_events: list[dict[str, Any]], reason: str) -> dict[str, Any]:
    return next(e for e in all_events if e["reason"] == reason)


async def test_unprepared_daemonset_consumer_blocks_until_prepared(
    api: ApiClient,
    control_plane: testenv.ControlPlane,
    ns: str,
    nodes: Callable[..., Awaitable[str]],
    start: Callable[..., Running],
) -> None:
    node = await nodes()
    ds = ex.daemonset("exporter", namespace=ns)  # carries the consumer label, never prepared
    ds["spec"]["template"]["metadata"]["labels"].update(CONSUMER)
    for key in ("uid", "resourceVersion"):
        ds["metadata"].pop(key)
    ds_live = await raw_request(api, "POST", f"/apis/apps/v1/namespaces/{ns}/daemonsets", body=ds)
    pod = ex.daemonset_pod(ds_live, node_name=node, labels=CONSUMER)
    await create(api, pod)
    running = start()
    await set_state(api, node, "pod-restart-required")

    await eventually(lambda: has_reason(api, node, "GPUConsumerDaemonSetNotPrepared"), 20)
    warning = event_of(await events(api, node), "GPUConsumerDaemonSetNotPrepared")
    assert warning["type"] == "Warning"
    assert f"DaemonSet {ns}/exporter" in warning["note"] and "prepare-daemonset" in warning["note"]
    status = running.controller.status()["nodes"][node]
    assert status["phase"] == "freeing" and status["unpreparedDaemonsets"] == [f"{ns}/exporter"]
    assert not await has_reason(api, node, "GPUConsumersFreed")
    assert await pod_state(api, ns, pod["metadata"]["name"]) == "running"

    # The user prepares it; the DaemonSet controller (played here) takes its pod off the node.
    argv = ["upgrade", "prepare-daemonset", f"{ns}/exporter"]
    assert (
        await asyncio.to_thread(main, [*argv, "--kubeconfig", str(control_plane.kubeconfig)]) == 0
    )
    path = f"/api/v1/namespaces/{ns}/pods/{pod['metadata']['name']}"
    await raw_request(api, "DELETE", path, body={"gracePeriodSeconds": 0})
    await eventually(lambda: has_reason(api, node, "GPUConsumersFreed"), 20)
    assert running.controller.status()["nodes"][node]["phase"] == "freed"


async def test_status_command_reads_what_the_service_recorded(
    api: ApiClient,
    control_plane: testenv.ControlPlane,
    ns: str,
    nodes: Callable[..., Awaitable[str]],
    start: Callable[..., Running],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The service's eviction timeout is 2 s; the command's own default (300 s) must not matter."""
    node = await nodes()
    await _blocked_pod(api, ns, node, "guarded")
    start(upgrade_eviction_timeout_seconds=2.0)
    await set_state(api, node, "cordon-required")
    await eventually(lambda: has_reason(api, node, "GPUConsumerEvictionBlocked"), 20)
    shown = await status_json(control_plane, capsys, node)
    assert shown["blocked"] == [f"{ns}/guarded"]
    assert shown["refused"] == [] and shown["evicted"] == []
    assert shown["pending"] == [f"{ns}/guarded"] and shown["phase"] == "freeing"
    text = await status_command(control_plane, capsys)
    assert f"eviction refused past the timeout: {ns}/guarded" in text


async def test_refused_pending_and_evicted_are_shown_apart(
    api: ApiClient,
    control_plane: testenv.ControlPlane,
    ns: str,
    nodes: Callable[..., Awaitable[str]],
    start: Callable[..., Running],
    capsys: pytest.CaptureFixture[str],
) -> None:
    node = await nodes()
    await _blocked_pod(api, ns, node, "guarded")  # a PodDisruptionBudget refuses it (429)
    await create(api, ex.declared_pod("leaving", namespace=ns, node_name=node))
    running = start()
    await set_state(api, node, "cordon-required")

    async def apart() -> bool:
        s = running.controller.status()["nodes"].get(node, {})
        return s.get("refused") == [f"{ns}/guarded"] and s.get("evicted") == [f"{ns}/leaving"]

    await eventually(apart, 20)  # /status
    status = running.controller.status()["nodes"][node]
    assert status["pending"] == [f"{ns}/guarded", f"{ns}/leaving"] and status["blocked"] == []
    shown = await status_json(control_plane, capsys, node)
    assert (shown["refused"], shown["evicted"], shown["blocked"]) == (
        [f"{ns}/guarded"],
        [f"{ns}/leaving"],
        [],
    )
    text = await status_command(control_plane, capsys)
    assert f"eviction refused (retried until the timeout): {ns}/guarded" in text
    assert f"evicted (accepted; gone or terminating): {ns}/leaving" in text

    await kubelet_finishes(api, node)  # leaving is gone; guarded still refused
    await asyncio.sleep(0.5)
    shown = await status_json(control_plane, capsys, node)
    assert shown["evicted"] == [f"{ns}/leaving"] and shown["pending"] == [f"{ns}/guarded"]


async def test_evicted_pod_stuck_terminating_gets_a_warning(
    api: ApiClient,
    control_plane: testenv.ControlPlane,
    ns: str,
    nodes: Callable[..., Awaitable[str]],
    start: Callable[..., Running],
    capsys: pytest.CaptureFixture[str],
) -> None:
    node = await nodes()
    await create(api, ex.declared_pod("slow", namespace=ns, node_name=node))
    running = start(upgrade_eviction_timeout_seconds=1.0)
    await set_state(api, node, "cordon-required")
    # No kubelet finishes it: the accepted eviction leaves it terminating.
    await eventually(lambda: pod_state_is(api, ns, "slow", "terminating"), 20)
    await eventually(lambda: has_reason(api, node, "GPUConsumerStuckTerminating"), 20)
    warning = event_of(await events(api, node), "GPUConsumerStuckTerminating")
    assert warning["type"] == "Warning" and f"{ns}/slow" in warning["note"]
    status = running.controller.status()["nodes"][node]
    assert status["stuck"] == status["evicted"] == status["pending"] == [f"{ns}/slow"]
    assert not await has_reason(api, node, "GPUConsumerEvictionBlocked")  # it was not refused
    shown = await status_json(control_plane, capsys, node)
    assert shown["stuck"] == [f"{ns}/slow"]


# --- issue 14: the upgrade flow's gate ---

CLUSTER_POLICIES = "/apis/nvidia.com/v1/clusterpolicies"


@pytest.fixture
async def cluster_policy(api: ApiClient) -> AsyncIterator[Callable[..., Awaitable[str]]]:
    """Makes the one ClusterPolicy of the cluster (the active one: others are deleted first)."""
    made: list[str] = []

    async def make(**kw: Any) -> str:
        for item in (await raw_request(api, "GET", CLUSTER_POLICIES)).get("items") or []:
            with contextlib.suppress(ApiException):
                await raw_request(api, "DELETE", f"{CLUSTER_POLICIES}/{item['metadata']['name']}")
        body = ex.cluster_policy(unique("cluster-policy"), **kw)
        for key in ("uid", "resourceVersion", "creationTimestamp"):
            del body["metadata"][key]
        await raw_request(api, "POST", CLUSTER_POLICIES, body=body)
        made.append(body["metadata"]["name"])
        return str(body["metadata"]["name"])

    yield make
    for name in made:
        with contextlib.suppress(ApiException):
            await raw_request(api, "DELETE", f"{CLUSTER_POLICIES}/{name}")


async def test_missing_gate_is_a_warning_on_the_cluster_policy_at_start(
    api: ApiClient, cluster_policy: Callable[..., Awaitable[str]], start: Callable[..., Running]
) -> None:
    name = await cluster_policy(auto_upgrade=True)  # no waitForCompletion.podSelector
    running = start()
    await eventually(lambda: has_reason(api, name, "GPUConsumerGateMissing"), 20)
    [warning] = [e for e in await events(api, name) if e["reason"] == "GPUConsumerGateMissing"]
    assert warning["type"] == "Warning"
    assert warning["regarding"]["kind"] == "ClusterPolicy"
    assert warning["metadata"]["namespace"] == "default"  # cluster-scoped: Events go to default
    assert "races the driver restart" in warning["note"]
    assert "waitForCompletion.podSelector" in warning["note"]
    assert "nvidia.com/gpu-driver-upgrade.consumer=true" in warning["note"]
    gate = running.controller.status()["gate"]
    assert gate["state"] == "missing" and gate["mode"] == "cluster-policy"
    assert [v["policy"] for v in gate["verdicts"]] == [f"ClusterPolicy/{name}"]

    # The admin sets the gate (configure-gate's patch): the check passes, no new Warning.
    patch = {
        "spec": {
            "driver": {
                "upgradePolicy": {
                    "waitForCompletion": {
                        "podSelector": "nvidia.com/gpu-driver-upgrade.consumer=true",
                        "timeoutSeconds": 600,
                    }
                }
            }
        }
    }
    await raw_request(
        api, "PATCH", f"{CLUSTER_POLICIES}/{name}", body=patch, content_type=MERGE_PATCH
    )
    await eventually(lambda: _gate_is(running, "ok"), 20)
    assert [e["reason"] for e in await events(api, name)] == ["GPUConsumerGateMissing"]


async def _gate_is(running: Running, state: str) -> bool:
    return bool((running.controller.status()["gate"] or {}).get("state") == state)


async def test_freed_consumers_still_there_at_pod_restart_required_warn_on_the_node(
    api: ApiClient,
    control_plane: testenv.ControlPlane,
    capsys: pytest.CaptureFixture[str],
    ns: str,
    nodes: Callable[..., Awaitable[str]],
    start: Callable[..., Running],
) -> None:
    """Without the gate the flow goes on while consumers terminate (grace 30 s, no kubelet
    here): the node that reaches pod-restart-required gets one Warning naming them."""
    node = await nodes(state="upgrade-required")
    ds = ex.daemonset("exporter", namespace=ns, declared=True)
    ds["spec"]["template"]["metadata"]["labels"].update(CONSUMER)
    for key in ("uid", "resourceVersion"):
        ds["metadata"].pop(key)
    ds_live = await raw_request(api, "POST", f"/apis/apps/v1/namespaces/{ns}/daemonsets", body=ds)
    ds_pod = ex.daemonset_pod(ds_live, node_name=node, labels=CONSUMER)
    await create(api, ds_pod)
    await create(api, ex.declared_pod("triton", namespace=ns, node_name=node))
    running = start()

    # The driver-manager's flips, as fast as the real flow makes them (about a second).
    await set_state(api, node, "cordon-required")
    await eventually(lambda: pod_state_is(api, ns, "triton", "terminating"), 20)
    for state in ("wait-for-jobs-required", "pod-deletion-required"):
        await set_state(api, node, state)
    assert not await has_reason(api, node, "GPUConsumersAtDriverRestart")
    await set_state(api, node, "pod-restart-required")
    await eventually(lambda: has_reason(api, node, "GPUConsumersAtDriverRestart"), 20)
    [warning] = [e for e in await events(api, node) if e["reason"] == "GPUConsumersAtDriverRestart"]
    ds_pod_key = f"{ns}/{ds_pod['metadata']['name']}"
    assert warning["type"] == "Warning" and warning["regarding"]["kind"] == "Node"
    assert f"{ns}/triton" in warning["note"] and ds_pod_key in warning["note"]
    assert "configure-gate" in warning["note"]
    status = running.controller.status()["nodes"][node]
    assert status["restartRace"] == sorted([f"{ns}/triton", ds_pod_key])
    out = await status_command(control_plane, capsys)
    assert (
        f"at pod-restart-required (the flow did not wait: see the gate): {', '.join(sorted([f'{ns}/triton', ds_pod_key]))}"
        in out
    )

    # Once per node and upgrade: more looks at the node (polls, a resync) add no second one.
    await asyncio.sleep(1.5)
    raced = [e for e in await events(api, node) if e["reason"] == "GPUConsumersAtDriverRestart"]
    assert len(raced) == 1 and (raced[0].get("series") or {}).get("count", 1) == 1
    rec = json.loads((await get_node(api, node))["metadata"]["annotations"][RECORD])
    assert rec["restartRace"] == sorted([f"{ns}/triton", ds_pod_key])


async def two_consumers_evicted(
    api: ApiClient,
    ns: str,
    nodes: Callable[..., Awaitable[str]],
    start: Callable[..., Running],
) -> str:
    """A node with two declared consumer pods (``one``, ``two``) goes into
    ``cordon-required`` under a started service; returns the node once both pods are
    terminating (evicted)."""
    node = await nodes()
    await create(api, ex.declared_pod("one", namespace=ns, node_name=node))
    await create(api, ex.declared_pod("two", namespace=ns, node_name=node))
    start()
    await set_state(api, node, "cordon-required")
    await eventually(lambda: pod_state_is(api, ns, "one", "terminating"), 30)
    await eventually(lambda: pod_state_is(api, ns, "two", "terminating"), 30)
    return node


async def test_a_pass_evicts_the_consumers_of_a_node_together_and_never_gets_the_node(
    api: ApiClient,
    ns: str,
    nodes: Callable[..., Awaitable[str]],
    start: Callable[..., Running],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 12, upgrade waves: the evictions of one node are in flight together, and the
    node itself comes from the node cache (no GET of it per pass)."""
    from shared_svc.controllers.upgrade import io as upgrade_io

    real = upgrade_io.raw_request
    sent: list[tuple[str, str]] = []
    evicting = {"now": 0, "peak": 0}
    both = asyncio.Event()

    async def recording(client: ApiClient, method: str, path: str, **kw: Any) -> Any:
        sent.append((method, path))
        if not path.endswith("/eviction"):
            return await real(client, method, path, **kw)
        evicting["now"] += 1
        evicting["peak"] = max(evicting["peak"], evicting["now"])
        if evicting["now"] >= 2:
            both.set()
        # Hold each eviction until the other one is in flight too (bounded: sent one
        # after the other, the first is released after 5 s and the peak stays 1).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(both.wait(), 5)
        try:
            return await real(client, method, path, **kw)
        finally:
            evicting["now"] -= 1

    for module in (upgrade_io, kube_writer):  # its reads, and its writes (its Writer)
        monkeypatch.setattr(module, "raw_request", recording)
    node = await two_consumers_evicted(api, ns, nodes, start)
    evictions = [p for m, p in sent if m == "POST" and p.endswith("/eviction")]
    assert len(evictions) >= 2 and evicting["peak"] == 2, (evictions, evicting)
    assert ("GET", f"/api/v1/nodes/{node}") not in sent, sent
    assert ("PATCH", f"/api/v1/nodes/{node}") in sent  # the pass did run (parked label)


async def test_every_upgrade_write_waits_for_a_token_of_the_one_bucket(
    api: ApiClient,
    ns: str,
    nodes: Callable[..., Awaitable[str]],
    start: Callable[..., Running],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 12, upgrade waves within the write rate limit: every node patch, eviction and
    delete the upgrade controller sends has taken a token of its bucket first."""
    from shared_svc.controllers.upgrade import io as upgrade_io

    real = upgrade_io.raw_request
    log: list[str] = []  # "take", or the method of a write sent

    class Counted(BucketRateLimiter):
        async def take(self) -> None:
            log.append("take")
            await super().take()

    async def recording(client: ApiClient, method: str, path: str, **kw: Any) -> Any:
        if method != "GET":
            log.append(method)
        return await real(client, method, path, **kw)

    def counted(config: Config) -> BucketRateLimiter:
        return Counted(
            config.upgrade_writes_per_second, config.upgrade_writes_burst, clock=lambda: 0.0
        )

    for module in (upgrade_io, kube_writer):  # its reads, and its writes (its Writer)
        monkeypatch.setattr(module, "raw_request", recording)
    monkeypatch.setattr(upgrade_io, "upgrade_write_limiter", counted)
    await two_consumers_evicted(api, ns, nodes, start)
    writes = [entry for entry in log if entry != "take"]
    assert {"PATCH", "POST"} <= set(writes), log  # the node patch and the evictions
    taken = sent = 0
    for entry in log:  # each write took its own token before it was sent
        taken += entry == "take"
        sent += entry != "take"
        assert sent <= taken, log
    assert taken == sent, log


def test_the_upgrade_controller_builds_its_bucket_from_the_settings() -> None:
    from shared_svc.controllers.upgrade.io import upgrade_write_limiter

    bucket = upgrade_write_limiter(settings(upgrade_writes_per_second=7.0, upgrade_writes_burst=9))
    assert (bucket.rate, bucket.burst) == (7.0, 9.0)


async def test_a_wave_reads_each_freed_node_s_pods_once_without_the_operands_and_no_pod_of_a_waiting_node(
    api: ApiClient,
    ns: str,
    nodes: Callable[..., Awaitable[str]],
    start: Callable[..., Running],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 22, requests per node of a wave, on the real API server: a node entering
    ``cordon-required`` costs one pod list (its operands in the operator namespace left out
    by the field selector: none of them is read), one node patch and its evictions; a node
    in ``upgrade-required`` (no record) costs no request at all."""
    from shared_svc.controllers.upgrade import io as upgrade_io

    real = upgrade_io.raw_request
    sent: list[tuple[str, str, str]] = []  # method, path, field selector
    read: list[str] = []  # namespace/name of every pod a list answered

    async def recording(client: ApiClient, method: str, path: str, **kw: Any) -> Any:
        selector = dict(kw.get("query") or []).get("fieldSelector", "")
        sent.append((method, path, selector))
        answer = await real(client, method, path, **kw)
        if method == "GET" and path == "/api/v1/pods":
            read.extend(
                f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in answer["items"]
            )
        return answer

    for module in (upgrade_io, kube_writer):  # its reads, and its writes (its Writer)
        monkeypatch.setattr(module, "raw_request", recording)
    wave = [await nodes("upgrade-required") for _ in range(3)]
    waiting = await nodes("upgrade-required")
    operands = []
    for node in [*wave, waiting]:
        operand = unique("dcgm")  # a detected consumer, were it not an operand
        operands.append(f"{OPERATOR_NS}/{operand}")
        await create(
            api, ex.pod(operand, namespace=OPERATOR_NS, node_name=node, runtime_class="nvidia")
        )
        for i in (1, 2):
            await create(api, ex.declared_pod(f"{node}-{i}", namespace=ns, node_name=node))
    # Only a change starts a pass: no poll, no resync in the test's time.
    running = start(upgrade_poll_seconds=600.0, upgrade_resync_seconds=600.0)
    # Every node's first pass is done (none of them read a pod: none is being freed).
    await eventually(
        lambda: _true({*wave, waiting} <= set(running.controller.status()["nodes"])), 30
    )
    for node in wave:
        await set_state(api, node, "cordon-required")
    for node in wave:
        for i in (1, 2):
            await eventually(lambda: pod_state_is(api, ns, f"{node}-{i}", "terminating"), 30)  # noqa: B023
    await asyncio.sleep(0.5)  # a second pass, were there one, has run

    def requests_of(node: str) -> Counter[str]:
        return Counter(
            f"{method} {path.rsplit('/', 1)[-1] if path.endswith('/eviction') else path}"
            for method, path, selector in sent
            if path == f"/api/v1/nodes/{node}"
            or selector.startswith(f"spec.nodeName={node},")
            or selector == f"spec.nodeName={node}"
            or (path.endswith("/eviction") and f"/pods/{node}-" in path)
        )

    for node in wave:
        assert requests_of(node) == {
            "GET /api/v1/pods": 1,
            f"PATCH /api/v1/nodes/{node}": 1,
            "POST eviction": 2,
        }, (node, sent)
    assert requests_of(waiting) == {}, sent
    assert not set(operands) & set(read), read
    assert {f"{ns}/{node}-{i}" for node in wave for i in (1, 2)} <= set(read)


async def _true(value: bool) -> bool:
    return value


# --- issue 19 item 1: a delete after the eviction timeout that fails ---

# The chart's ClusterRole for the upgrade controller without upgrade.deleteAfterTimeout
# (deploy/manifests/shared-svc-upgrade.yaml), and its Events: no pods delete.
NO_POD_DELETE_RULES = [
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch", "patch"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]},
    {"apiGroups": ["apps"], "resources": ["daemonsets"], "verbs": ["list", "watch"]},
    {"apiGroups": ["nvidia.com"], "resources": ["clusterpolicies"], "verbs": ["list", "watch"]},
    {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "resourceNames": ["clusterpolicies.nvidia.com"],
        "verbs": ["get"],
    },
    {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "get", "patch"]},
]


@contextlib.asynccontextmanager
async def client_without_pod_delete(
    cp: testenv.ControlPlane, directory: Path
) -> AsyncIterator[ApiClient]:
    """A client of a ServiceAccount bound to ``NO_POD_DELETE_RULES`` (RBAC answers its
    pod deletes 403)."""
    name = unique("upgrade-no-delete")
    rbac = "rbac.authorization.k8s.io/v1"
    role = {"apiVersion": rbac, "kind": "ClusterRole", "metadata": {"name": name}}
    binding = {
        "apiVersion": rbac,
        "kind": "ClusterRoleBinding",
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": OPERATOR_NS}],
    }
    cp.apply_manifests([{**role, "rules": NO_POD_DELETE_RULES}, binding])
    token = cp.service_account_token(OPERATOR_NS, name)
    client = await api_client(cp, str(cp.write_kubeconfig(directory / f"{name}.kubeconfig", token)))
    try:
        yield client
    finally:
        await client.close()
        for plural in ("clusterrolebindings", "clusterroles"):
            cp.request("DELETE", f"/apis/{rbac}/{plural}/{name}")


async def blocked_warnings(api: ApiClient, node: str) -> list[dict[str, Any]]:
    return [e for e in await events(api, node) if e["reason"] == "GPUConsumerEvictionBlocked"]


async def recorded_pod(api: ApiClient, node: str) -> dict[str, Any]:
    [pod] = json.loads((await get_node(api, node))["metadata"]["annotations"][RECORD])["pods"]
    return dict(pod)


class FirstSendFails:
    """An Event recorder whose first try of each ``reason`` Event fails (as a refused POST:
    ``emit`` answers False)."""

    def __init__(self, recorder: EventRecorder, reason: str) -> None:
        self.recorder, self.reason, self.failed = recorder, reason, 0

    async def emit(self, report: Report) -> bool:
        if report.reason == self.reason and not self.failed:
            self.failed += 1
            return False
        return await self.recorder.emit(report)


@pytest.mark.parametrize("first_send_fails", [False, True])
async def test_a_delete_refused_by_rbac_after_the_timeout_warns_once_and_the_record_says_not_deleted(
    api: ApiClient,
    control_plane: testenv.ControlPlane,
    ns: str,
    nodes: Callable[..., Awaitable[str]],
    tmp_path: Path,
    first_send_fails: bool,
) -> None:
    """With ``first_send_fails`` the Warning's first send fails after the record that says
    it was sent is written: it is sent again on a later pass."""
    node = await nodes()
    await _blocked_pod(api, ns, node, "guarded")  # a PodDisruptionBudget refuses the eviction
    config = settings(upgrade_eviction_timeout_seconds=1.0, upgrade_delete_after_timeout=True)
    async with client_without_pod_delete(control_plane, tmp_path) as restricted:
        flaky: list[FirstSendFails] = []

        def wrap(recorder: EventRecorder) -> EventRecorder | FirstSendFails:
            if not first_send_fails:
                return recorder
            flaky.append(FirstSendFails(recorder, "GPUConsumerEvictionBlocked"))
            return flaky[0]

        running = Running(restricted, config, wrap)
        try:
            await set_state(api, node, "cordon-required")

            await eventually(lambda: _refused(running, node, after=0), 30)
            # Three more passes, each refused again (a 403 on the delete; no new Warning).
            passes = running.controller.reconciles
            await eventually(lambda: _refused(running, node, after=passes + 3), 30)
        finally:
            await running.stop()
    assert [f.failed for f in flaky] == ([1] if first_send_fails else [])
    [warning] = await blocked_warnings(api, node)
    assert warning["type"] == "Warning" and f"{ns}/guarded" in warning["note"]
    assert (warning.get("series") or {}).get("count", 1) == 1
    pod = await recorded_pod(api, node)
    assert (pod["name"], pod["blocked"], pod["deleted"]) == ("guarded", True, False)
    assert await pod_state(api, ns, "guarded") == "running"


async def _refused(running: Running, node: str, *, after: int) -> bool:
    error = running.controller.status()["errors"].get(node, "")
    return "403" in error and running.controller.reconciles >= after


async def test_a_transient_500_on_the_delete_after_the_timeout_warns_once_and_records_the_delete_that_followed(
    api: ApiClient,
    control_plane: testenv.ControlPlane,
    ns: str,
    nodes: Callable[..., Awaitable[str]],
    tmp_path: Path,
) -> None:
    node = await nodes()
    await _blocked_pod(api, ns, node, "guarded")
    proxy = await ThrottlingProxy.start(control_plane)
    proxy.fail_once("DELETE", f"/namespaces/{ns}/pods/guarded")
    config = settings(upgrade_eviction_timeout_seconds=1.0, upgrade_delete_after_timeout=True)
    proxied = await api_client(
        control_plane, str(kubeconfig_via(control_plane, proxy.url, tmp_path / "kc"))
    )
    running = Running(proxied, config)
    try:
        await set_state(api, node, "cordon-required")
        await eventually(lambda: pod_state_is(api, ns, "guarded", "terminating"), 30)
        await eventually(lambda: _recorded_deleted(api, node), 30)
    finally:
        await running.stop()
        await proxied.close()
        await proxy.close()
    assert proxy.faulted == [("DELETE", f"/api/v1/namespaces/{ns}/pods/guarded")]
    [warning] = await blocked_warnings(api, node)
    assert f"{ns}/guarded" in warning["note"] and "deleting it" in warning["note"]
    assert (warning.get("series") or {}).get("count", 1) == 1
    pod = await recorded_pod(api, node)
    assert (pod["blocked"], pod["deleted"]) == (True, True)


async def test_an_eviction_the_api_server_throttles_is_retried_and_never_reported_as_a_budget_refusal(
    api: ApiClient,
    control_plane: testenv.ControlPlane,
    ns: str,
    nodes: Callable[..., Awaitable[str]],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 429 without the DisruptionBudget cause is the API server shedding load (API
    Priority and Fairness), as a 64-wide wave may meet: the pass fails and is retried
    after the backoff until the pod is evicted; no attempt is counted or logged as a
    PodDisruptionBudget's refusal, and nothing is recorded blocked."""
    caplog.set_level(logging.INFO, logger="shared_svc")
    node = await nodes()
    await create(api, ex.declared_pod("x", namespace=ns, node_name=node))
    proxy = await ThrottlingProxy.start(control_plane)
    throttled = 3
    for _ in range(throttled):
        proxy.fail_once("POST", f"/namespaces/{ns}/pods/x/eviction", status=429)
    proxied = await api_client(
        control_plane, str(kubeconfig_via(control_plane, proxy.url, tmp_path / "kc"))
    )
    running = Running(proxied, settings())
    try:
        await set_state(api, node, "cordon-required")
        await eventually(lambda: pod_state_is(api, ns, "x", "terminating"), 30)
        evictions = running.controller.metrics.evictions
        outcomes = {o: evictions.labels(outcome=o)._value.get() for o in ("blocked", "evicted")}
    finally:
        await running.stop()
        await proxied.close()
        await proxy.close()
    assert proxy.faulted == [("POST", f"/api/v1/namespaces/{ns}/pods/x/eviction")] * throttled
    assert outcomes == {"blocked": 0, "evicted": 1}
    assert not [r for r in caplog.records if "PodDisruptionBudget" in r.getMessage()]
    assert (await recorded_pod(api, node))["blocked"] is False
    assert await blocked_warnings(api, node) == []


async def _recorded_deleted(api: ApiClient, node: str) -> bool:
    return bool((await recorded_pod(api, node))["deleted"])
