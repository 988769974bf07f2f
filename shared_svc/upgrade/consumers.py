"""Which pods on a node are GPU consumers this controller frees.

Declared pods match the configured selector (authoritative). Detected pods show a GPU
signal without a GPU resource request. Exclusions win over both: pods gpu-operator
already evicts or parks, its own operands, DaemonSet pods (parked per node instead),
mirror pods and finished pods are never touched.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from shared_svc.k8s import objects
from shared_svc.k8s.objects import K8sObject
from shared_svc.upgrade.settings import UpgradeSettings

Kind = Literal["declared", "detected", "excluded", "none"]

GPU_RESOURCE_PREFIXES = ("nvidia.com/gpu", "nvidia.com/mig-")
DEPLOY_LABEL_PREFIX = "nvidia.com/gpu.deploy."
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"
DEVICE_ENV = "NVIDIA_VISIBLE_DEVICES"
# Unset, empty and void all mean "no devices, behave like runc" to the NVIDIA runtime.
NO_DEVICE_VALUES = frozenset({"", "void"})
DEVICE_HOST_PATHS = ("/dev/nvidia", "/run/nvidia")

POD_READS = {
    "metadata": dict.fromkeys(
        (
            "name",
            "namespace",
            "uid",
            "labels",
            "annotations",
            "ownerReferences",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
        )
    ),
    "spec": {
        **dict.fromkeys(("nodeName", "nodeSelector", "runtimeClassName", "resourceClaims")),
        "containers": [dict.fromkeys(("name", "resources", "env"))],
        "initContainers": [dict.fromkeys(("name", "env"))],
        "volumes": [{"hostPath": None}],
    },
    "status": {"phase": None},
}
"""Every field of a pod the driver-upgrade planner reads (this module's rules,
``planner``'s outcomes and terminating times, ``daemonsets``' owners, ``paths``' driver
pods and their ``DRIVER_CONFIG_DIGEST``), as a shape (``kube.decode.Shape``: None is a
value whole): a pass decodes only these of the pods it lists, the rest of a 15-22 KiB pod
is skipped, not built (proptests/test_upgrade_props.py: the same plans)."""


@dataclass(frozen=True)
class Classification:
    kind: Kind
    why: str  # the rule that decided, for status and Events

    @property
    def is_consumer(self) -> bool:
        return self.kind in ("declared", "detected")


def pod_key(pod: K8sObject) -> str:
    return objects.key_of(pod)


def _containers(spec: Mapping[str, Any], *fields: str) -> Iterable[Mapping[str, Any]]:
    for name in fields:
        yield from spec.get(name) or ()


def _env_value(container: Mapping[str, Any]) -> str | None:
    """The literal NVIDIA_VISIBLE_DEVICES of a container; None if unset or from a ref."""
    for env in container.get("env") or ():
        if env.get("name") == DEVICE_ENV and "value" in env:
            return str(env.get("value") or "")
    return None


def requests_gpu_resource(spec: Mapping[str, Any]) -> bool:
    """gpu-operator's own PodDeletionFilter: it checks ``containers`` only (not init)."""
    for container in _containers(spec, "containers"):
        resources = container.get("resources") or {}
        for section in ("limits", "requests"):
            if any(name.startswith(GPU_RESOURCE_PREFIXES) for name in resources.get(section) or {}):
                return True
    return False


def owned_by_daemonset(pod: K8sObject) -> bool:
    return bool(objects.owner_refs(pod, "DaemonSet"))


def is_finished(pod: K8sObject) -> bool:
    """Phase Succeeded or Failed: its containers are gone, it holds no GPU."""
    return pod.get("status", {}).get("phase") in ("Succeeded", "Failed")


def exclusion(
    pod: K8sObject, settings: UpgradeSettings, *, daemonset_pods: bool = False
) -> str | None:
    """The rule that puts the pod out of reach, or None.

    ``daemonset_pods``: judge a DaemonSet's pod as if it were not one (is it a consumer the
    parked label must move?); every other exclusion still holds.
    """
    spec = pod.get("spec", {})
    if is_finished(pod):
        return "finished"
    if MIRROR_ANNOTATION in objects.annotations_of(pod):
        return "mirror pod"
    if owned_by_daemonset(pod) and not daemonset_pods:
        return "DaemonSet pod (parked per node instead)"
    if objects.namespace_of(pod) == settings.operator_namespace:
        return "operator namespace"
    if any(key.startswith(DEPLOY_LABEL_PREFIX) for key in spec.get("nodeSelector") or {}):
        return "operator operand (nvidia.com/gpu.deploy.* nodeSelector)"
    if requests_gpu_resource(spec):
        return "GPU resource request (gpu-operator evicts it)"
    if spec.get("resourceClaims"):
        return "DRA resource claims (gpu-operator evicts it)"
    return None


def _under_device_path(path: str) -> bool:
    """String prefix on purpose: /dev/nvidia0, /dev/nvidiactl, /dev/nvidia-uvm, /run/nvidia/driver."""
    return posixpath.normpath(path).startswith(DEVICE_HOST_PATHS)


def detection_signal(pod: K8sObject, settings: UpgradeSettings) -> str | None:
    """The first GPU signal of an undeclared pod, or None."""
    spec = pod.get("spec", {})
    runtime = spec.get("runtimeClassName")
    if runtime in settings.runtime_classes:
        running = list(_containers(spec, "containers"))
        if not running or not all(_env_value(c) == "void" for c in running):
            return f"runtimeClassName {runtime}"
    for container in _containers(spec, "initContainers", "containers"):
        value = _env_value(container)
        if value is not None and value.strip() not in NO_DEVICE_VALUES:
            return f"{DEVICE_ENV}={value} in container {container.get('name', '?')}"
    for volume in spec.get("volumes") or ():
        path = (volume.get("hostPath") or {}).get("path")
        if isinstance(path, str) and _under_device_path(path):
            return f"hostPath {path}"
    return None


def classify(
    pod: K8sObject, settings: UpgradeSettings, *, daemonset_pods: bool = False
) -> Classification:
    excluded = exclusion(pod, settings, daemonset_pods=daemonset_pods)
    if excluded is not None:
        return Classification("excluded", excluded)
    labels = objects.labels_of(pod)
    # An empty consumer selector declares nothing (never every pod on the node).
    if not settings.consumer_selector.empty and settings.consumer_selector.matches(labels):
        return Classification("declared", f"matches {settings.consumer_selector.text}")
    if settings.detection != "off":
        signal = detection_signal(pod, settings)
        if signal is not None:
            return Classification("detected", signal)
    return Classification("none", "no GPU signal")
