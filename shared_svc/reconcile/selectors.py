"""Selectors and upgrade safety (contract section 4): the gate and the choice of selector.

A stable name moves to the common label only when every stack that needs it has rolled
out pods that all carry it, so switching never drops an endpoint; when labels disappear
again (an operator rollback) the same rules fall back to the ``app`` label.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shared_svc.reconcile.model import GateState, K8sObject, Settings, World
from shared_svc.reconcile.names import (
    APP_LABEL,
    COMMON_LABEL,
    COMPONENT_OF,
    DRA_APP,
    EXPORTER,
    LEGACY_APP,
    STABLE_NAMES,
    Component,
)
from shared_svc.reconcile.needs import Needs
from shared_svc.reconcile.objects import in_namespace, labels_of, meta, name_of, spec
from shared_svc.reconcile.specs import CLUSTER_POLICY, GPU_CLUSTER, CRKind

Selector = dict[str, str]
_STRAGGLERS_NAMED = 5


@dataclass(frozen=True)
class Workloads:
    """DaemonSets by name and pods by ``app`` label: built once, so planning stays linear."""

    daemonsets: Mapping[str, K8sObject]
    pods_by_app: Mapping[str, tuple[K8sObject, ...]]


def index_workloads(world: World, namespace: str) -> Workloads:
    daemonsets: dict[str, K8sObject] = {}
    for ds in world.daemonsets:
        if isinstance(ds, dict) and in_namespace(ds, namespace):
            daemonsets[name_of(ds)] = ds
    pods: dict[str, list[K8sObject]] = {}
    for pod in world.pods:
        if isinstance(pod, dict) and in_namespace(pod, namespace):
            app = labels_of(pod).get(APP_LABEL)
            if app is not None:
                pods.setdefault(app, []).append(pod)
    return Workloads(daemonsets, {k: tuple(v) for k, v in pods.items()})


def app_label_of(stack: CRKind, component: Component) -> str:
    return LEGACY_APP[component] if stack == CLUSTER_POLICY else DRA_APP[component]


def _count(status: Mapping[str, Any], key: str) -> int:
    value = status.get(key)
    # A missing number means the controller has not counted it yet: 0.
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def gate_open(stack: CRKind, component: Component, workloads: Workloads) -> GateState:
    """Section 4's gate for one stack and component, with the failing conditions as text."""
    app = app_label_of(stack, component)
    common = COMMON_LABEL[component]
    failing: list[str] = []
    ds = workloads.daemonsets.get(app)
    if ds is None:
        failing.append(f"DaemonSet {app} not found")
    else:
        template = spec(ds).get("template")
        template_meta = template.get("metadata") if isinstance(template, dict) else None
        tlabels = template_meta.get("labels") if isinstance(template_meta, dict) else None
        if not isinstance(tlabels, dict) or tlabels.get(common) != "true":
            failing.append(f"DaemonSet {app}: pod template lacks label {common}=true")
        raw_status = ds.get("status")
        status: dict[str, Any] = raw_status if isinstance(raw_status, dict) else {}
        generation = _count(meta(ds), "generation")
        observed = _count(status, "observedGeneration")
        if observed < generation:
            failing.append(
                f"DaemonSet {app}: rollout not observed "
                f"(observedGeneration {observed} < generation {generation})"
            )
        updated = _count(status, "updatedNumberScheduled")
        desired = _count(status, "desiredNumberScheduled")
        available = _count(status, "numberAvailable")
        if not updated == desired == available:
            failing.append(
                f"DaemonSet {app}: rollout incomplete (updatedNumberScheduled {updated}, "
                f"desiredNumberScheduled {desired}, numberAvailable {available})"
            )
    # Pods being deleted still count: they may be serving until they are gone.
    stragglers = sorted(
        name_of(p) for p in workloads.pods_by_app.get(app, ()) if labels_of(p).get(common) != "true"
    )
    if stragglers:
        named = ", ".join(stragglers[:_STRAGGLERS_NAMED])
        more = len(stragglers) - _STRAGGLERS_NAMED
        suffix = f" and {more} more" if more > 0 else ""
        failing.append(
            f"{len(stragglers)} pod(s) with {APP_LABEL}={app} lack label {common}=true: {named}{suffix}"
        )
    return GateState(stack=stack, open=not failing, failing=tuple(failing))


@dataclass(frozen=True)
class SelectorChoice:
    name: str
    selector: Selector
    gates: tuple[GateState, ...]
    pending: str | None  # SelectorMigrationPending message, when reported


def choose_selector(
    name: str, needs: Needs, workloads: Workloads, settings: Settings
) -> SelectorChoice:
    component = COMPONENT_OF[name]
    if name not in STABLE_NAMES:
        return SelectorChoice(name, {APP_LABEL: DRA_APP[component]}, (), None)
    stacks: list[CRKind] = sorted(needs.stacks_needing(name))
    gates = tuple(gate_open(s, component, workloads) for s in stacks)
    common = COMMON_LABEL[component]
    if settings.selector_mode == "auto" and gates and all(g.open for g in gates):
        selector = {common: "true"}
    elif CLUSTER_POLICY in stacks:
        # Legacy exporters are hard-wired to nvidia-dcgm:5555 and legacy pods have no other name.
        selector = {APP_LABEL: LEGACY_APP[component]}
    else:
        selector = {APP_LABEL: DRA_APP[component]}
    pending = None
    if settings.selector_mode == "auto" and len(stacks) == 2 and not all(g.open for g in gates):
        failing = "; ".join(f"{g.stack}: {c}" for g in gates for c in g.failing)
        pending = (
            f"Service {name} keeps selector {_text(selector)} until the ClusterPolicy and the "
            f"GPUCluster (DRA) stacks both carry {common}=true on all pods; failing: {failing}"
        )
    return SelectorChoice(name, selector, gates, pending)


def selects_dra_pods(choice: SelectorChoice, workloads: Workloads) -> bool:
    """Whether a stable exporter selector covers the DRA stack's pods (for scrape dedup)."""
    component = COMPONENT_OF[choice.name]
    if choice.selector == {APP_LABEL: DRA_APP[component]}:
        return True
    if choice.selector == {COMMON_LABEL[component]: "true"}:
        return gate_open(GPU_CLUSTER, component, workloads).open
    return False


def selector_matches(selector: Mapping[str, str], pod_labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(pod_labels.get(k) == v for k, v in selector.items())


def _text(selector: Selector) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))


CANONICAL = EXPORTER
