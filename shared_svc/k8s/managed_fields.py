"""``metadata.managedFields``: who owns a field (server-side apply's bookkeeping)."""

from __future__ import annotations

import re
from typing import Any

from shared_svc.k8s.objects import K8sObject, meta

FIELD_MANAGER = "shared-svc"
"""The field manager of shared-svc's applies and patches of its Services and ServiceMonitor."""


def managed_fields(obj: K8sObject) -> list[dict[str, Any]]:
    """The entries of ``metadata.managedFields`` that are objects (others are skipped)."""
    entries = meta(obj).get("managedFields")
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


def is_our_apply(entry: dict[str, Any], manager: str = FIELD_MANAGER) -> bool:
    """The entry of ``manager``'s server-side applies."""
    return entry.get("manager") == manager and entry.get("operation") == "Apply"


_PATH_TOKEN = re.compile(r'\[\d+\]|([A-Za-z0-9_-]+)|\["([^"]*)"\]')


def field_segments(dotted: str) -> list[str]:
    """``spec.ports[0].port`` -> ``["spec", "ports", "port"]``; ``["quoted keys"]`` (which may
    contain dots) are one segment. Indexes are dropped: managedFields key list items by
    value, not by position."""
    return [name or key for name, key in _PATH_TOKEN.findall(dotted) if name or key]


def covers(fields: Any, segments: list[str]) -> bool:
    """Does a ``fieldsV1`` tree own the field at ``segments`` (or something under it)?"""
    node: Any = fields
    for i, seg in enumerate(segments):
        if not isinstance(node, dict) or not node:
            return True  # a leaf owned above this level covers everything below
        nxt = node.get(f"f:{seg}")
        if nxt is None:
            # list items keyed by value (k:/v:/i:) sit between named fields: look inside each
            children = [v for k, v in node.items() if k[:2] in ("k:", "v:", "i:")]
            return any(covers(c, segments[i:]) for c in children)
        node = nxt
    return True


def managers_of_field(obj: K8sObject, dotted: str, ours: str = FIELD_MANAGER) -> list[str]:
    """Field managers other than ``ours`` (its Apply entry) that own ``dotted`` (or
    something under it) now, the most recent first."""
    segments = field_segments(dotted)
    found: list[tuple[str, str]] = []
    for entry in managed_fields(obj):
        if is_our_apply(entry, ours):
            continue
        if covers(entry.get("fieldsV1") or {}, segments):
            found.append((entry.get("time") or "", entry.get("manager") or "?"))
    return [m for _, m in sorted(found, reverse=True)]
