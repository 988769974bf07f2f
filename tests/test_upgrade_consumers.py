"""Detection signals and exclusions (contract section 2)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shared_svc.k8s.selectors import parse_selector
from shared_svc.upgrade.consumers import classify
from shared_svc.upgrade.settings import UpgradeSettings
from testenv import upgrade_examples as ex

S = UpgradeSettings()


def kind(pod, settings=S) -> str:
    return classify(pod, settings).kind


@pytest.mark.parametrize("runtime", ["nvidia", "nvidia-cdi", "nvidia-legacy"])
def test_runtime_class_is_a_signal(runtime: str) -> None:
    assert kind(ex.pod("p", runtime_class=runtime)) == "detected"


def test_runtime_class_not_configured_is_no_signal() -> None:
    assert kind(ex.pod("p", runtime_class="kata")) == "none"
    assert (
        kind(ex.pod("p", runtime_class="kata"), replace(S, runtime_classes=frozenset({"kata"})))
        == "detected"
    )


def test_runtime_class_with_void_in_every_container_is_not_a_consumer() -> None:
    assert (
        kind(ex.pod("p", runtime_class="nvidia", env={"NVIDIA_VISIBLE_DEVICES": "void"})) == "none"
    )
    pod = ex.pod("p", runtime_class="nvidia", env={"NVIDIA_VISIBLE_DEVICES": "void"})
    pod["spec"]["containers"].append({"name": "sidecar", "image": "x"})  # no void here
    assert kind(pod) == "detected"


@pytest.mark.parametrize("value", ["all", "0", "GPU-1234", "none", "0,1"])
def test_visible_devices_naming_devices_is_a_signal(value: str) -> None:
    assert kind(ex.pod("p", env={"NVIDIA_VISIBLE_DEVICES": value})) == "detected"


@pytest.mark.parametrize("value", ["", "void"])
def test_visible_devices_empty_or_void_is_no_signal(value: str) -> None:
    assert kind(ex.pod("p", env={"NVIDIA_VISIBLE_DEVICES": value})) == "none"


def test_visible_devices_in_an_init_container_counts() -> None:
    pod = ex.pod("p")
    pod["spec"]["initContainers"] = [
        {"name": "i", "image": "x", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}
    ]
    assert kind(pod) == "detected"


@pytest.mark.parametrize(
    "path",
    [
        "/dev/nvidia0",
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/run/nvidia/driver",
        "/run/nvidia",
        "/dev//nvidia0",
    ],
)
def test_device_host_paths_are_a_signal(path: str) -> None:
    assert kind(ex.pod("p", host_paths=(path,))) == "detected"


@pytest.mark.parametrize("path", ["/dev", "/run", "/var/lib/nvidia", "/dev/dri"])
def test_other_host_paths_are_no_signal(path: str) -> None:
    assert kind(ex.pod("p", host_paths=(path,))) == "none"


def test_declared_by_selector_without_any_signal() -> None:
    assert kind(ex.declared_pod("p")) == "declared"
    assert kind(ex.declared_pod("p"), replace(S, detection="off")) == "declared"
    custom = replace(S, consumer_selector=parse_selector("team=ml,tier in (inference)"))
    assert kind(ex.pod("p", labels={"team": "ml", "tier": "inference"}), custom) == "declared"
    assert kind(ex.pod("p", labels={"team": "ml"}), custom) == "none"


def test_an_empty_consumer_selector_declares_nothing() -> None:
    """The empty selector selects everything (Kubernetes); as the consumer selector it
    declares no pod, never every pod on the node."""
    empty = replace(S, consumer_selector=parse_selector(""))
    assert parse_selector("").matches({"team": "ml"})
    assert kind(ex.pod("p", labels={"team": "ml"}), empty) == "none"
    assert kind(ex.pod("p", labels={}), empty) == "none"


def test_detection_off_detects_nothing() -> None:
    assert kind(ex.pod("p", runtime_class="nvidia"), replace(S, detection="off")) == "none"


@pytest.mark.parametrize(
    ("pod", "why"),
    [
        (ex.declared_pod("p", resources={"limits": {"nvidia.com/gpu": 1}}), "GPU resource"),
        (
            ex.declared_pod("p", resources={"requests": {"nvidia.com/gpu.shared": 1}}),
            "GPU resource",
        ),
        (ex.declared_pod("p", resources={"limits": {"nvidia.com/mig-1g.5gb": 1}}), "GPU resource"),
        (ex.declared_pod("p", resource_claims=True), "DRA"),
        (ex.declared_pod("p", namespace="gpu-operator"), "operator namespace"),
        (
            ex.declared_pod("p", node_selector={"nvidia.com/gpu.deploy.dcgm-exporter": "true"}),
            "operand",
        ),
        (ex.declared_pod("p", owner_kind="DaemonSet"), "DaemonSet"),
        (ex.declared_pod("p", annotations={"kubernetes.io/config.mirror": "abc"}), "mirror"),
        (ex.declared_pod("p", phase="Succeeded"), "finished"),
        (ex.declared_pod("p", phase="Failed"), "finished"),
        (ex.pod("p", runtime_class="nvidia", namespace="gpu-operator"), "operator namespace"),
        (
            ex.pod("p", runtime_class="nvidia", resources={"limits": {"nvidia.com/gpu": 1}}),
            "GPU resource",
        ),
    ],
)
def test_exclusions_win_over_declaration_and_detection(pod, why: str) -> None:
    found = classify(pod, S)
    assert found.kind == "excluded" and why in found.why


def test_gpu_request_only_in_init_container_is_not_excluded() -> None:
    # gpu-operator's filter looks at containers only, so it would not evict this pod.
    pod = ex.declared_pod("p")
    pod["spec"]["initContainers"] = [
        {"name": "i", "image": "x", "resources": {"limits": {"nvidia.com/gpu": 1}}}
    ]
    assert kind(pod) == "declared"


def test_owned_by_a_replicaset_is_a_normal_pod() -> None:
    assert kind(ex.declared_pod("p", owner_kind="ReplicaSet")) == "declared"


def test_operator_namespace_follows_settings() -> None:
    assert (
        kind(ex.declared_pod("p", namespace="nvidia"), replace(S, operator_namespace="nvidia"))
        == "excluded"
    )
