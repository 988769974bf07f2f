"""Which path a node's driver upgrade takes: ``full`` (the driver is unloaded: free the
consumers) or ``restart-only`` (the modules stay loaded: free nothing).

From gpu-operator v26.7.0 its upgrade controller registers a restart-only rule on
k8s-operator-libs' state machine (libs ``RestartOnlyPredicate``, gpu-operator PR #2527): a
node whose running driver pod carries the same ``DRIVER_CONFIG_DIGEST`` env as the driver
DaemonSet's template (a change that does not touch the driver, e.g. a chart label after a
``helm upgrade`` of gpu-operator) goes ``upgrade-required`` -> (cordoned) ->
``pod-restart-required`` and skips ``cordon-required``, ``wait-for-jobs-required``,
``pod-deletion-required`` and ``drain-required``; the driver-manager then keeps the kernel
modules loaded. The libs decide it once, in ``upgrade-required``, where shared-svc writes
nothing; afterwards the two paths meet in ``pod-restart-required``. :func:`decide` tells
them apart from evidence that survives a restart of shared-svc:

1. the state: any freeing state but ``pod-restart-required`` is on the full path only;
2. our record on the node: a freeing record (we freed in an earlier state of this
   upgrade) is the full path; a restart-only verdict recorded in ``pod-restart-required``
   holds while the driver DaemonSet's template keeps the digest it was decided on (a
   driver change meanwhile revokes it: the new driver pod reinstalls the driver);
3. the driver pod against its DaemonSet, while the old pod is there (the libs delete it
   right after ``pod-restart-required``; a terminating pod still shows its spec): a driver
   pod whose digest differs from its DaemonSet's template (or either has none, as before
   gpu-operator v26.7.0) is reinstalled: full path; an old pod (terminating, or of an
   older ``pod-template-generation``) whose digest equals the template's: restart-only;
4. nothing of that (no record, the old pod gone): a guess, on the side that cannot stall a
   full upgrade (free), reported as a guess.

Pure: plain objects in, a :class:`Verdict` out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from shared_svc.k8s import objects
from shared_svc.k8s.objects import K8sObject
from shared_svc.k8s.projections import DRIVER_CONFIG_DIGEST
from shared_svc.upgrade.daemonsets import template_spec
from shared_svc.upgrade.record import Record

Path = Literal["full", "restart-only"]
# state: a freeing state only the full path has; record: we freed in this upgrade;
# verdict: our recorded restart-only verdict, still true; changed: that verdict, revoked by
# a driver change; driver-pod: the driver pod against its DaemonSet; guess: no evidence.
Evidence = Literal["state", "record", "verdict", "changed", "driver-pod", "guess"]

RESTART_STATE = "pod-restart-required"
# The label of gpu-operator's driver pods in both modes (ClusterPolicy's
# nvidia-driver-daemonset and the NVIDIADriver CR's DaemonSets carry it).
DRIVER_POD_LABEL = "app.kubernetes.io/component"
DRIVER_POD_VALUE = "nvidia-driver"
# Set by the DaemonSet controller on every pod it creates: the DaemonSet's generation then.
TEMPLATE_GENERATION_LABEL = "pod-template-generation"


def driver_pod_selector() -> str:
    """The label selector of the driver pods (the shell lists them by it, per node)."""
    return f"{DRIVER_POD_LABEL}={DRIVER_POD_VALUE}"


def is_driver_pod(pod: K8sObject, operator_namespace: str) -> bool:
    return (
        objects.namespace_of(pod) == operator_namespace
        and objects.labels_of(pod).get(DRIVER_POD_LABEL) == DRIVER_POD_VALUE
    )


def config_digest(pod_spec: Any) -> str | None:
    """The ``DRIVER_CONFIG_DIGEST`` literal of the first container, then init container,
    that sets one (gpu-operator sets it on the driver container and the driver-manager
    init container alike); None when none does. A value from ``valueFrom`` is no literal."""
    if not isinstance(pod_spec, Mapping):
        return None
    for field in ("containers", "initContainers"):
        containers = pod_spec.get(field)
        for container in containers if isinstance(containers, list) else ():
            env = container.get("env") if isinstance(container, Mapping) else None
            for entry in env if isinstance(env, list) else ():
                if (
                    isinstance(entry, Mapping)
                    and entry.get("name") == DRIVER_CONFIG_DIGEST
                    and "valueFrom" not in entry
                    and isinstance(entry.get("value", ""), str)
                ):
                    return str(entry.get("value", ""))
    return None


def restart_only(running: Any, desired: Any) -> bool:
    """gpu-operator's restart-only rule: the running driver pod's spec and the DaemonSet
    template's carry the same, non-empty ``DRIVER_CONFIG_DIGEST``. A missing or differing
    digest takes the full upgrade flow."""
    digest = config_digest(running)
    return bool(digest) and digest == config_digest(desired)


@dataclass(frozen=True)
class Verdict:
    path: Path
    evidence: Evidence
    note: str  # what the evidence was, for the Event and ``upgrade status``
    daemonset: str | None = None  # restart-only: namespace/name of the driver DaemonSet
    digest: str | None = None  # restart-only: the digest it was decided on


def verdict_holds(rec: Record, daemonsets: Iterable[K8sObject]) -> bool:
    """A recorded restart-only verdict still holds: its DaemonSet's template has the digest."""
    if rec.restart_only is None:
        return False
    for ds in daemonsets:
        if objects.key_of(ds) == rec.restart_only.daemonset:
            return config_digest(template_spec(ds)) == rec.restart_only.digest
    return False


def _generation(ds: K8sObject) -> str:
    value = objects.meta(ds).get("generation")
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else ""


def decide(
    state: str | None,
    rec: Record | None,
    pods: Iterable[K8sObject],
    daemonsets: Iterable[K8sObject],
    operator_namespace: str,
) -> Verdict:
    """The path of a node in a freeing state ``state``, from our record ``rec`` on it, the
    pods bound to it (its driver pods among them) and the DaemonSets (see the module doc)."""
    if state != RESTART_STATE:
        return Verdict("full", "state", f"the node passed {state}, a state of the full path only")
    daemonsets = list(daemonsets)
    if rec is not None:
        return _from_record(rec, daemonsets)
    return _from_driver_pods(pods, daemonsets, operator_namespace)


def _from_record(rec: Record, daemonsets: list[K8sObject]) -> Verdict:
    """Evidence 2: our record on the node, in ``pod-restart-required``."""
    ro = rec.restart_only
    if ro is None:
        return Verdict("full", "record", "shared-svc freed this node earlier in this upgrade")
    if verdict_holds(rec, daemonsets):
        return Verdict("restart-only", "verdict", "recorded restart-only", ro.daemonset, ro.digest)
    return Verdict(
        "full",
        "changed",
        f"DaemonSet {ro.daemonset} changed its DRIVER_CONFIG_DIGEST (or is gone) during the "
        "restart-only driver restart: the driver is reinstalled",
    )


def _from_driver_pods(
    pods: Iterable[K8sObject], daemonsets: list[K8sObject], operator_namespace: str
) -> Verdict:
    """Evidence 3 and 4: the driver pods against their DaemonSets, else a guess."""
    by_uid = {objects.uid_of(ds): ds for ds in daemonsets if objects.uid_of(ds)}
    old: list[tuple[str, str, str]] = []  # (pod, daemonset, digest) of old pods, digests equal
    for pod in sorted(pods, key=objects.key_of):
        if not is_driver_pod(pod, operator_namespace):
            continue
        uids = [str(r.get("uid")) for r in objects.owner_refs(pod, "DaemonSet")]
        owner = next((by_uid[uid] for uid in uids if uid in by_uid), None)
        key = objects.key_of(pod)
        if owner is None:
            return Verdict(
                "full", "driver-pod", f"driver pod {key} has no DaemonSet: the full upgrade flow"
            )
        ds_key, desired = objects.key_of(owner), template_spec(owner)
        if not restart_only(pod.get("spec"), desired):
            return Verdict(
                "full",
                "driver-pod",
                f"driver pod {key} and DaemonSet {ds_key} differ in {DRIVER_CONFIG_DIGEST} "
                f"({config_digest(pod.get('spec'))!r} != {config_digest(desired)!r}): the "
                "driver is reinstalled",
            )
        generation = objects.labels_of(pod).get(TEMPLATE_GENERATION_LABEL)
        if objects.meta(pod).get("deletionTimestamp") or (
            generation is not None and generation != _generation(owner)
        ):
            old.append((key, ds_key, config_digest(desired) or ""))
    if old:
        key, ds_key, digest = old[0]
        return Verdict(
            "restart-only",
            "driver-pod",
            f"the old driver pod {key} has the {DRIVER_CONFIG_DIGEST} of DaemonSet {ds_key}'s "
            "template: the driver restarts in place, its kernel modules stay loaded",
            ds_key,
            digest,
        )
    return Verdict(
        "full",
        "guess",
        "no evidence of the path (no record of shared-svc on the node, the old driver pod gone)",
    )
