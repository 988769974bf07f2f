"""The driver-upgrade controller of the chart (``controllers.upgrade=true``) with the real
kubelet and the real DaemonSet controller (issue 30, item 5): a prepared DaemonSet's pod
leaves the node when shared-svc parks it and comes back on restore; a declared consumer
with a real termination grace period is evicted through the Eviction API, terminated by
the kubelet (SIGTERM, then its own time to finish), and the node is not freed while it is
there. The test plays gpu-operator's upgrade state machine on the Node's state label (no
GPU or driver here; its real flow runs in tests/test_upgrade_gpu_operator_flow.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from shared_svc.upgrade.daemonsets import parked_label_key
from shared_svc.upgrade.record import record_annotation_key
from shared_svc.upgrade.states import state_label_key
from testenv.node import NAME, PAUSE_IMAGE, Node
from tests.kube import eventually
from tests.real_node import IMAGE, REPO, get, install, uninstall

pytestmark = pytest.mark.node

OPERATOR_NS = "gpu-operator-upgrade"
RELEASE = "consumers"
STATE = state_label_key("gpu")
PARKED = parked_label_key("gpu")
RECORD = record_annotation_key("gpu")
CONSUMER = {"nvidia.com/gpu-driver-upgrade.consumer": "true"}
NODE_PATH = f"/api/v1/nodes/{NAME}"
# A consumer that needs its grace period: on SIGTERM it finishes its work (6 s), then exits.
WORKLOAD = """
import signal, sys, time
def stop(*_):
    print("SIGTERM: finishing", flush=True)
    time.sleep(6)
    print("finished", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("running", flush=True)
while True:
    time.sleep(1)
"""


@pytest.fixture(scope="module")
def upgrade_release(real_node: Node) -> Iterator[None]:
    install(real_node, "controllers.upgrade=true", namespace=OPERATOR_NS, release=RELEASE)
    try:
        yield
    finally:
        uninstall(real_node, namespace=OPERATOR_NS, release=RELEASE)


def set_state(node: Node, value: str | None) -> None:
    patch = {"metadata": {"labels": {STATE: value}}}
    status, out = node.control_plane.request(
        "PATCH", NODE_PATH, patch, content_type="application/merge-patch+json"
    )
    assert status == 200, out


def node_obj(node: Node) -> dict[str, Any]:
    obj = get(node.control_plane, NODE_PATH)
    assert obj is not None
    return obj


def record(node: Node) -> dict[str, Any] | None:
    text = (node_obj(node)["metadata"].get("annotations") or {}).get(RECORD)
    return json.loads(text) if text else None


def daemonset_pods(node: Node) -> list[dict[str, Any]]:
    status, body = node.control_plane.request(
        "GET", "/api/v1/namespaces/monitoring/pods?labelSelector=app=dcgm-probe"
    )
    assert status == 200, body
    return [p for p in body["items"] if not p["metadata"].get("deletionTimestamp")]


def running(pod: dict[str, Any]) -> bool:
    return pod.get("status", {}).get("phase") == "Running" and pod["spec"].get("nodeName") == NAME


async def test_parked_daemonset_leaves_and_returns_and_an_evicted_consumer_holds_the_node(
    real_node: Node, upgrade_release: None
) -> None:
    cp = real_node.control_plane
    for ns in ("monitoring", "ml"):
        cp.ensure_namespace(ns)
    daemonset = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "dcgm-probe", "namespace": "monitoring"},
        "spec": {
            "selector": {"matchLabels": {"app": "dcgm-probe"}},
            "template": {
                "metadata": {"labels": {"app": "dcgm-probe"}},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [
                        {"name": "probe", "image": PAUSE_IMAGE, "imagePullPolicy": "Never"}
                    ],
                },
            },
        },
    }
    consumer = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "trainer", "namespace": "ml", "labels": dict(CONSUMER)},
        "spec": {
            "terminationGracePeriodSeconds": 30,
            "containers": [
                {
                    "name": "main",
                    "image": IMAGE,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python", "-u", "-c", WORKLOAD],
                }
            ],
        },
    }
    try:
        cp.apply_manifests([daemonset, consumer])

        async def probe_running() -> list[dict[str, Any]]:
            return [p for p in daemonset_pods(real_node) if running(p)]

        await eventually(probe_running, timeout=120, interval=0.5)
        # Prepared by the administrator's command: the parked-label affinity and the
        # consumer label on its template (one rollout by the real DaemonSet controller).
        prepared = subprocess.run(
            [sys.executable, "-m", "shared_svc", "upgrade", "prepare-daemonset",
             "monitoring/dcgm-probe", "--kubeconfig", str(real_node.kubeconfig)],
            capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
        )  # fmt: skip
        assert prepared.returncode == 0, prepared.stderr

        async def prepared_pod_running() -> bool:
            return any(
                running(p) and p["metadata"]["labels"].items() >= CONSUMER.items()
                for p in daemonset_pods(real_node)
            )

        await eventually(prepared_pod_running, timeout=120, interval=0.5)

        async def trainer_running() -> bool:
            pod = get(cp, "/api/v1/namespaces/ml/pods/trainer") or {}
            return running(pod)

        await eventually(trainer_running, timeout=120, interval=0.5)

        # gpu-operator's upgrade reaches the node: a freeing state.
        set_state(real_node, "wait-for-jobs-required")

        async def parked() -> bool:
            labels = node_obj(real_node)["metadata"].get("labels") or {}
            return labels.get(PARKED) == "true" and record(real_node) is not None

        await eventually(parked, timeout=60, interval=0.5)

        # The consumer is evicted: terminating, its container told SIGTERM by the kubelet
        # and given its time; while it is on the node, the node is not freed.
        async def terminating() -> dict[str, Any] | None:
            pod = get(cp, "/api/v1/namespaces/ml/pods/trainer")
            return pod if pod and pod["metadata"].get("deletionTimestamp") else None

        pod = await eventually(terminating, timeout=60, interval=0.2)
        assert pod["metadata"]["deletionGracePeriodSeconds"] == 30

        async def told() -> bool:
            status, log = cp.request("GET", "/api/v1/namespaces/ml/pods/trainer/log")
            return status == 200 and "SIGTERM: finishing" in str(log)

        await eventually(told, timeout=60, interval=0.2)
        seen_present = 0
        while get(cp, "/api/v1/namespaces/ml/pods/trainer") is not None:
            seen_present += 1
            rec = record(real_node)
            assert rec is not None and rec["freedAt"] is None, rec
            assert [p["name"] for p in rec["pods"]] == ["trainer"], rec
            await asyncio.sleep(0.3)
        assert seen_present > 3, "the consumer left before its grace period could be seen"

        # Gone, and the parked DaemonSet's pod gone from the node: the node is freed.
        async def freed() -> bool:
            rec = record(real_node)
            return bool(rec and rec["freedAt"]) and not daemonset_pods(real_node)

        await eventually(freed, timeout=60, interval=0.5)

        # The Event follows the node's patch (the controller announces after it writes).
        async def announced() -> set[str] | None:
            events = get(cp, "/apis/events.k8s.io/v1/namespaces/default/events") or {}
            # Another party's Event may regard an object with no name (the API server
            # drops an empty one): such a one is not about the node.
            reasons = {e["reason"] for e in events.get("items", [])
                       if (e.get("regarding") or {}).get("name") == NAME}  # fmt: skip
            return reasons if "GPUConsumersFreed" in reasons else None

        await eventually(announced, timeout=30, interval=0.5)

        # The upgrade is done: the parked label goes and the DaemonSet's pod comes back.
        set_state(real_node, "upgrade-done")

        async def restored() -> bool:
            labels = node_obj(real_node)["metadata"].get("labels") or {}
            return PARKED not in labels and record(real_node) is None

        await eventually(restored, timeout=60, interval=0.5)
        await eventually(prepared_pod_running, timeout=120, interval=0.5)
    finally:
        set_state(real_node, None)
        for path in (
            "/apis/apps/v1/namespaces/monitoring/daemonsets/dcgm-probe",
            "/api/v1/namespaces/ml/pods/trainer?gracePeriodSeconds=0",
        ):
            cp.request("DELETE", path)
