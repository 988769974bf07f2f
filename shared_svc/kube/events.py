"""Events through ``events.k8s.io/v1``, with series instead of duplicates.

An occurrence is identified by ``Report.key``. The Event's name is derived from that
key, so a repeat (even after a restart of the service) finds the same object and bumps
its ``series`` instead of creating another one. The API server rejects an Event about a
cluster-scoped object (a ClusterPolicy, a Node) outside the ``default`` namespace, so
those go there; Events about namespaced objects go to the object's namespace.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import re
from typing import Any

from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from shared_svc.k8s.events import FIELD_LIMIT, Report, note, truncate_bytes
from shared_svc.kube.resources import EVENTS
from shared_svc.kube.writer import raw_request

REPORTING_CONTROLLER = "nvidia.com/shared-svc"
CLUSTER_EVENT_NAMESPACE = "default"

log = logging.getLogger(__name__)


def event_name(report: Report) -> str:
    digest = hashlib.sha256(f"{report.type}/{report.reason}/{report.key}".encode()).hexdigest()[:16]
    base = re.sub(r"[^a-z0-9.-]", "-", report.regarding.name.lower())[:200].strip(".-") or "object"
    return f"{base}.{digest}"


def event_namespace(report: Report) -> str:
    return report.regarding.namespace or CLUSTER_EVENT_NAMESPACE


def _micro_time(now: dt.datetime) -> str:
    return now.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def event_body(report: Report, reporting_instance: str, now: dt.datetime) -> dict[str, Any]:
    return {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": event_name(report), "namespace": event_namespace(report)},
        "eventTime": _micro_time(now),
        "type": report.type,
        "reason": truncate_bytes(report.reason, FIELD_LIMIT, marker=""),
        "action": truncate_bytes(report.action, FIELD_LIMIT, marker=""),
        "note": note(report.note),
        "regarding": report.regarding.as_event_ref(),
        "reportingController": REPORTING_CONTROLLER,
        "reportingInstance": truncate_bytes(reporting_instance, FIELD_LIMIT, marker=""),
    }


class EventRecorder:
    """Emits :class:`Report` s as Events; a repeat of the same key patches the series."""

    def __init__(
        self, api_client: ApiClient, *, reporting_instance: str, dry_run: bool = False
    ) -> None:
        self._api = api_client
        self._instance = reporting_instance
        self._dry_run = dry_run
        self.emitted = 0  # Events created or series bumped (for /status and tests)
        self.failures = 0

    async def emit(self, report: Report) -> bool:
        """True once the Event is written. Never raises: a failure is logged and counted."""
        if self._dry_run:
            log.info(
                "dry-run: would emit event", extra={"reason": report.reason, "note": report.note}
            )
            return True
        now = dt.datetime.now(dt.UTC)
        body = event_body(report, self._instance, now)
        ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
        try:
            try:
                await raw_request(self._api, "POST", EVENTS.collection(ns), body=body)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                # The same occurrence was reported before (perhaps by a previous run): bump its series.
                path = EVENTS.item(name, ns)
                existing = await raw_request(self._api, "GET", path)
                count = int((existing.get("series") or {}).get("count") or 1) + 1
                series = {"series": {"count": count, "lastObservedTime": _micro_time(now)}}
                await raw_request(
                    self._api,
                    "PATCH",
                    path,
                    body=series,
                    content_type="application/merge-patch+json",
                )
            self.emitted += 1
            return True
        except Exception as exc:  # an Event must never break a reconcile
            self.failures += 1
            log.warning("event not written", extra={"reason": report.reason, "error": str(exc)})
            return False
