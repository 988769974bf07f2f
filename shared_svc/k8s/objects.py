"""Safe accessors for Kubernetes objects given as plain dicts (inputs may be partial)."""

from __future__ import annotations

import re
from typing import Any

K8sObject = dict[str, Any]
"""A Kubernetes object as the API server's JSON (camelCase keys), parsed."""


def meta(obj: K8sObject) -> dict[str, Any]:
    value = obj.get("metadata")
    return value if isinstance(value, dict) else {}


def _str_map(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}


def labels_of(obj: K8sObject) -> dict[str, str]:
    return _str_map(meta(obj).get("labels"))


def annotations_of(obj: K8sObject) -> dict[str, str]:
    return _str_map(meta(obj).get("annotations"))


def owner_refs(obj: K8sObject) -> list[dict[str, Any]]:
    refs = meta(obj).get("ownerReferences")
    return [r for r in refs if isinstance(r, dict)] if isinstance(refs, list) else []


def name_of(obj: K8sObject) -> str:
    value = meta(obj).get("name")
    return value if isinstance(value, str) else ""


def spec(obj: K8sObject) -> dict[str, Any]:
    value = obj.get("spec")
    return value if isinstance(value, dict) else {}


def in_namespace(obj: K8sObject, namespace: str) -> bool:
    """A namespaced object of ``namespace`` (a missing namespace is taken as it)."""
    ns = meta(obj).get("namespace")
    return ns is None or ns == namespace


_UPPER_AFTER_UNDERSCORE = re.compile(r"_([a-z0-9])")


def camel_keys(fields: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``fields`` in camelCase, as Kubernetes spells JSON (``freed_at`` ->
    ``freedAt``): ``/status`` and ``shared-svc upgrade status -o json`` both use it."""
    return {_UPPER_AFTER_UNDERSCORE.sub(lambda m: m[1].upper(), k): v for k, v in fields.items()}
