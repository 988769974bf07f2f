"""Safe accessors for Kubernetes objects given as plain dicts (inputs may be partial)."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from typing import Any

K8sObject = dict[str, Any]
"""A Kubernetes object as the API server's JSON (camelCase keys), parsed."""


def meta(obj: Mapping[str, Any]) -> dict[str, Any]:
    value = obj.get("metadata")
    return value if isinstance(value, dict) else {}


def _str_map(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}


def labels_of(obj: Mapping[str, Any]) -> dict[str, str]:
    return _str_map(meta(obj).get("labels"))


def annotations_of(obj: Mapping[str, Any]) -> dict[str, str]:
    return _str_map(meta(obj).get("annotations"))


def _map_str(obj: Mapping[str, Any], field: str, key: str) -> str | None:
    values = meta(obj).get(field)
    value = values.get(key) if isinstance(values, dict) else None
    return value if isinstance(value, str) else None


def label(obj: Mapping[str, Any], key: str) -> str | None:
    """``labels_of(obj).get(key)`` without copying the map (a pass over every cached node)."""
    return _map_str(obj, "labels", key)


def annotation(obj: Mapping[str, Any], key: str) -> str | None:
    """``annotations_of(obj).get(key)`` without copying the map."""
    return _map_str(obj, "annotations", key)


def owner_refs(obj: Mapping[str, Any], kind: str | None = None) -> list[dict[str, Any]]:
    """The object's owner references (of ``kind`` only, when given)."""
    refs = meta(obj).get("ownerReferences")
    if not isinstance(refs, list):
        return []
    return [r for r in refs if isinstance(r, dict) and (kind is None or r.get("kind") == kind)]


def _meta_str(obj: Mapping[str, Any], key: str) -> str:
    value = meta(obj).get(key)
    return value if isinstance(value, str) else ""


def name_of(obj: Mapping[str, Any]) -> str:
    return _meta_str(obj, "name")


def namespace_of(obj: Mapping[str, Any]) -> str:
    return _meta_str(obj, "namespace")


def uid_of(obj: Mapping[str, Any]) -> str:
    return _meta_str(obj, "uid")


def resource_version_of(obj: Mapping[str, Any]) -> str:
    return _meta_str(obj, "resourceVersion")


def key_of(obj: Mapping[str, Any]) -> str:
    """``namespace/name``."""
    return f"{namespace_of(obj)}/{name_of(obj)}"


def spec(obj: K8sObject) -> dict[str, Any]:
    value = obj.get("spec")
    return value if isinstance(value, dict) else {}


def in_namespace(obj: K8sObject, namespace: str) -> bool:
    """A namespaced object of ``namespace`` (a missing namespace is taken as it)."""
    ns = meta(obj).get("namespace")
    return ns is None or ns == namespace


_UPPER_AFTER_UNDERSCORE = re.compile(r"_([a-z0-9])")


def dig(obj: Any, *path: str) -> Any:
    """The value at ``path`` in nested mappings; None where a step is missing or not a mapping."""
    for part in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(part)
    return obj


def nested(path: tuple[str, ...] | list[str], value: Any) -> dict[str, Any]:
    """``value`` under ``path`` (``("a", "b"), v`` -> ``{"a": {"b": v}}``): a merge patch
    or an apply body of one field. ``value`` is not copied."""
    tree: Any = value
    for key in reversed(path):
        tree = {key: tree}
    result: dict[str, Any] = tree
    return result


def camel_keys(fields: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``fields`` in camelCase, as Kubernetes spells JSON (``freed_at`` ->
    ``freedAt``): ``/status`` and ``shared-svc upgrade status -o json`` both use it."""
    return {_camel(k): v for k, v in fields.items()}


def as_json(value: Any) -> Any:
    """The one JSON spelling of a report (``/status``, ``shared-svc plan -o json``):
    dataclasses as objects whose field names are camelCased (:func:`camel_keys`), tuples
    as lists; the keys of plain dicts (labels, selectors) are data and stay as they are."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: as_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return camel_keys(fields)
    if isinstance(value, (list, tuple)):
        return [as_json(v) for v in value]
    if isinstance(value, dict):
        return {k: as_json(v) for k, v in value.items()}
    return value


@functools.lru_cache(maxsize=512)
def _camel(key: str) -> str:
    """One field name in camelCase (the names are a program's few: converted once each)."""
    return _UPPER_AFTER_UNDERSCORE.sub(lambda m: m[1].upper(), key)
