"""The shape of each Service (contract section 3) and the intent hash every apply carries."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shared_svc.k8s.objects import K8sObject, spec
from shared_svc.reconcile.conflicts import Resolution, resolve
from shared_svc.reconcile.digest import stable_digest
from shared_svc.reconcile.names import (
    APP_LABEL,
    COMPONENT_OF,
    DCGM_PORT,
    EXPORTER_PORT,
    INTENT_HASH_ANNOTATION,
    MANAGED_BY_LABEL,
    MANAGED_BY_VALUE,
    MONITOR_LABEL,
    SCRAPE_ANNOTATION,
    SERVICE_API,
)
from shared_svc.reconcile.owners import OwnerRef
from shared_svc.reconcile.specs import CRSpec

# What the API server assumes when a Service leaves these unset.
API_DEFAULT_TYPE = "ClusterIP"
API_DEFAULT_TRAFFIC_POLICY = "Cluster"


def managed_labels(name: str) -> dict[str, str]:
    # ``app`` becomes the Prometheus job through ``jobLabel: app``.
    return {APP_LABEL: name, MANAGED_BY_LABEL: MANAGED_BY_VALUE}


def intent_hash(body: K8sObject) -> str:
    """Hash of an apply body without its own hash annotation (the body is not copied:
    only the two maps on the way to the annotation are, when it is there)."""
    metadata = body.get("metadata", {})
    annotations = metadata.get("annotations", {})
    if INTENT_HASH_ANNOTATION in annotations:
        others = {k: v for k, v in annotations.items() if k != INTENT_HASH_ANNOTATION}
        body = {**body, "metadata": {**metadata, "annotations": others}}
    return stable_digest(body)


def with_intent_hash(body: K8sObject) -> K8sObject:
    """Stamp the body: the hash tells a later plan what we set last time."""
    body["metadata"].setdefault("annotations", {})[INTENT_HASH_ANNOTATION] = intent_hash(body)
    return body


def service_body(
    name: str,
    namespace: str,
    selector: dict[str, str],
    owners: list[OwnerRef],
    *,
    scrape: str | None = None,
    monitor: str | None = None,
    service_type: str | None = None,
    traffic_policy: str | None = None,
) -> K8sObject:
    """The apply body of one Service (section 3); ``monitor``: the ServiceMonitor of ours
    that selects it (``MONITOR_LABEL``, section 7)."""
    if COMPONENT_OF[name] == "dcgm":
        # Exporters reach the hostengine on their own node: always ClusterIP + Local.
        port, service_type, traffic_policy = DCGM_PORT, "ClusterIP", "Local"
    else:
        port = EXPORTER_PORT
    body_spec: dict[str, Any] = {"selector": dict(selector), "ports": [dict(port)]}
    if service_type is not None:
        body_spec["type"] = service_type
    if traffic_policy is not None:
        body_spec["internalTrafficPolicy"] = traffic_policy
    annotations = {SCRAPE_ANNOTATION: scrape} if scrape is not None else {}
    labels = managed_labels(name)
    if monitor is not None:
        labels[MONITOR_LABEL] = monitor
    body: K8sObject = {
        "apiVersion": SERVICE_API,
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": labels,
            "annotations": annotations,
            "ownerReferences": owners,
        },
        "spec": body_spec,
    }
    return with_intent_hash(body)


def exporter_settings(
    name: str, needing: Sequence[CRSpec], live: K8sObject | None
) -> tuple[Resolution, Resolution]:
    """``type`` and ``internalTrafficPolicy`` of an exporter Service, from the CRs that need it.

    An InvalidSpec CR's settings are ignored and the live values kept (section 9): it takes
    part with the live value, unless that is only the API default (then leaving it out has
    the same effect and keeps the intent free of fields nobody set).
    """
    live_spec = spec(live) if live is not None else {}
    types: list[tuple[CRSpec, Any]] = []
    policies: list[tuple[CRSpec, Any]] = []
    for cr in needing:
        if cr.valid:
            types.append((cr, cr.service_type))
            policies.append((cr, cr.internal_traffic_policy))
        else:
            types.append((cr, _non_default(live_spec.get("type"), API_DEFAULT_TYPE)))
            policies.append(
                (
                    cr,
                    _non_default(
                        live_spec.get("internalTrafficPolicy"), API_DEFAULT_TRAFFIC_POLICY
                    ),
                )
            )
    obj = f"Service/{name}"
    return resolve(obj, "spec.type", types), resolve(obj, "spec.internalTrafficPolicy", policies)


def _non_default(value: Any, default: str) -> str | None:
    return value if isinstance(value, str) and value != default else None
