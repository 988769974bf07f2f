"""The canonical scrape target and shared-svc's ServiceMonitors (contract sections 3 and 7).

Every exporter pod is scraped exactly once: the canonical Service carries scrape "true",
the ``-dra`` alias "false" while the canonical one covers the DRA pods and "true" while it
does not (a migration with the gate closed).

Amended section 7: every exporter Service with scrape "true" is selected by exactly one of
shared-svc's ServiceMonitors (``nvidia-dcgm-exporter``, and the GPUCluster's own
``nvidia-dcgm-exporter-dra`` once adopted), one with "false" by none, at every step. Each
ServiceMonitor selects, by a fixed selector, the managed Services whose label
``MONITOR_LABEL`` names it; the Service carries that label exactly while its scrape
annotation is "true". So a Service's scrape flip and its selection are one write (the same
object), a Service moves from one ServiceMonitor to the other in one write, and no
ServiceMonitor ever changes because a scrape decision did. ``jobLabel: app`` on both: the
Prometheus ``job`` stays the Service's ``app`` label whichever ServiceMonitor scrapes it.

A ServiceMonitor of ours that no CR needs any more first loses its targets: it is made to
select nothing (:func:`drained_selector`, the time in ``DRAINED_ANNOTATION``), so
prometheus-operator keeps its scrape job with no target and Prometheus ends every series of
its targets with a staleness marker; it is deleted once it has selected nothing for two of
its scrape intervals (:func:`scrape_interval`) and the time Prometheus' discovery takes
(``diff.DISCOVERY_SECONDS``). Deleted at once, its job would be dropped, and Prometheus
stops a dropped job without staleness markers (those of targets it dropped a moment
before included): its series would stay in every instant query for the lookback (5
minutes) after the pods are gone. The drain also removes our CR references, so the garbage
collector does not take it with its last CR before then.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shared_svc.k8s.events import ObjectRef, Report, note
from shared_svc.k8s.objects import K8sObject, labels_of, meta, name_of, spec
from shared_svc.k8s.selectors import SelectorError, label_selector
from shared_svc.reconcile.conflicts import Resolution, cr_event_ref, resolve
from shared_svc.reconcile.digest import stable_digest
from shared_svc.reconcile.model import Pending
from shared_svc.reconcile.names import (
    APP_LABEL,
    DRAINED_ANNOTATION,
    EXPORTER_PORT,
    MANAGED_BY_LABEL,
    MANAGED_BY_VALUE,
    MONITOR_LABEL,
    RESERVED_LABELS,
    SERVICE_MONITOR,
    SERVICE_MONITOR_API,
    SERVICE_MONITOR_DRA,
)
from shared_svc.reconcile.owners import OwnerRef
from shared_svc.reconcile.shapes import managed_labels, with_intent_hash
from shared_svc.reconcile.specs import CRSpec, duration_seconds

# (CR setting, key in endpoints[0]) in the order reports list them.
_ENDPOINT_FIELDS = (
    ("interval", "interval"),
    ("scrape_timeout", "scrapeTimeout"),
    ("honor_labels", "honorLabels"),
    ("relabelings", "relabelings"),
)


def object_name(name: str) -> str:
    return f"ServiceMonitor/{name}"


def scrape_value(name: str, canonical_covers_dra: bool) -> str:
    """``prometheus.io/scrape`` of an exporter Service."""
    if name == SERVICE_MONITOR:
        return "true"
    return "false" if canonical_covers_dra else "true"


def monitor_of(name: str, scrape: str | None, kept: frozenset[str]) -> str | None:
    """``MONITOR_LABEL`` of exporter Service ``name``: which of our ServiceMonitors selects it.

    None while its scrape is not "true" (selected by none), or when no ServiceMonitor of
    ours is to select it. ``kept``: the ServiceMonitors a CR needs and shared-svc will keep
    (whether the API is served yet or not: once it is, each created ServiceMonitor selects
    its Services at once). The alias goes to the GPUCluster's own ServiceMonitor while that
    one is kept (its settings are the GPUCluster's), else to the canonical one.
    """
    if scrape != "true":
        return None
    if name == SERVICE_MONITOR_DRA and SERVICE_MONITOR_DRA in kept:
        return SERVICE_MONITOR_DRA
    return SERVICE_MONITOR if SERVICE_MONITOR in kept else None


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


def monitor_settings(
    name: str, needing: Sequence[CRSpec], live: K8sObject | None
) -> MonitorSettings:
    """Settings of ServiceMonitor ``name`` from the CRs that need it (only those: the
    ``-dra`` one's come from the GPUCluster alone); conflicts resolved per field.

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
        resolution = resolve(object_name(name), f"spec.endpoints[0].{key}", values)
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
                reports.append(_reserved_label_report(name, cr, key, value))
                continue
            per_key.setdefault(key, []).append((cr, value))
    chosen: dict[str, str] = {}
    for key in sorted(per_key):
        resolution = resolve(object_name(name), f'metadata.labels["{key}"]', per_key[key])
        resolutions.append(resolution)
        chosen[key] = resolution.value
    return MonitorSettings(endpoint, chosen, tuple(resolutions), tuple(reports))


def _reserved_label_report(name: str, cr: CRSpec, key: str, value: str) -> Report:
    return Report(
        type="Warning",
        reason="ReservedLabelIgnored",
        action="Reconcile",
        regarding=cr_event_ref(cr),
        note=note(
            f"spec.dcgmExporter.serviceMonitor.additionalLabels[{json.dumps(key)}] is reserved "
            f"and ignored on {object_name(name)}"
        ),
        key=f"ReservedLabelIgnored/{cr.label}/{stable_digest([cr.uid, name, key, value])}",
    )


def drained_selector(name: str) -> dict[str, Any]:
    """What a ServiceMonitor of ours going away selects: nothing (no Service carries this
    value of ``MONITOR_LABEL``)."""
    return {"matchLabels": {MANAGED_BY_LABEL: MANAGED_BY_VALUE, MONITOR_LABEL: f"{name}.drained"}}


def scrape_interval(monitor: K8sObject, default: float) -> float:
    """The longest scrape interval of ``monitor``'s endpoints (``default``, the Prometheus'
    own, for one that sets none or an unreadable one)."""
    endpoints = spec(monitor).get("endpoints")
    found = [
        duration_seconds(e.get("interval")) or default
        for e in (endpoints if isinstance(endpoints, list) else [])
        if isinstance(e, dict)
    ]
    return max(found, default=default)


def drained_since(monitor: K8sObject, name: str) -> float | None:
    """When ``monitor`` was made to select nothing (Unix time), or None: it selects
    something, or does not say when."""
    if spec(monitor).get("selector") != drained_selector(name):
        return None
    stamp = (meta(monitor).get("annotations") or {}).get(DRAINED_ANNOTATION)
    try:
        when = dt.datetime.fromisoformat(str(stamp))
    except ValueError:
        return None
    return when.timestamp() if when.tzinfo is not None else None


def drain_stamp(now: float) -> str:
    return dt.datetime.fromtimestamp(now, dt.UTC).isoformat(timespec="milliseconds")


def monitor_selector(name: str) -> dict[str, Any]:
    """The fixed selector of our ServiceMonitor ``name``: the managed Services naming it."""
    return {"matchLabels": {MANAGED_BY_LABEL: MANAGED_BY_VALUE, MONITOR_LABEL: name}}


def service_monitor_body(
    name: str, namespace: str, settings: MonitorSettings, owners: list[OwnerRef]
) -> K8sObject:
    endpoint = {"port": EXPORTER_PORT["name"], "path": "/metrics", **settings.endpoint}
    body: K8sObject = {
        "apiVersion": SERVICE_MONITOR_API,
        "kind": "ServiceMonitor",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {**settings.labels, **managed_labels(name)},
            "annotations": {},
            "ownerReferences": owners,
        },
        "spec": {
            "jobLabel": APP_LABEL,
            "namespaceSelector": {"matchNames": [namespace]},
            "selector": monitor_selector(name),
            "endpoints": [endpoint],
        },
    }
    return with_intent_hash(body)


def watches_namespace(monitor: K8sObject, namespace: str) -> bool:
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


def selects(monitor: K8sObject, labels: Mapping[str, str], namespace: str) -> bool:
    """Whether prometheus-operator has ``monitor`` select a Service with ``labels`` in
    ``namespace`` (its namespaceSelector, then its label selector; an invalid selector
    selects nothing: prometheus-operator rejects the ServiceMonitor)."""
    if not watches_namespace(monitor, namespace):
        return False
    try:
        return label_selector(spec(monitor).get("selector")).matches(labels)
    except SelectorError:
        return False


def duplicate_scrape_targets(
    monitors: Iterable[K8sObject],
    targets: Sequence[ScrapeTarget],
    ours_selects: Mapping[str, str],
    namespace: str,
) -> tuple[list[Pending], list[Report]]:
    """Unmanaged ServiceMonitors that would scrape an exporter a second time (section 7).

    ``ours_selects``: exporter Service -> the ServiceMonitor of ours that selects it."""
    pending: list[Pending] = []
    reports: list[Report] = []
    for monitor in sorted(monitors, key=name_of):
        hits = [t for t in targets if selects(monitor, t.labels, namespace)]
        doubled = sorted(t.name for t in hits if t.name in ours_selects)
        aliases = sorted(t.name for t in hits if t.scrape == "false")
        if not doubled and not aliases:
            continue
        why = []
        for target in doubled:
            why.append(f"{target} (also selected by {object_name(ours_selects[target])})")
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
