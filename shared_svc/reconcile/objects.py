"""Safe accessors for Kubernetes objects given as plain dicts (inputs may be partial)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from shared_svc.reconcile.model import K8sObject


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
    """A namespaced object of the operator namespace (a missing namespace is taken as it)."""
    ns = meta(obj).get("namespace")
    return ns is None or ns == namespace


def stable_digest(value: Any) -> str:
    """First 16 hex digits of sha256 over canonical JSON: the same data, the same digest."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def note(text: str, limit: int = 1024) -> str:
    """Event notes are limited to 1 kB by the API."""
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[: limit - 3].decode(errors="ignore") + "..."
