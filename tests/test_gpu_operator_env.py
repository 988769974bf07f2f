"""The real gpu-operator in the test environment (issue 9 item 5): built from its Go
module, run in a private mount namespace under its own ServiceAccount against a control
plane of this module's own (fixture ``gpu_operator``). These prove the environment the
coexistence and upgrade tests build on."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from testenv import ControlPlane
from testenv import gpu_operator as gpu_env

pytestmark = [pytest.mark.apiserver, pytest.mark.gpu_operator]

NS = gpu_env.NAMESPACE
SERVICES = ("nvidia-dcgm", "nvidia-dcgm-exporter")
# Its own reconciles requeue every ~5 s while an operand is not ready.
TIMEOUT = 60.0


def get(cp: ControlPlane, path: str) -> dict[str, Any] | None:
    status, body = cp.request("GET", path)
    if status == 404:
        return None
    assert status == 200, (path, status, body)
    result: dict[str, Any] = body
    return result


def service(cp: ControlPlane, name: str) -> dict[str, Any] | None:
    return get(cp, f"/api/v1/namespaces/{NS}/services/{name}")


def policy_uid(cp: ControlPlane) -> str:
    policy = get(cp, f"/apis/nvidia.com/v1/clusterpolicies/{gpu_env.CLUSTER_POLICY}")
    assert policy is not None
    uid: str = policy["metadata"]["uid"]
    return uid


def controller_ref(obj: dict[str, Any]) -> dict[str, Any] | None:
    refs = obj["metadata"].get("ownerReferences") or []
    return next((r for r in refs if r.get("controller")), None)


def wait_state(op: gpu_env.GpuOperator, state: str) -> None:
    def check() -> bool:
        assert op.alive(), f"gpu-operator exited:\n{op.tail()}"
        return gpu_env.cluster_policy_status(op.control_plane).get("state") == state

    try:
        gpu_env.wait_for(check, TIMEOUT, f"ClusterPolicy state {state!r}")
    except AssertionError as exc:
        status = gpu_env.cluster_policy_status(op.control_plane)
        raise AssertionError(f"{exc}; status {status}; log {op.log}") from None


def test_creates_dcgm_services_with_its_controller_reference(
    gpu_operator: gpu_env.GpuOperator,
) -> None:
    cp = gpu_operator.control_plane
    gpu_env.apply_cluster_policy(cp)
    uid = policy_uid(cp)

    def both() -> list[dict[str, Any]] | None:
        found = [service(cp, name) for name in SERVICES]
        return [s for s in found if s] if all(found) else None

    created = gpu_env.wait_for(both, TIMEOUT, f"Services {SERVICES} (log {gpu_operator.log})")
    assert created is not None
    for svc in created:
        ref = controller_ref(svc)
        assert ref is not None, svc["metadata"]
        assert (ref["kind"], ref["name"], ref["uid"]) == ("ClusterPolicy", "cluster-policy", uid)
        assert svc["spec"]["selector"] == {"app": svc["metadata"]["name"]}
        managers = {m["manager"] for m in svc["metadata"].get("managedFields", [])}
        assert managers == {"gpu-operator"}, managers
    assert gpu_operator.alive(), gpu_operator.tail()


def test_runs_as_its_service_account_in_a_private_mount_namespace(
    gpu_operator: gpu_env.GpuOperator,
) -> None:
    cp = gpu_operator.control_plane
    config = yaml.safe_load(gpu_operator.kubeconfig.read_text())
    token = config["users"][0]["user"]["token"]
    status, review = cp.request(
        "POST",
        "/apis/authentication.k8s.io/v1/selfsubjectreviews",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
        token=token,
    )
    assert status == 201, review
    assert review["status"]["userInfo"]["username"] == (
        f"system:serviceaccount:{NS}:{gpu_env.SERVICE_ACCOUNT}"
    )
    # The token is the SA's own (not an admin's): it may not read Secrets cluster-wide.
    assert cp.request("GET", "/api/v1/secrets", token=token)[0] == 403
    # Its /opt/gpu-operator exists only inside its mount namespace.
    assert not Path("/opt/gpu-operator").exists()


def test_cluster_policy_ready_once_its_daemonsets_are(gpu_operator: gpu_env.GpuOperator) -> None:
    cp = gpu_operator.control_plane
    gpu_env.apply_cluster_policy(cp)
    expected = {"nvidia-operator-validator", "nvidia-dcgm", "nvidia-dcgm-exporter"}
    gpu_env.wait_for(
        lambda: expected <= {d["metadata"]["name"] for d in gpu_env.daemonsets(cp)},
        TIMEOUT,
        f"DaemonSets {sorted(expected)} (log {gpu_operator.log})",
    )
    # Scheduled on the GPU node, no pod available: not ready.
    desired = gpu_env.mark_daemonsets(cp, ready=False)
    assert all(desired[name] == 1 for name in expected), desired
    wait_state(gpu_operator, "notReady")

    gpu_env.mark_daemonsets(cp, ready=True)
    wait_state(gpu_operator, "ready")


def test_dcgm_disabled_deletes_nvidia_dcgm(gpu_operator: gpu_env.GpuOperator) -> None:
    cp = gpu_operator.control_plane
    gpu_env.apply_cluster_policy(cp)
    gpu_env.wait_for(lambda: service(cp, "nvidia-dcgm"), TIMEOUT, "nvidia-dcgm Service")

    gpu_env.apply_cluster_policy(cp, {"dcgm": {"enabled": False}})
    gpu_env.wait_for(
        lambda: service(cp, "nvidia-dcgm") is None,
        TIMEOUT,
        f"nvidia-dcgm deleted (log {gpu_operator.log})",
    )
    assert service(cp, "nvidia-dcgm-exporter") is not None
    assert gpu_operator.alive(), gpu_operator.tail()


STATE = "nvidia.com/gpu-driver-upgrade-state"


@pytest.mark.parametrize("upgrade_controller", [True, False])
def test_the_build_without_its_upgrade_controller_leaves_the_upgrade_state_alone(
    tmp_path: Path, upgrade_controller: bool
) -> None:
    """gpu-operator's own upgrade controller removes the upgrade-state label from every
    node for a ClusterPolicy without ``autoUpgrade`` (what made it unfit to run beside
    testenv/upgrade-libs); the build without it leaves the label and makes the same
    DaemonSets."""
    cp = gpu_env.start_control_plane(tmp_path)
    try:
        gpu_env.add_gpu_node(cp, "gpu-node-0", labels={STATE: "upgrade-required"})
        op = gpu_env.start(cp, upgrade_controller=upgrade_controller)
        try:
            gpu_env.apply_cluster_policy(cp)
            gpu_env.wait_for(
                lambda: (
                    {d["metadata"]["name"] for d in gpu_env.daemonsets(cp)}
                    >= {"nvidia-dcgm", "nvidia-dcgm-exporter", "nvidia-operator-validator"}
                ),
                TIMEOUT,
                "gpu-operator's DaemonSets",
            )

            def label() -> str | None:
                node = get(cp, "/api/v1/nodes/gpu-node-0")
                assert node is not None
                value: str | None = node["metadata"]["labels"].get(STATE)
                return value

            if upgrade_controller:
                gpu_env.wait_for(lambda: label() is None, TIMEOUT, "the state label removed")
            else:
                # Its ClusterPolicy controller has reconciled (the DaemonSets above), and
                # node label changes would wake an upgrade controller: one more, then look.
                cp.request(
                    "PATCH",
                    "/api/v1/nodes/gpu-node-0",
                    {"metadata": {"labels": {"soak.test/beat": "1"}}},
                    content_type="application/merge-patch+json",
                )
                time.sleep(10)  # the original removes it at once (the case above)
                assert op.alive(), op.tail()
                assert label() == "upgrade-required"
        finally:
            op.stop()
    finally:
        cp.stop()
