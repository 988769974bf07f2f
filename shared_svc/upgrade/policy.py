"""Which upgrade policy gpu-operator reads, and for which nodes (contract section 3a, "the
policy's source is gpu-operator's"; facts: driver-upgrade.md sections 2 and 8).

gpu-operator's upgrade controller (v26.7.0, ``Reconcile``) resolves the active ClusterPolicy:

- **ClusterPolicy mode** (a ClusterPolicy without ``spec.driver.useNvidiaDriverCRD: true``):
  its ``spec.driver.upgradePolicy`` governs every node (``autoUpgrade`` defaults to false);
- **NVIDIADriver mode** (``useNvidiaDriverCRD: true``, or no ClusterPolicy at all, as in a
  GPUCluster cluster: the GPUCluster does not manage the driver): the cluster state is
  partitioned by each node's ``nvidia.com/gpu-operator.driver.owner`` label and every
  NVIDIADriver's own ``spec.upgradePolicy`` (``autoUpgrade`` defaults to true, even with no
  ``upgradePolicy``) governs the nodes labelled with its name; a node without that label
  (or naming no NVIDIADriver) is governed by none and skipped.

gpu-operator before v26.7.0 (v25.3.4) reads the ClusterPolicy's policy in both modes: its
NVIDIADriver CRD has no ``spec.upgradePolicy``. Which rule holds is read from the served
NVIDIADriver CRD (:func:`reads_driver_policy`): no CRD, or one without the field, keeps the
ClusterPolicy rule. ``sandboxWorkloads.enabled`` on the active ClusterPolicy turns the flow
off in both modes (gpu-operator checks it before it picks the mode, and removes the state
label from every node).

Pure: the CRs and the CRD in, :class:`PolicySources` out; a node's labels in, its
:class:`NodeFlow` out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from shared_svc.k8s import objects
from shared_svc.k8s.objects import K8sObject
from shared_svc.reconcile.needs import active_cluster_policy
from shared_svc.reconcile.specs import CLUSTER_POLICY, parse_cr

# gpu-operator's driver name (its main.go: upgrade.SetDriverName("gpu")): these rules are
# gpu-operator's, for its flow; another operator's (the network operator's "ofed") is taken
# from its state labels alone.
GPU_OPERATOR_DRIVER = "gpu"
# gpu-operator's node labelling controller sets it on the nodes an NVIDIADriver selects.
OWNER_LABEL = "nvidia.com/gpu-operator.driver.owner"
NVIDIA_DRIVER_CRD = "nvidiadrivers.nvidia.com"
# The key the NVIDIADriver CRD cache keeps of the CRD (``crd_fields``).
READS_POLICY = "readsUpgradePolicy"

Mode = Literal["cluster-policy", "nvidia-driver", "none"]


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


@dataclass(frozen=True)
class UpgradePolicy:
    """One policy source gpu-operator reads: what the gate check and ``configure-gate`` need."""

    kind: str  # ClusterPolicy or NVIDIADriver
    api_version: str
    name: str
    uid: str | None
    auto_upgrade: bool  # the flow runs for its nodes (autoUpgrade on, sandbox workloads off)
    pod_selector: str  # waitForCompletion.podSelector, "" when unset
    timeout_seconds: int  # waitForCompletion.timeoutSeconds; 0 (the default) waits forever
    resource_version: str | None = None
    # NVIDIADriver: it governs the nodes labelled OWNER_LABEL=<name>; None: every node.
    owner: str | None = None
    off: str = ""  # why auto_upgrade is off, for the verdict

    @property
    def where(self) -> str:
        return f"{self.kind}/{self.name}"

    @property
    def policy_path(self) -> tuple[str, ...]:
        """Where the upgrade policy lives in the object."""
        return (
            ("spec", "driver", "upgradePolicy") if self.owner is None else ("spec", "upgradePolicy")
        )

    @property
    def gate_field(self) -> str:
        return ".".join((*self.policy_path, "waitForCompletion", "podSelector"))

    @property
    def governs(self) -> str:
        return (
            "every node" if self.owner is None else f"the nodes labelled {OWNER_LABEL}={self.owner}"
        )


def policy_of_cluster_policy(obj: K8sObject) -> UpgradePolicy:
    """Lenient: a field of the wrong type reads as unset (the API server's schema checks types)."""
    upgrade = objects.dig(obj, "spec", "driver", "upgradePolicy")
    sandbox = objects.dig(obj, "spec", "sandboxWorkloads", "enabled") is True
    auto = objects.dig(upgrade, "autoUpgrade") is True  # the ClusterPolicy CRD's default: false
    selector = objects.dig(upgrade, "waitForCompletion", "podSelector")
    return UpgradePolicy(
        kind="ClusterPolicy",
        api_version=str(obj.get("apiVersion") or "nvidia.com/v1"),
        name=objects.name_of(obj),
        uid=objects.uid_of(obj) or None,
        auto_upgrade=auto and not sandbox,
        pod_selector=selector if isinstance(selector, str) else "",
        timeout_seconds=_int(objects.dig(upgrade, "waitForCompletion", "timeoutSeconds")),
        resource_version=objects.resource_version_of(obj) or None,
        off="sandboxWorkloads.enabled" if sandbox else ("" if auto else "autoUpgrade is false"),
    )


def policy_of_nvidia_driver(obj: K8sObject, *, sandbox: bool = False) -> UpgradePolicy:
    """``GetUpgradePolicyWithDefaults``: ``autoUpgrade`` is true unless set false, with or
    without ``upgradePolicy``. ``sandbox``: the active ClusterPolicy runs sandbox workloads."""
    upgrade = objects.dig(obj, "spec", "upgradePolicy")
    auto = objects.dig(upgrade, "autoUpgrade") is not False
    selector = objects.dig(upgrade, "waitForCompletion", "podSelector")
    name = objects.name_of(obj)
    return UpgradePolicy(
        kind="NVIDIADriver",
        api_version=str(obj.get("apiVersion") or "nvidia.com/v1alpha1"),
        name=name,
        uid=objects.uid_of(obj) or None,
        auto_upgrade=auto and not sandbox,
        pod_selector=selector if isinstance(selector, str) else "",
        timeout_seconds=_int(objects.dig(upgrade, "waitForCompletion", "timeoutSeconds")),
        resource_version=objects.resource_version_of(obj) or None,
        owner=name,
        off="sandboxWorkloads.enabled on the ClusterPolicy"
        if sandbox
        else ("" if auto else "autoUpgrade is false"),
    )


def reads_driver_policy(crd: K8sObject | None) -> bool:
    """Whether the NVIDIADriver CRD gives a served version ``spec.upgradePolicy`` (gpu-operator
    v26.7.0 and later: each NVIDIADriver's policy is read in NVIDIADriver mode). A CRD
    projected by :func:`crd_fields` carries the answer itself."""
    if not isinstance(crd, Mapping):
        return False
    if isinstance(crd.get(READS_POLICY), bool):
        return bool(crd[READS_POLICY])
    versions = objects.dig(crd, "spec", "versions")
    for version in versions if isinstance(versions, list) else ():
        if not isinstance(version, Mapping) or version.get("served") is False:
            continue
        spec = objects.dig(version, "schema", "openAPIV3Schema", "properties", "spec", "properties")
        if isinstance(spec, Mapping) and "upgradePolicy" in spec:
            return True
    return False


def crd_fields(crd: K8sObject) -> K8sObject:
    """What the NVIDIADriver CRD cache keeps of the CRD (about 60 KiB of schema): its
    identity and :func:`reads_driver_policy`."""
    meta = objects.meta(crd)
    return {
        "apiVersion": crd.get("apiVersion"),
        "kind": crd.get("kind"),
        "metadata": {
            k: meta[k] for k in ("name", "uid", "resourceVersion", "deletionTimestamp") if k in meta
        },
        READS_POLICY: reads_driver_policy(crd),
    }


@dataclass(frozen=True)
class NodeFlow:
    """What drives one node's upgrade: the policy that governs it, or why none does."""

    policy: UpgradePolicy | None
    no_flow: str | None  # None: the flow moves the node (its state label means what it says)


@dataclass(frozen=True)
class PolicySources:
    """The policy sources gpu-operator reads now, and how it chose them."""

    mode: Mode
    policies: tuple[UpgradePolicy, ...]  # by name; ClusterPolicy mode: the one ClusterPolicy
    why: str  # how the mode was decided
    # Policies gpu-operator does not read in this mode (the ClusterPolicy in NVIDIADriver
    # mode, NVIDIADrivers in ClusterPolicy mode): a gate set there holds nothing.
    unread: tuple[UpgradePolicy, ...] = ()

    def flows(self) -> tuple[object, ...]:
        """What :meth:`flow` depends on: equal for two sources that decide every node alike
        (a new resourceVersion or gate of a policy changes no node's flow)."""
        return (self.mode, tuple((p.where, p.owner, p.auto_upgrade, p.off) for p in self.policies))

    def governing(self, labels: Mapping[str, str]) -> UpgradePolicy | None:
        """The source that governs a node with these labels (None: none does)."""
        if self.mode == "cluster-policy":
            return self.policies[0]
        if self.mode == "nvidia-driver":
            owner = labels.get(OWNER_LABEL)
            return next((p for p in self.policies if p.owner == owner), None)
        return None

    def flow(self, labels: Mapping[str, str]) -> NodeFlow | None:
        """The flow of a node with these labels; None when gpu-operator's CRs say nothing of
        it (no ClusterPolicy and no NVIDIADriver policy: the node's state label is taken
        as it is, as before this rule).

        In ClusterPolicy mode the one policy governs every node and its state label is taken
        as it is: gpu-operator removes it from every node when auto-upgrade is off (or
        sandbox workloads on), and that is the abort. In NVIDIADriver mode a node that no
        NVIDIADriver with auto-upgrade on owns is moved by no flow, whatever its label says.
        """
        if self.mode == "none":
            return None
        policy = self.governing(labels)
        if self.mode == "cluster-policy":
            return NodeFlow(policy, None)
        if policy is None:
            owner = labels.get(OWNER_LABEL)
            why = (
                f"the node has no {OWNER_LABEL} label: in NVIDIADriver mode gpu-operator's "
                "upgrade flow skips it"
                if owner is None
                else f"no NVIDIADriver {owner!r} (the node's {OWNER_LABEL}): no upgrade flow "
                "governs it"
            )
            return NodeFlow(None, why)
        if not policy.auto_upgrade:
            return NodeFlow(policy, f"{policy.where}: driver auto-upgrade is off ({policy.off})")
        return NodeFlow(policy, None)


def policy_sources(
    cluster_policies: Iterable[K8sObject],
    nvidia_drivers: Iterable[K8sObject],
    *,
    driver_policy: bool,
) -> PolicySources:
    """gpu-operator's choice (module doc). ``driver_policy``: the NVIDIADriver CRD has
    ``spec.upgradePolicy`` (:func:`reads_driver_policy`; False where it is not installed)."""
    policies = [o for o in cluster_policies if isinstance(o, dict)]
    nvidia_drivers = [o for o in nvidia_drivers if isinstance(o, dict)]
    chosen = active_cluster_policy([parse_cr(CLUSTER_POLICY, o) for o in policies])
    active = (
        None if chosen is None else next(o for o in policies if objects.name_of(o) == chosen.name)
    )
    if active is not None and (
        not driver_policy or objects.dig(active, "spec", "driver", "useNvidiaDriverCRD") is not True
    ):
        crd_mode = objects.dig(active, "spec", "driver", "useNvidiaDriverCRD") is True
        why = (
            "ClusterPolicy mode"
            if not crd_mode
            else f"ClusterPolicy/{objects.name_of(active)} sets spec.driver.useNvidiaDriverCRD, "
            "and the NVIDIADriver CRD has no spec.upgradePolicy (gpu-operator before v26.7.0, "
            "or a v26.7 whose CRDs were not upgraded): the ClusterPolicy's policy is read"
        )
        unread = tuple(
            sorted(
                (policy_of_nvidia_driver(o) for o in nvidia_drivers),
                key=lambda p: p.name,
            )
            if driver_policy
            else ()
        )
        return PolicySources("cluster-policy", (policy_of_cluster_policy(active),), why, unread)
    if not driver_policy:
        return PolicySources(
            "none",
            (),
            "no ClusterPolicy, and no NVIDIADriver CRD with an upgradePolicy: no upgrade flow",
        )
    sandbox = (
        active is not None and objects.dig(active, "spec", "sandboxWorkloads", "enabled") is True
    )
    drivers = sorted(
        (policy_of_nvidia_driver(o, sandbox=sandbox) for o in nvidia_drivers),
        key=lambda p: p.name,
    )
    why = (
        f"NVIDIADriver mode (ClusterPolicy/{objects.name_of(active)} sets "
        "spec.driver.useNvidiaDriverCRD)"
        if active is not None
        else "NVIDIADriver mode (no ClusterPolicy: each NVIDIADriver's policy)"
    )
    unread = () if active is None else (policy_of_cluster_policy(active),)
    return PolicySources("nvidia-driver", tuple(drivers), why, unread)
