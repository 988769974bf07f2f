"""Builders of nodes, pods and DaemonSets shaped as the API server returns them.

For the tests, the property tests and the benchmark: one place that knows the shapes.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Sequence
from typing import Any

from shared_svc.controllers.upgrade.caches import UpgradeCaches
from shared_svc.k8s.events import Report
from shared_svc.k8s.objects import K8sObject
from shared_svc.upgrade.daemonsets import parked_label_key
from shared_svc.upgrade.node_plan import NodePatch, PodAction
from shared_svc.upgrade.paths import is_driver_pod
from shared_svc.upgrade.states import state_label_key
from testenv.caches import deliver, fill, offline_registry


def node(
    name: str = "node-1",
    state: str | None = None,
    *,
    driver: str = "gpu",
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    parked: bool = False,
    resource_version: str = "1",
) -> K8sObject:
    all_labels = dict(labels or {})
    if state is not None:
        all_labels[state_label_key(driver)] = state
    if parked:
        all_labels[parked_label_key(driver)] = "true"
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "resourceVersion": resource_version,
            "labels": all_labels,
            "annotations": dict(annotations or {}),
        },
    }


def pod(
    name: str,
    *,
    namespace: str = "ml",
    node_name: str = "node-1",
    labels: dict[str, str] | None = None,
    runtime_class: str | None = None,
    env: dict[str, str] | None = None,
    host_paths: tuple[str, ...] = (),
    resources: dict[str, Any] | None = None,
    node_selector: dict[str, str] | None = None,
    owner_kind: str | None = None,
    owner_uid: str | None = None,
    owner_name: str | None = None,
    phase: str = "Running",
    annotations: dict[str, str] | None = None,
    resource_claims: bool = False,
    terminating: bool = False,
    uid: str | None = None,
) -> K8sObject:
    container: dict[str, Any] = {"name": "main", "image": "registry.example/app:1"}
    if env:
        container["env"] = [{"name": k, "value": v} for k, v in env.items()]
    if resources:
        container["resources"] = resources
    spec: dict[str, Any] = {"nodeName": node_name, "containers": [container]}
    if runtime_class:
        spec["runtimeClassName"] = runtime_class
    if host_paths:
        spec["volumes"] = [
            {"name": f"v{i}", "hostPath": {"path": p}} for i, p in enumerate(host_paths)
        ]
    if node_selector:
        spec["nodeSelector"] = node_selector
    if resource_claims:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "gpu"}]
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "uid": uid or f"uid-{namespace}-{name}",
        "labels": dict(labels or {}),
        "annotations": dict(annotations or {}),
    }
    if owner_kind:
        meta["ownerReferences"] = [
            {
                "apiVersion": "apps/v1",
                "kind": owner_kind,
                "name": owner_name or f"{owner_kind.lower()}-x",
                "uid": owner_uid or "owner",
                "controller": True,
            }
        ]
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": spec,
        "status": {"phase": phase},
    }


def declared_pod(name: str, **kw: Any) -> K8sObject:
    labels = {"nvidia.com/gpu-driver-upgrade.consumer": "true", **kw.pop("labels", {})}
    return pod(name, labels=labels, **kw)


def daemonset(
    name: str,
    *,
    namespace: str = "monitoring",
    declared: bool = False,
    terms: list[dict[str, Any]] | None = None,
    node_selector: dict[str, str] | None = None,
    driver: str = "gpu",
) -> K8sObject:
    spec: dict[str, Any] = {
        "containers": [{"name": "main", "image": "registry.example/exporter:1"}]
    }
    all_terms = [dict(t) for t in terms or []]
    if declared:
        expr = {"key": parked_label_key(driver), "operator": "DoesNotExist"}
        all_terms = [
            {**t, "matchExpressions": [*t.get("matchExpressions", []), expr]} for t in all_terms
        ] or [{"matchExpressions": [expr]}]
    if all_terms:
        spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": all_terms}
            }
        }
    if node_selector:
        spec["nodeSelector"] = node_selector
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-ds-{namespace}-{name}",
            "resourceVersion": "1",
        },
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": spec},
        },
    }


def daemonset_pod(ds: K8sObject, node_name: str = "node-1", **kw: Any) -> K8sObject:
    meta = ds["metadata"]
    return pod(
        f"{meta['name']}-{node_name}",
        namespace=meta["namespace"],
        node_name=node_name,
        owner_kind="DaemonSet",
        owner_uid=meta["uid"],
        owner_name=meta["name"],
        **kw,
    )


DRIVER_LABELS = {"app": "nvidia-driver-daemonset", "app.kubernetes.io/component": "nvidia-driver"}


def _digest_env(digest: str | None) -> list[dict[str, str]]:
    return [] if digest is None else [{"name": "DRIVER_CONFIG_DIGEST", "value": digest}]


def driver_daemonset(
    digest: str | None = "d1",
    *,
    name: str = "nvidia-driver-daemonset",
    namespace: str = "gpu-operator",
    generation: int = 1,
) -> K8sObject:
    """gpu-operator's driver DaemonSet: its labels, and ``DRIVER_CONFIG_DIGEST`` (None: none,
    as before v26.7.0) on the driver container and the driver-manager init container."""
    env = _digest_env(digest)
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-ds-{namespace}-{name}",
            "resourceVersion": "1",
            "generation": generation,
            "labels": dict(DRIVER_LABELS),
        },
        "spec": {
            "selector": {"matchLabels": {"app": DRIVER_LABELS["app"]}},
            "updateStrategy": {"type": "OnDelete"},
            "template": {
                "metadata": {"labels": dict(DRIVER_LABELS)},
                "spec": {
                    "nodeSelector": {"nvidia.com/gpu.deploy.driver": "true"},
                    "initContainers": [
                        {"name": "k8s-driver-manager", "image": "dm:1", "env": list(env)}
                    ],
                    "containers": [
                        {
                            "name": "nvidia-driver-ctr",
                            "image": "driver:1",
                            "env": [{"name": "NODE_NAME", "value": "x"}, *env],
                        }
                    ],
                },
            },
        },
    }


def driver_pod(
    ds: K8sObject,
    node_name: str = "node-1",
    *,
    digest: str | None = "d1",
    generation: int = 1,
    terminating: bool = False,
    suffix: str = "old",
) -> K8sObject:
    """A pod of ``ds`` created from the template of ``generation`` with ``digest``."""
    p = pod(
        f"{ds['metadata']['name']}-{suffix}",
        namespace=ds["metadata"]["namespace"],
        node_name=node_name,
        labels={**DRIVER_LABELS, "pod-template-generation": str(generation)},
        owner_kind="DaemonSet",
        owner_uid=ds["metadata"]["uid"],
        owner_name=ds["metadata"]["name"],
        env={"NODE_NAME": node_name},
        terminating=terminating,
    )
    p["spec"]["containers"][0]["env"] += _digest_env(digest)
    p["spec"]["initContainers"] = [{"name": "k8s-driver-manager", "env": _digest_env(digest)}]
    return p


def cluster_policy(
    name: str = "cluster-policy",
    *,
    auto_upgrade: bool | None = True,
    pod_selector: str | None = None,
    timeout_seconds: int | None = None,
    created: str = "2026-01-01T00:00:00Z",
    use_nvidia_driver_crd: bool = False,
    sandbox: bool = False,
) -> K8sObject:
    """A ClusterPolicy with the fields the gate check reads (None leaves a field out);
    ``use_nvidia_driver_crd``: NVIDIADriver mode; ``sandbox``: sandbox workloads on."""
    upgrade = wait_policy(auto_upgrade, pod_selector, timeout_seconds)
    driver: dict[str, Any] = {"upgradePolicy": upgrade} if upgrade else {}
    if use_nvidia_driver_crd:
        driver["useNvidiaDriverCRD"] = True
    extra: dict[str, Any] = {"sandboxWorkloads": {"enabled": True}} if sandbox else {}
    return {
        "apiVersion": "nvidia.com/v1",
        "kind": "ClusterPolicy",
        "metadata": {
            "name": name,
            "uid": f"uid-cp-{name}",
            "resourceVersion": "1",
            "creationTimestamp": created,
        },
        "spec": {
            "operator": {},
            "daemonsets": {},
            "driver": driver,
            "toolkit": {},
            "devicePlugin": {},
            "dcgm": {},
            "dcgmExporter": {},
            "gfd": {},
            "nodeStatusExporter": {},
            **extra,
        },
    }


def wait_policy(
    auto_upgrade: bool | None, pod_selector: str | None, timeout_seconds: int | None
) -> dict[str, Any] | None:
    """An upgrade policy with the fields the gate reads (None leaves a field out; all None:
    no policy at all)."""
    upgrade: dict[str, Any] = {}
    if auto_upgrade is not None:
        upgrade["autoUpgrade"] = auto_upgrade
    wait: dict[str, Any] = {}
    if pod_selector is not None:
        wait["podSelector"] = pod_selector
    if timeout_seconds is not None:
        wait["timeoutSeconds"] = timeout_seconds
    if wait:
        upgrade["waitForCompletion"] = wait
    return upgrade or None


def nvidia_driver(
    name: str = "default",
    *,
    auto_upgrade: bool | None = None,
    pod_selector: str | None = None,
    timeout_seconds: int | None = None,
) -> K8sObject:
    """An NVIDIADriver (gpu-operator v26.7.0's CRD: ``spec.upgradePolicy``, absent when every
    field is None; ``autoUpgrade`` then defaults to true)."""
    spec: dict[str, Any] = {"driverType": "gpu", "nodeSelector": {"nvidia.com/gpu.present": "true"}}
    if (policy := wait_policy(auto_upgrade, pod_selector, timeout_seconds)) is not None:
        spec["upgradePolicy"] = policy
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "NVIDIADriver",
        "metadata": {"name": name, "uid": f"uid-nvd-{name}", "resourceVersion": "1"},
        "spec": spec,
    }


def nvidia_driver_crd(*, upgrade_policy: bool = True) -> K8sObject:
    """The NVIDIADriver CRD as far as ``policy.reads_driver_policy`` reads it: with
    ``spec.upgradePolicy`` (gpu-operator v26.7.0) or without (v25.3.4)."""
    spec_props: dict[str, Any] = {"driverType": {"type": "string"}}
    if upgrade_policy:
        spec_props["upgradePolicy"] = {"type": "object"}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "nvidiadrivers.nvidia.com", "uid": "uid-crd", "resourceVersion": "1"},
        "spec": {
            "versions": [
                {
                    "name": "v1alpha1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "properties": {"spec": {"type": "object", "properties": spec_props}}
                        }
                    },
                }
            ]
        },
    }


def apply_merge(target: Any, patch: Any) -> Any:
    """An RFC 7386 merge patch applied to a copy of ``target`` (null removes a key)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = apply_merge(out.get(key), value)
    return out


def apply_patch(node_obj: K8sObject, patch: NodePatch) -> K8sObject:
    """What the API server does with our merge patch (null removes a key)."""
    result = copy.deepcopy(node_obj)
    meta = result["metadata"]
    for field, changes in (("labels", patch.labels), ("annotations", patch.annotations)):
        target = meta.setdefault(field, {})
        for key, value in changes:
            if value is None:
                target.pop(key, None)
            else:
                target[key] = value
    meta["resourceVersion"] = str(int(meta.get("resourceVersion", "0")) + 1)
    return result


def apply_pod_action(
    pods: list[K8sObject], action: PodAction, blocked: frozenset[str] = frozenset()
) -> list[K8sObject]:
    """An accepted eviction or delete marks the pod terminating (no kubelet finishes it)."""
    result = []
    for p in pods:
        meta = p["metadata"]
        hit = (
            meta["namespace"] == action.namespace
            and meta["name"] == action.name
            and meta["uid"] == action.uid
        )
        if hit and (action.verb == "delete" or action.key not in blocked):
            p = copy.deepcopy(p)
            p["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        result.append(p)
    return result


class ReportRecorder:
    """An Event emitter that keeps what it is given (``reports``) and never fails."""

    def __init__(self) -> None:
        self.reports: list[Report] = []

    async def emit(self, report: Report) -> bool:
        self.reports.append(report)
        return True


class FakeUpgradeIO:
    """An in-process stand-in for the API server the upgrade controller talks to: nodes,
    pods and DaemonSets in dicts. Its caches (``caches``, a registry whose caches are
    filled here, never listed: ``testenv.caches``) hold the nodes as the node caches'
    lists and watches would, and its node patches reach them as their watch events do
    (before the patch's answer: ``WritesInFlight`` holds such an echo)."""

    def __init__(
        self,
        nodes: list[K8sObject],
        pods: list[K8sObject],
        daemonsets: Sequence[K8sObject] = (),
        *,
        blocked: frozenset[str] = frozenset(),
        cluster_policies: Sequence[K8sObject] = (),
        driver: str = "gpu",
        nvidia_drivers: Sequence[K8sObject] = (),
        driver_crd: K8sObject | None = None,
    ) -> None:
        """``nvidia_drivers`` and ``driver_crd`` (the NVIDIADriver CRD: None, not installed)
        decide with the ClusterPolicies which upgrade policy gpu-operator reads."""
        self.caches = offline_registry()
        self.cached = UpgradeCaches.of(self.caches, driver)
        self.nodes = {n["metadata"]["name"]: n for n in nodes}
        self.pods: dict[str, list[K8sObject]] = {}
        self.node_of: dict[str, str] = {}  # pod key -> node name
        for p in pods:
            self.pods.setdefault(p["spec"]["nodeName"], []).append(p)
            self.node_of[f"{p['metadata']['namespace']}/{p['metadata']['name']}"] = p["spec"][
                "nodeName"
            ]
        self.blocked = blocked
        self.writes: list[NodePatch | PodAction] = []
        self.fail_next: list[Exception] = []
        self.pod_lists: list[tuple[str, str | None]] = []  # (node, skip_namespace) of each list
        self.driver_lists: list[tuple[str, str]] = []  # (node, namespace) of each driver list
        self.echo_after_answer = False
        self._writes = 0  # of ClusterPolicies and NVIDIADrivers: each a new resourceVersion
        for cache in self.cached.nodes:
            fill(cache, [copy.deepcopy(n) for n in nodes])
        fill(self.cached.daemonsets, [copy.deepcopy(d) for d in daemonsets])
        self.set_cluster_policies(cluster_policies)
        self.set_nvidia_drivers(nvidia_drivers)
        self.set_driver_crd(driver_crd)

    def set_node(self, node_obj: K8sObject) -> None:
        """The node as it is now: each node cache's watch brings it (its handlers are told)."""
        self.nodes[node_obj["metadata"]["name"]] = node_obj
        for cache in self.cached.nodes:
            deliver(cache, copy.deepcopy(node_obj))

    def delete_node(self, name: str) -> None:
        node_obj = self.nodes.pop(name)
        for cache in self.cached.nodes:
            deliver(cache, copy.deepcopy(node_obj), deleted=True)

    def _written(self, objects: Sequence[K8sObject]) -> list[K8sObject]:
        """Copies of ``objects``, each written (a new resourceVersion)."""
        written = []
        for obj in objects:
            self._writes += 1
            obj = copy.deepcopy(obj)
            obj["metadata"]["resourceVersion"] = f"w-{self._writes}"
            written.append(obj)
        return written

    def set_cluster_policies(self, policies: Sequence[K8sObject]) -> None:
        """The ClusterPolicies, written (each a new resourceVersion), as a list brings them."""
        fill(self.cached.cluster_policies, self._written(policies))

    def set_nvidia_drivers(self, drivers: Sequence[K8sObject]) -> None:
        """The NVIDIADrivers, written (each a new resourceVersion), as a list brings them."""
        fill(self.cached.nvidia_drivers, self._written(drivers))

    def set_driver_crd(self, crd: K8sObject | None) -> None:
        """The NVIDIADriver CRD (None: not installed), as its cache keeps it."""
        fill(self.cached.driver_crd, [] if crd is None else [copy.deepcopy(crd)])

    async def pods_on_node(self, name: str, skip_namespace: str | None = None) -> list[K8sObject]:
        self.pod_lists.append((name, skip_namespace))
        return [p for p in self.pods.get(name, []) if p["metadata"]["namespace"] != skip_namespace]

    async def driver_pods_on_node(self, name: str, namespace: str) -> list[K8sObject]:
        self.driver_lists.append((name, namespace))
        return [p for p in self.pods.get(name, []) if is_driver_pod(p, namespace)]

    async def patch_node(self, patch: NodePatch) -> str:
        """The patch applied; the node caches' watch events of it come before its answer
        (or, with ``echo_after_answer``, right after it)."""
        if self.fail_next:
            raise self.fail_next.pop(0)
        self.writes.append(patch)
        patched = apply_patch(self.nodes[patch.node], patch)
        if self.echo_after_answer:
            self.nodes[patch.node] = patched
            asyncio.get_running_loop().call_soon(self.set_node, patched)
        else:
            self.set_node(patched)
        return str(patched["metadata"]["resourceVersion"])

    async def _pod_action(self, action: PodAction) -> str:
        self.writes.append(action)
        name = self.node_of.get(action.key)
        if name is not None:
            self.pods[name] = apply_pod_action(self.pods[name], action, self.blocked)
        return "blocked" if action.verb == "evict" and action.key in self.blocked else "evicted"

    async def evict(self, action: PodAction) -> str:
        return await self._pod_action(action)

    async def delete_pod(self, action: PodAction) -> str:
        return await self._pod_action(action)
