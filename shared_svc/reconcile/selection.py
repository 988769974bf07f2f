"""Selectors and upgrade safety (contract section 4): the gate, the hold and the choice of selector.

A stable name moves to the common label only when every stack that needs it has rolled
out pods that all carry it, so switching never drops an endpoint; when labels disappear
again (an operator rollback) the same rules fall back to the ``app`` label. And whatever
those rules choose, ``nvidia-dcgm`` never moves to a selector whose ready pods cover fewer
nodes than the pods it selects now (the hold: DCGM is node-local, so a node is covered
when a ready pod on it is selected). The exporter name follows the rules at once: its
consumer is the scraper, kept whole by the scrape annotations and the write order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shared_svc.k8s.objects import K8sObject, in_namespace, labels_of, meta, name_of, spec
from shared_svc.k8s.selectors import selector_from_set
from shared_svc.reconcile.model import GateState, Settings, World
from shared_svc.reconcile.names import (
    APP_LABEL,
    COMMON_LABEL,
    COMPONENT_OF,
    DCGM,
    DRA_APP,
    EXPORTER,
    LEGACY_APP,
    STABLE_NAMES,
    Component,
)
from shared_svc.reconcile.needs import Needs
from shared_svc.reconcile.specs import CLUSTER_POLICY, GPU_CLUSTER, CRKind

Selector = dict[str, str]
# The names the hold applies to (section 4): node-local DCGM only.
HOLDING_NAMES: tuple[str, ...] = (DCGM,)
_STRAGGLERS_NAMED = 5


@dataclass(frozen=True)
class PodIndex:
    """The pods of the namespace as planning reads them, built in one pass. Kept from one
    plan to the next (:func:`pod_index`), so it holds few objects of its own (a long-lived
    object per pod would make every full garbage collection slower): the labels are the
    pods' own label sets, and the serving pods two parallel tuples."""

    by_app: Mapping[str, tuple[K8sObject, ...]]  # by ``app`` label
    # the labels and node of every ready, running pod of the namespace bound to a node
    serving_labels: tuple[Mapping[str, str], ...]
    serving_nodes: tuple[str, ...]
    # the gate's stragglers: per DCGM ``app``, the sorted names of its pods that lack the
    # common label of its component
    stragglers: Mapping[str, tuple[str, ...]]
    # covered nodes by selector, as asked (``covered_nodes``; the hold asks of a few)
    _covered: dict[frozenset[tuple[str, str]], frozenset[str]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def serving(self) -> tuple[tuple[Mapping[str, str], str], ...]:
        """(labels, node) of every serving pod."""
        return tuple(zip(self.serving_labels, self.serving_nodes, strict=True))

    def covered(self, selector: Mapping[str, str]) -> frozenset[str]:
        """Nodes on which ``selector`` selects a serving pod (once per selector)."""
        key = frozenset(selector.items())
        found = self._covered.get(key)
        if found is None:
            matcher = selector_from_set(selector)
            found = frozenset(
                node
                for labels, node in zip(self.serving_labels, self.serving_nodes, strict=True)
                if matcher.matches(labels)
            )
            self._covered[key] = found
        return found


@dataclass(frozen=True)
class Workloads:
    """DaemonSets by name and the pod index: built once, so planning stays linear."""

    daemonsets: Mapping[str, K8sObject]
    pods: PodIndex

    @property
    def pods_by_app(self) -> Mapping[str, tuple[K8sObject, ...]]:
        return self.pods.by_app

    @property
    def serving(self) -> tuple[tuple[Mapping[str, str], str], ...]:
        return self.pods.serving


# The common label of each DCGM ``app`` (the gate's: ``app_label_of`` and ``COMMON_LABEL``).
_COMMON_OF_APP: Mapping[str, str] = {
    app: COMMON_LABEL[component]
    for apps in (LEGACY_APP, DRA_APP)
    for component, app in apps.items()
}


def index_workloads(world: World, namespace: str) -> Workloads:
    """The DaemonSets (a few) indexed anew; the pods' index is :func:`pod_index`'s."""
    daemonsets: dict[str, K8sObject] = {}
    for ds in world.daemonsets:
        if isinstance(ds, dict) and in_namespace(ds, namespace):
            daemonsets[name_of(ds)] = ds
    return Workloads(daemonsets, pod_index(world.pods, namespace))


def build_pod_index(pods: Iterable[K8sObject], namespace: str) -> PodIndex:
    """One pass over the pods: by ``app``, the serving ones and the gate's stragglers."""
    by_app: dict[str, list[K8sObject]] = {}
    serving_labels: list[Mapping[str, str]] = []
    serving_nodes: list[str] = []
    stragglers: dict[str, list[str]] = {}
    for pod in pods:
        if isinstance(pod, dict) and in_namespace(pod, namespace):
            labels = _labels(pod)
            app = labels.get(APP_LABEL)
            if app is not None:
                by_app.setdefault(app, []).append(pod)
                common = _COMMON_OF_APP.get(app)
                # Pods being deleted still count: they may be serving until they are gone.
                if common is not None and labels.get(common) != "true":
                    stragglers.setdefault(app, []).append(name_of(pod))
            node = serving_node(pod)
            if node is not None:
                serving_labels.append(labels)
                serving_nodes.append(node)
    return PodIndex(
        {k: tuple(v) for k, v in by_app.items()},
        tuple(serving_labels),
        tuple(serving_nodes),
        {k: tuple(sorted(v)) for k, v in stragglers.items()},
    )


def _labels(pod: K8sObject) -> Mapping[str, str]:
    """``labels_of(pod)``: the pod's own label set when it is all text (as the API server
    sends it; read-only, as every object of a world), else the text entries of it."""
    raw = meta(pod).get("labels")
    if isinstance(raw, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw.items()
    ):
        return raw
    return labels_of(pod)


class _LastPodIndex:
    """The last pod index, with the very tuple of pods it was built from (kept, so its
    identity cannot pass to another tuple). The caches hand out the same tuple until a
    pod changes (``kube.store``) and a tuple cannot change, so a reconcile after a change
    of anything but the pods reuses the index; any other sequence builds it as before.
    The objects of a world are read-only, as everywhere in the core."""

    def __init__(self) -> None:
        self.last: tuple[tuple[K8sObject, ...], str, PodIndex] | None = None

    def __call__(self, pods: Iterable[K8sObject], namespace: str) -> PodIndex:
        last = self.last
        if last is not None and last[0] is pods and last[1] == namespace:
            return last[2]
        index = build_pod_index(pods, namespace)
        # A list or generator may change or be spent: only a tuple is remembered.
        self.last = (pods, namespace, index) if type(pods) is tuple else None
        return index

    def clear(self) -> None:
        self.last = None


pod_index = _LastPodIndex()


_POD_METADATA = ("name", "namespace", "labels", "deletionTimestamp")


def pod_fields(pod: K8sObject) -> K8sObject:
    """The parts of a Pod that planning reads, as they are (wrong types included).

    ``metadata`` name, namespace, labels and deletionTimestamp, ``spec.nodeName`` and the
    ``type`` and ``status`` of each ``status.conditions`` entry: :func:`index_workloads`
    reads nothing else of a pod, so a plan over these is the plan over the whole pods
    (proptests/test_properties.py). ``shared-svc plan`` keeps only these, dropping
    containers, volumes and managedFields (most of a pod's bytes).
    """
    if not isinstance(pod, dict):
        return pod
    out: K8sObject = {k: pod[k] for k in ("apiVersion", "kind") if k in pod}
    for key, keep in (
        ("metadata", _POD_METADATA),
        ("spec", ("nodeName",)),
        ("status", ("conditions",)),
    ):
        if key in pod:
            value = pod[key]
            out[key] = (
                {k: value[k] for k in keep if k in value} if isinstance(value, dict) else value
            )
    status = out.get("status")
    conditions = status.get("conditions") if isinstance(status, dict) else None
    if isinstance(status, dict) and isinstance(conditions, list):
        status["conditions"] = [
            {k: c[k] for k in ("type", "status") if k in c} if isinstance(c, dict) else c
            for c in conditions
        ]
    return out


def serving_node(pod: K8sObject) -> str | None:
    """The node a pod serves an endpoint on: bound, Ready and not terminating (else None).

    The EndpointSlice controller marks a terminating pod's endpoint not ready, so it no
    longer covers its node for a consumer of the Service.
    """
    if meta(pod).get("deletionTimestamp") is not None:
        return None
    node = spec(pod).get("nodeName")
    status = pod.get("status")
    conditions = status.get("conditions") if isinstance(status, dict) else None
    ready = isinstance(conditions, list) and any(
        isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in conditions
    )
    return node if ready and isinstance(node, str) and node else None


def covered_nodes(selector: Mapping[str, str], workloads: Workloads) -> frozenset[str]:
    """Nodes on which the Service selector ``selector`` selects a serving pod.

    A Service without a selector selects no pods (its endpoints are not managed)."""
    if not selector:
        return frozenset()
    return workloads.pods.covered(selector)


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
    stragglers = list(workloads.pods.stragglers.get(app, ()))
    if stragglers:
        failing.append(
            f"{len(stragglers)} pod(s) with {APP_LABEL}={app} lack label {common}=true: "
            f"{_first_few(stragglers)}"
        )
    return GateState(stack=stack, open=not failing, failing=tuple(failing))


@dataclass(frozen=True)
class SelectorChoice:
    name: str
    selector: Selector
    gates: tuple[GateState, ...]
    pending: str | None  # SelectorMigrationPending message, when reported
    held_back: Selector | None = None  # what the rules chose, while the hold keeps ``selector``


def rule_selectors(name: str) -> tuple[Selector, ...]:
    """Every selector the rules can give a stable name: the only ones the hold keeps."""
    component = COMPONENT_OF[name]
    return (
        {COMMON_LABEL[component]: "true"},
        {APP_LABEL: LEGACY_APP[component]},
        {APP_LABEL: DRA_APP[component]},
    )


def choose_selector(
    name: str,
    needs: Needs,
    workloads: Workloads,
    settings: Settings,
    current: Mapping[str, Any] | None = None,
) -> SelectorChoice:
    """The selector of ``name``: the three rules of section 4, then the hold.

    ``current`` is the live selector of the Service when it is ours (or ours to adopt).
    """
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
    messages = []
    if settings.selector_mode == "auto" and len(stacks) == 2 and not all(g.open for g in gates):
        failing = "; ".join(f"{g.stack}: {c}" for g in gates for c in g.failing)
        messages.append(
            f"Service {name} keeps selector {_text(selector)} until the ClusterPolicy and the "
            f"GPUCluster (DRA) stacks both carry {common}=true on all pods; failing: {failing}"
        )
    held_back = None
    # The exporter name does not hold: its consumer is the scraper, which needs every exporter
    # pod on a scrape-"true" Service, and nvidia-dcgm-exporter-dra turns "true" (diff._phase)
    # before the canonical Service narrows away from the DRA pods.
    held = hold(name, selector, current, workloads) if name in HOLDING_NAMES else None
    if held is not None:
        held_back = selector
        selector, message = held
        messages.append(message)
    return SelectorChoice(name, selector, gates, "; ".join(messages) or None, held_back)


def hold(
    name: str, chosen: Selector, current: Mapping[str, Any] | None, workloads: Workloads
) -> tuple[Selector, str] | None:
    """Section 4's hold: keep ``current`` while ``chosen`` would leave a node it covers uncovered.

    Only a selector the rules could have chosen is held (anything else is not ours to keep);
    a move to a selector that covers every node the current one covers goes ahead, and so
    does any move once the current selector covers no node (its pods are gone or not ready).
    Returns the kept selector and the SelectorMigrationPending message, or None to move.
    """
    if current is None or current == chosen:
        return None
    kept = next((s for s in rule_selectors(name) if s == current), None)
    if kept is None:
        return None
    missing = covered_nodes(kept, workloads) - covered_nodes(chosen, workloads)
    if not missing:
        return None
    message = (
        f"Service {name} keeps selector {_text(kept)} until the pods selected by "
        f"{_text(chosen)} are ready on every node it covers; not yet on {len(missing)} "
        f"node(s): {_first_few(sorted(missing))}"
    )
    return dict(kept), message


def selects_dra_pods(choice: SelectorChoice, workloads: Workloads) -> bool:
    """Whether a stable exporter selector covers the DRA stack's pods (for scrape dedup)."""
    component = COMPONENT_OF[choice.name]
    if choice.selector == {APP_LABEL: DRA_APP[component]}:
        return True
    if choice.selector == {COMMON_LABEL[component]: "true"}:
        return gate_open(GPU_CLUSTER, component, workloads).open
    return False


def _first_few(names: list[str]) -> str:
    more = len(names) - _STRAGGLERS_NAMED
    return ", ".join(names[:_STRAGGLERS_NAMED]) + (f" and {more} more" if more > 0 else "")


def _text(selector: Selector) -> str:
    return selector_from_set(selector).text


CANONICAL = EXPORTER
