"""DaemonSet consumers: parked per node by a label, never by patching the DaemonSet.

A DaemonSet declares itself once (``shared-svc upgrade prepare-daemonset``) by requiring
node affinity ``<parked label> DoesNotExist`` in its pod template. The DaemonSet
controller then deletes its pod from a node as soon as the controller labels that node,
and recreates it when the label goes. DaemonSets on gpu-operator's own hook (nodeSelector
``nvidia.com/gpu.deploy.client: "true"``) are parked by the driver-manager; this
controller only verifies and reports them (:func:`client_hook_use`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from shared_svc.k8s import objects
from shared_svc.k8s.objects import K8sObject

DaemonSetKind = Literal["declared", "partial", "operator-hook", "other"]

CLIENT_HOOK_KEY = "nvidia.com/gpu.deploy.client"


def parked_label_key(driver_name: str) -> str:
    """``nvidia.com/gpu-driver-upgrade.parked`` for ``gpu``; the same pattern for others.

    It follows gpu-operator's ``nvidia.com/<driver>-driver-upgrade.skip`` naming, so the
    network operator's driver ``ofed`` gets ``nvidia.com/ofed-driver-upgrade.parked``.
    """
    return f"nvidia.com/{driver_name}-driver-upgrade.parked"


def parked_requirement(parked_key: str) -> dict[str, Any]:
    return {"key": parked_key, "operator": "DoesNotExist"}


def _required_terms(template_spec: Mapping[str, Any]) -> list[Any]:
    required = ((template_spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    return list(required.get("nodeSelectorTerms") or [])


def _term_has(term: Mapping[str, Any], parked_key: str) -> bool:
    return any(
        expr.get("key") == parked_key and expr.get("operator") == "DoesNotExist"
        for expr in term.get("matchExpressions") or ()
    )


def template_spec(daemonset: K8sObject) -> Mapping[str, Any]:
    """The pod template's spec ({} where a part is missing or of another type)."""
    value: Any = daemonset
    for key in ("spec", "template", "spec"):
        value = value.get(key) if isinstance(value, Mapping) else None
    return value if isinstance(value, Mapping) else {}


def classify_daemonset(daemonset: K8sObject, parked_key: str) -> DaemonSetKind:
    """declared: every required term (they are ORed) excludes parked nodes.

    partial: some terms do, so the pod may stay on a parked node (reported, not trusted).
    """
    spec = template_spec(daemonset)
    terms = _required_terms(spec)
    with_key = sum(1 for term in terms if _term_has(term, parked_key))
    if terms and with_key == len(terms):
        return "declared"
    if with_key:
        return "partial"
    if (spec.get("nodeSelector") or {}).get(CLIENT_HOOK_KEY) == "true":
        return "operator-hook"
    return "other"


def with_parked_requirement(daemonset: K8sObject, parked_key: str) -> K8sObject:
    """A copy whose pod template requires the parked label to be absent (idempotent).

    Required terms are ORed, so the expression is added to every term that lacks it; a
    template without required node affinity gets one term holding only the expression.
    """
    result = copy.deepcopy(daemonset)
    spec = result.setdefault("spec", {}).setdefault("template", {}).setdefault("spec", {})
    affinity = spec.get("affinity") or {}
    node_affinity = affinity.get("nodeAffinity") or {}
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    terms = list(required.get("nodeSelectorTerms") or [])
    if not terms:
        terms = [{}]
    new_terms = []
    for term in terms:
        term = dict(term)
        if not _term_has(term, parked_key):
            term["matchExpressions"] = [
                *(term.get("matchExpressions") or []),
                parked_requirement(parked_key),
            ]
        new_terms.append(term)
    required = {**required, "nodeSelectorTerms": new_terms}
    spec["affinity"] = {
        **affinity,
        "nodeAffinity": {
            **node_affinity,
            "requiredDuringSchedulingIgnoredDuringExecution": required,
        },
    }
    return result


def template_labels(daemonset: K8sObject) -> Mapping[str, str]:
    return objects.labels_of(daemonset.get("spec", {}).get("template", {}))


def missing_template_labels(daemonset: K8sObject, labels: Mapping[str, str]) -> dict[str, str]:
    """The consumer labels the pod template does not carry yet (with these values)."""
    have = template_labels(daemonset)
    return {k: v for k, v in labels.items() if have.get(k) != v}


def with_template_labels(daemonset: K8sObject, labels: Mapping[str, str]) -> K8sObject:
    """A copy whose pod template carries ``labels`` (the declared consumer label), so its
    pods match the upgrade flow's gate (``waitForCompletion.podSelector``) and a parked pod
    holds the node until it is gone. Idempotent; other template labels are kept (the
    DaemonSet's selector must keep matching them)."""
    result = copy.deepcopy(daemonset)
    template = result.setdefault("spec", {}).setdefault("template", {})
    meta = objects.meta(template)
    template["metadata"] = {**meta, "labels": {**(meta.get("labels") or {}), **labels}}
    return result


@dataclass(frozen=True)
class DaemonSetRef:
    namespace: str
    name: str
    uid: str
    kind: DaemonSetKind

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def index_daemonsets(daemonsets: Iterable[K8sObject], parked_key: str) -> dict[str, DaemonSetRef]:
    """Consumer-relevant DaemonSets by uid (the key their pods' ownerReferences carry)."""
    index = {}
    for ds in daemonsets:
        kind = classify_daemonset(ds, parked_key)
        if kind == "other":
            continue
        namespace, name = objects.namespace_of(ds), objects.name_of(ds)
        uid = objects.uid_of(ds) or f"{namespace}/{name}"
        index[uid] = DaemonSetRef(namespace, name, uid, kind)
    return index


def owner_key(pod: K8sObject) -> str | None:
    """``namespace/name`` of the DaemonSet that owns the pod (known or not), or None."""
    for ref in objects.owner_refs(pod, "DaemonSet"):
        if ref.get("name"):
            return f"{objects.namespace_of(pod)}/{ref['name']}"
    return None


def owning_daemonset(pod: K8sObject, index: Mapping[str, DaemonSetRef]) -> DaemonSetRef | None:
    for ref in objects.owner_refs(pod, "DaemonSet"):
        if ref.get("uid") in index:
            return index[ref["uid"]]
    return None


# --- gpu-operator's client hook (nvidia.com/gpu.deploy.client) ---

# left-to-operator: nodes carry the label, gpu-operator's driver-manager bounces the
# DaemonSet's pods during the driver restart; never-schedules: no node carries the label
# (gpu-operator before v26.7.0, or GPUCluster mode), so it runs nowhere; both: prepared
# for shared-svc's parked label too.
ClientHookFinding = Literal["left-to-operator", "never-schedules", "both"]


@dataclass(frozen=True)
class ClientHookUse:
    """A DaemonSet that selects nodes by ``nvidia.com/gpu.deploy.client: "true"``."""

    daemonset: str  # namespace/name
    finding: ClientHookFinding
    message: str

    @property
    def warns(self) -> bool:
        return self.finding != "left-to-operator"

    def as_dict(self) -> dict[str, str]:
        return {"daemonSet": self.daemonset, "finding": self.finding, "message": self.message}


def uses_client_hook(daemonset: K8sObject) -> bool:
    """Its pod template's nodeSelector asks for ``nvidia.com/gpu.deploy.client: "true"``
    (what driver-manager looks for; it reads the nodeSelector, not affinity)."""
    selector = template_spec(daemonset).get("nodeSelector")
    return isinstance(selector, Mapping) and selector.get(CLIENT_HOOK_KEY) == "true"


def client_hook_use(
    daemonset: K8sObject, parked_key: str, label_on_nodes: bool
) -> ClientHookUse | None:
    """What the DaemonSet's use of gpu-operator's client hook means, or None if it has none.
    ``label_on_nodes``: some node carries the ``nvidia.com/gpu.deploy.client`` label
    (gpu-operator >= v26.7.0 sets it on GPU nodes in ClusterPolicy mode)."""
    if not uses_client_hook(daemonset):
        return None
    key = objects.key_of(daemonset)
    hook = f'{CLIENT_HOOK_KEY}: "true"'
    if not label_on_nodes:
        return ClientHookUse(
            key,
            "never-schedules",
            f"DaemonSet {key} selects nodes by {hook}, but no node carries {CLIENT_HOOK_KEY} "
            "(gpu-operator before v26.7.0, or GPUCluster mode): it runs nowhere. Remove that "
            f"nodeSelector, then run `shared-svc upgrade prepare-daemonset {key}`.",
        )
    if any(_term_has(term, parked_key) for term in _required_terms(template_spec(daemonset))):
        return ClientHookUse(
            key,
            "both",
            f"DaemonSet {key} is prepared both ways: it requires {parked_key} DoesNotExist "
            f"(shared-svc parks it in the first freeing state) and selects {hook} "
            "(gpu-operator's driver-manager bounces it again in pod-restart-required). Keep "
            "one: remove that nodeSelector, or the parked-label affinity.",
        )
    return ClientHookUse(
        key,
        "left-to-operator",
        f"DaemonSet {key} selects {hook}: gpu-operator's driver-manager moves its pods off a "
        "node during the driver restart and back after (gpu-operator >= v26.7.0, "
        "ClusterPolicy mode); shared-svc leaves it to gpu-operator.",
    )


def client_hook_uses(
    daemonsets: Iterable[K8sObject], parked_key: str, label_on_nodes: bool
) -> tuple[ClientHookUse, ...]:
    """Every DaemonSet on the client hook, by namespace/name."""
    found = (client_hook_use(ds, parked_key, label_on_nodes) for ds in daemonsets)
    return tuple(sorted((u for u in found if u is not None), key=lambda u: u.daemonset))
