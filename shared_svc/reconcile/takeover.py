"""Adoption takes over the fields the previous owner set on our behalf (sections 3 and 5).

A server-side apply can only release a field it owns alone. After adopting an object that
gpu-operator (an ``Update`` field manager) created, both managers own the values they agree
on (``spec.type: NodePort``, a ``release`` label): when the CR later leaves the setting
out, our apply drops it, yet gpu-operator's entry keeps it, so it stays. ``managedFields``
is writable, so the adoption patch moves the paths we manage from every other entry into
our ``Apply`` entry; anything else stays with its manager. Computed from the live object
alone; the patch that carries it is guarded by uid and resourceVersion.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from shared_svc.k8s import objects
from shared_svc.k8s.managed_fields import FIELD_MANAGER, is_our_apply
from shared_svc.k8s.objects import K8sObject
from shared_svc.reconcile.names import SCRAPE_ANNOTATION

FieldPath = tuple[str, ...]  # keys of a fieldsV1 tree: ("f:spec", "f:type")

_SERVICE_SPEC = ("f:type", "f:internalTrafficPolicy", "f:ports", "f:selector")


def _f(name: str) -> str:
    return f"f:{name}"


def managed_paths(kind: str, labels: Iterable[str], annotations: Iterable[str]) -> list[FieldPath]:
    """The paths shared-svc manages on an object of ``kind``.

    A Service: the labels and annotations we set, the scrape annotation, the owner
    references and the spec fields we set. A ServiceMonitor: every label (the CR's
    ``additionalLabels`` end up there), the owner references and the whole spec.
    """
    owners: FieldPath = ("f:metadata", "f:ownerReferences")
    if kind == "ServiceMonitor":
        return [("f:metadata", "f:labels"), owners, ("f:spec",)]
    keys = {*annotations, SCRAPE_ANNOTATION}
    return [
        *(("f:metadata", "f:labels", _f(k)) for k in sorted(set(labels))),
        *(("f:metadata", "f:annotations", _f(k)) for k in sorted(keys)),
        owners,
        *(("f:spec", f) for f in _SERVICE_SPEC),
    ]


def _pop(tree: dict[str, Any], path: FieldPath) -> Any:
    """Removes ``path`` from ``tree`` (pruning parents left empty); returns it, or None."""
    parents: list[dict[str, Any]] = []
    node: Any = tree
    for key in path[:-1]:
        child = node.get(key)
        if not isinstance(child, dict) or not child:
            return None  # absent, or owned whole above this level: not ours to split
        parents.append(node)
        node = child
    if not isinstance(node.get(path[-1]), dict):
        return None  # absent, or not a set of fields (never from an API server): left alone
    taken = node.pop(path[-1])
    # An empty set under a field would mean "owns the field itself": drop emptied parents.
    for parent, key in zip(reversed(parents), reversed(path[:-1]), strict=True):
        if parent[key]:
            break
        del parent[key]
    return taken


def _union(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Both sets of fields. An empty tree owns the field itself, which is "." beside children."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return copy.deepcopy(b if isinstance(b, dict) else a)  # not a set of fields: kept as is
    if not a or not b:
        rest = a or b
        return {".": {}, **copy.deepcopy(rest)} if rest else {}
    out = dict(a)
    for key, value in b.items():
        out[key] = _union(out[key], value) if key in out else copy.deepcopy(value)
    return out


def take_over(live: K8sObject, paths: Iterable[FieldPath]) -> list[dict[str, Any]] | None:
    """``live``'s managedFields with ``paths`` moved from other entries into our Apply entry.

    None when no other entry owns any of them (nothing to write). Entries of subresources
    and entries that cannot be read are kept as they are; an entry left empty is dropped.
    """
    metadata = live.get("metadata")
    entries = metadata.get("managedFields") if isinstance(metadata, dict) else None
    if not isinstance(entries, list):
        return None
    paths = list(paths)
    moved: dict[str, Any] | None = None
    out: list[Any] = []
    ours: dict[str, Any] | None = None
    for entry in entries:
        if not isinstance(entry, dict):
            out.append(entry)
            continue
        fields = entry.get("fieldsV1")
        if is_our_apply(entry) and ours is None and isinstance(fields, dict):
            ours = copy.deepcopy(entry)
            out.append(ours)
            continue
        if is_our_apply(entry) or entry.get("subresource") or not isinstance(fields, dict):
            out.append(entry)
            continue
        remaining = copy.deepcopy(fields)
        for path in paths:
            taken = _pop(remaining, path)
            if isinstance(taken, dict):
                nested = objects.nested(path, copy.deepcopy(taken))
                moved = nested if moved is None else _union(moved, nested)
        if remaining == fields:
            out.append(entry)
        elif remaining:
            out.append({**entry, "fieldsV1": remaining})
    if moved is None:
        return None
    if ours is None:
        ours = {
            "manager": FIELD_MANAGER,
            "operation": "Apply",
            "apiVersion": str(live.get("apiVersion") or "v1"),
            "fieldsType": "FieldsV1",
            "fieldsV1": {},
        }
        out.append(ours)
    ours["fieldsV1"] = _union(ours.get("fieldsV1") or {}, moved) if ours.get("fieldsV1") else moved
    return out


def take_over_op(live: K8sObject, body: K8sObject) -> dict[str, Any] | None:
    """The JSON patch operation that takes over our paths of ``live`` (None: nothing to take)."""
    meta = body.get("metadata") or {}
    paths = managed_paths(
        str(body.get("kind")), meta.get("labels") or {}, meta.get("annotations") or {}
    )
    new = take_over(live, paths)
    if new is None:
        return None
    return {"op": "replace", "path": "/metadata/managedFields", "value": new}
