"""The canonical scrape target and the one ServiceMonitor (contract sections 3 and 7).

Every exporter pod is scraped exactly once: the canonical Service carries scrape "true",
the ``-dra`` alias "false" while the canonical one covers the DRA pods and "true" while it
does not (a migration with the gate closed), and the ServiceMonitor selects exactly the
Services that carry "true".
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shared_svc.k8s.events import ObjectRef, Report, note
from shared_svc.k8s.objects import K8sObject, labels_of, meta, name_of, spec
from shared_svc.k8s.selectors import SelectorError, label_selector
from shared_svc.reconcile.conflicts import Resolution, cr_event_ref, resolve
from shared_svc.reconcile.model import Pending
from shared_svc.reconcile.names import (
    APP_LABEL,
    EXPORTER_PORT,
    MANAGED_BY_LABEL,
    MANAGED_BY_VALUE,
    RESERVED_LABELS,
    SERVICE_MONITOR,
    SERVICE_MONITOR_API,
)
from shared_svc.reconcile.objects import stable_digest
from shared_svc.reconcile.owners import OwnerRef
from shared_svc.reconcile.shapes import managed_labels, with_intent_hash
from shared_svc.reconcile.specs import CRSpec

# (CR setting, key in endpoints[0]) in the order reports list them.
_ENDPOINT_FIELDS = (
    ("interval", "interval"),
    ("scrape_timeout", "scrapeTimeout"),
    ("honor_labels", "honorLabels"),
    ("relabelings", "relabelings"),
)
OBJECT = f"ServiceMonitor/{SERVICE_MONITOR}"


def scrape_value(name: str, canonical_covers_dra: bool) -> str:
    """``prometheus.io/scrape`` of an exporter Service."""
    if name == SERVICE_MONITOR:
        return "true"
    return "false" if canonical_covers_dra else "true"


@dataclass(frozen=True)
class MonitorSettings:
    endpoint: dict[str, Any]  # extra endpoints[0] fields
    labels: dict[str, str]  # additionalLabels after conflicts, reserved keys dropped
    resolutions: tuple[Resolution, ...]
    reports: tuple[Report, ...]  # ReservedLabelIgnored


def _endpoint0(live: K8sObject | None) -> dict[str, Any]:
    endpoints = spec(live).get("endpoints") if live is not None else None
    first = endpoints[0] if isinstance(endpoints, list) and endpoints else None
    return first if isinstance(first, dict) else {}


def monitor_settings(needing: Sequence[CRSpec], live: K8sObject | None) -> MonitorSettings:
    """ServiceMonitor settings from the CRs that need it; conflicts resolved per field.

    An InvalidSpec CR takes part with the live values (section 9: its settings are ignored
    and the live values kept).
    """
    live_endpoint = _endpoint0(live)
    live_labels = {
        k: v for k, v in (labels_of(live) if live else {}).items() if k not in RESERVED_LABELS
    }
    endpoint: dict[str, Any] = {}
    resolutions: list[Resolution] = []
    reports: list[Report] = []
    for attr, key in _ENDPOINT_FIELDS:
        values: list[tuple[CRSpec, Any]] = []
        for cr in needing:
            if cr.valid:
                value = getattr(cr.monitor, attr)
                values.append((cr, list(value) if isinstance(value, tuple) else value))
            else:
                values.append((cr, live_endpoint.get(key)))
        resolution = resolve(OBJECT, f"spec.endpoints[0].{key}", values)
        resolutions.append(resolution)
        if resolution.value is not None:
            endpoint[key] = resolution.value
    per_key: dict[str, list[tuple[CRSpec, Any]]] = {}
    for cr in needing:
        pairs: Iterable[tuple[str, str]] = (
            cr.monitor.additional_labels if cr.valid else live_labels.items()
        )
        for key, value in pairs:
            if key in RESERVED_LABELS:
                reports.append(_reserved_label_report(cr, key, value))
                continue
            per_key.setdefault(key, []).append((cr, value))
    chosen: dict[str, str] = {}
    for key in sorted(per_key):
        resolution = resolve(OBJECT, f'metadata.labels["{key}"]', per_key[key])
        resolutions.append(resolution)
        chosen[key] = resolution.value
    return MonitorSettings(endpoint, chosen, tuple(resolutions), tuple(reports))


def _reserved_label_report(cr: CRSpec, key: str, value: str) -> Report:
    return Report(
        type="Warning",
        reason="ReservedLabelIgnored",
        action="Reconcile",
        regarding=cr_event_ref(cr),
        note=note(
            f"spec.dcgmExporter.serviceMonitor.additionalLabels[{json.dumps(key)}] is reserved "
            f"and ignored on {OBJECT}"
        ),
        key=f"ReservedLabelIgnored/{cr.label}/{stable_digest([cr.uid, key, value])}",
    )


def service_monitor_body(
    namespace: str, scraped: Sequence[str], settings: MonitorSettings, owners: list[OwnerRef]
) -> K8sObject:
    endpoint = {"port": EXPORTER_PORT["name"], "path": "/metrics", **settings.endpoint}
    body: K8sObject = {
        "apiVersion": SERVICE_MONITOR_API,
        "kind": "ServiceMonitor",
        "metadata": {
            "name": SERVICE_MONITOR,
            "namespace": namespace,
            "labels": {**settings.labels, **managed_labels(SERVICE_MONITOR)},
            "annotations": {},
            "ownerReferences": owners,
        },
        "spec": {
            "jobLabel": APP_LABEL,
            "namespaceSelector": {"matchNames": [namespace]},
            "selector": {
                "matchLabels": {MANAGED_BY_LABEL: MANAGED_BY_VALUE},
                "matchExpressions": [_scraped_expression(scraped)],
            },
            "endpoints": [endpoint],
        },
    }
    return with_intent_hash(body)


def _scraped_expression(scraped: Sequence[str]) -> dict[str, Any]:
    """``app In [...]``; with nothing to scrape, a valid expression that selects nothing.

    ``In`` with no values is an invalid label selector (prometheus-operator rejects the whole
    ServiceMonitor); ``managed-by DoesNotExist`` contradicts the ``matchLabels`` beside it.
    """
    if scraped:
        return {"key": APP_LABEL, "operator": "In", "values": sorted(scraped)}
    return {"key": MANAGED_BY_LABEL, "operator": "DoesNotExist"}


def _watches_namespace(monitor: K8sObject, namespace: str) -> bool:
    """prometheus-operator's reading: ``any``, else ``matchNames``, else its own namespace.

    Neither ``any: true`` nor a non-empty ``matchNames`` (``{}``, ``{any: false}``,
    ``{matchNames: []}``) means the ServiceMonitor's own namespace.
    """
    selector = spec(monitor).get("namespaceSelector")
    if not isinstance(selector, dict):
        selector = {}
    if selector.get("any") is True:
        return True
    names = selector.get("matchNames")
    if isinstance(names, list) and names:
        return namespace in names
    return bool(meta(monitor).get("namespace", namespace) == namespace)


@dataclass(frozen=True)
class ScrapeTarget:
    """An exporter Service as it will be after the plan."""

    name: str
    labels: Mapping[str, str]
    scrape: str | None


def duplicate_scrape_targets(
    monitors: Iterable[K8sObject],
    targets: Sequence[ScrapeTarget],
    ours_selects: frozenset[str],
    namespace: str,
) -> tuple[list[Pending], list[Report]]:
    """Unmanaged ServiceMonitors that would scrape an exporter a second time (section 7)."""
    pending: list[Pending] = []
    reports: list[Report] = []
    for monitor in sorted(monitors, key=name_of):
        if not _watches_namespace(monitor, namespace):
            continue
        try:
            selector = label_selector(spec(monitor).get("selector"))
        except SelectorError:
            continue  # prometheus-operator rejects it: it scrapes nothing
        hits = [t for t in targets if selector.matches(t.labels)]
        doubled = sorted(t.name for t in hits if t.name in ours_selects)
        aliases = sorted(t.name for t in hits if t.scrape == "false")
        if not doubled and not aliases:
            continue
        why = []
        if doubled:
            why.append(f"{', '.join(doubled)} (also selected by {OBJECT})")
        if aliases:
            why.append(f"{', '.join(aliases)} (an alias with prometheus.io/scrape=false)")
        name = name_of(monitor)
        message = f"ServiceMonitor {name} selects Service {'; '.join(why)}: exporter pods are scraped twice"
        pending.append(
            Pending(
                object=f"ServiceMonitor/{name}", reason="DuplicateScrapeTarget", message=message
            )
        )
        reports.append(
            Report(
                type="Warning",
                reason="DuplicateScrapeTarget",
                action="Reconcile",
                regarding=ObjectRef(
                    api_version=SERVICE_MONITOR_API,
                    kind="ServiceMonitor",
                    name=name,
                    namespace=namespace,
                    uid=meta(monitor).get("uid") or None,
                ),
                note=note(message),
                key=f"DuplicateScrapeTarget/{name}/{stable_digest([doubled, aliases])}",
            )
        )
    return pending, reports
