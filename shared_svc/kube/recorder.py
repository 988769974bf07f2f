"""Events through ``events.k8s.io/v1``, with series instead of duplicates, and the one publisher.

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
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from shared_svc.k8s.events import FIELD_LIMIT, Report, note, still_sent, truncate_bytes, unsent
from shared_svc.kube.resources import EVENTS
from shared_svc.kube.writer import raw_request

REPORTING_CONTROLLER = "nvidia.com/shared-svc"
CLUSTER_EVENT_NAMESPACE = "default"

log = logging.getLogger("shared_svc.kube.events")  # the name its log lines have always had


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


SERIES_KEPT = 4096  # Events whose series count the recorder remembers (oldest forgotten)


class EventRecorder:
    """Writes :class:`Report` s as Events; a repeat of the same key bumps the series.

    The recorder remembers the series count of the Events it wrote (as client-go's event
    recorder does), so a repeat of a known Event is one PATCH of its series; one the API
    no longer has (404: deleted, or expired after the API server's event TTL) is created
    again. A repeat of an Event a previous run wrote is found by its name: the POST is
    answered 409, then the series is read and bumped.
    """

    def __init__(self, api_client: ApiClient, *, reporting_instance: str) -> None:
        """Dry-run is the publisher's (:class:`EventPublisher`): a recorder writes."""
        self._api = api_client
        self._instance = reporting_instance
        self._series: OrderedDict[tuple[str, str], int] = OrderedDict()  # (ns, name) -> count
        self.emitted = 0  # Events created or series bumped (for /status and tests)
        self.failures = 0
        self.requests: Counter[str] = Counter()  # write requests by verb (POST, PATCH)

    async def emit(self, report: Report) -> bool:
        """True once the Event is written. Never raises: a failure is logged and counted."""
        now = dt.datetime.now(dt.UTC)
        body = event_body(report, self._instance, now)
        ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
        try:
            count = self._series.get((ns, name))
            if count is None or not await self._bump(ns, name, count + 1, now):
                await self._create(body, now)
            self.emitted += 1
            return True
        except Exception as exc:  # an Event must never break a reconcile
            self.failures += 1
            log.warning("event not written", extra={"reason": report.reason, "error": str(exc)})
            return False

    def _remember(self, ns: str, name: str, count: int) -> None:
        self._series[(ns, name)] = count
        self._series.move_to_end((ns, name))
        while len(self._series) > SERIES_KEPT:
            self._series.popitem(last=False)

    async def _bump(self, ns: str, name: str, count: int, now: dt.datetime) -> bool:
        """PATCHes the series of a known Event to ``count``; False when it is gone (404)."""
        series = {"series": {"count": count, "lastObservedTime": _micro_time(now)}}
        self.requests["PATCH"] += 1
        try:
            await raw_request(
                self._api,
                "PATCH",
                EVENTS.item(name, ns),
                body=series,
                content_type="application/merge-patch+json",
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            self._series.pop((ns, name), None)
            return False
        self._remember(ns, name, count)
        return True

    async def _create(self, body: dict[str, Any], now: dt.datetime) -> None:
        ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
        self.requests["POST"] += 1
        try:
            await raw_request(self._api, "POST", EVENTS.collection(ns), body=body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            # Reported before by another run (or replica): read its series, then bump it.
            existing = await raw_request(self._api, "GET", EVENTS.item(name, ns))
            count = int((existing.get("series") or {}).get("count") or 1) + 1
            if not await self._bump(ns, name, count, now):
                raise
            return
        self._remember(ns, name, 1)


class Emitter(Protocol):
    async def emit(self, report: Report) -> bool: ...


class EventPublisher:
    """The one way both controllers and the guard monitor send Events.

    - :meth:`emit` sends a report every time it is called (a report that rides a write,
      or one its core already deduplicates through a record).
    - :meth:`level` takes every report of a ``scope`` that is true now: each is sent once
      while it stays true; one whose Event could not be written is sent again next time;
      one no longer true is forgotten, so it is sent again (its series grows) when it
      comes back (``k8s.events.unsent`` / ``still_sent``). An episode is a scope whose
      report is there until the condition clears (``level(scope, ())``).
    - :meth:`once` sends a report once per key in its scope, for the life of the process.

    Dry-run (one meaning for both controllers): nothing is written; each Event that would
    be sent is logged at INFO ("dry-run: would emit event") and counts as sent for the
    dedup, so it is logged once. ``on_written`` counts each Event written (the
    ``shared_svc_events_total`` metric, for every sender).
    """

    def __init__(
        self,
        recorder: Emitter,
        *,
        dry_run: bool = False,
        on_written: Callable[[Report], None] | None = None,
    ) -> None:
        self._recorder = recorder
        self._dry_run = dry_run
        self._on_written = on_written
        self._sent: dict[str, frozenset[str]] = {}  # scope -> keys sent

    async def emit(self, report: Report) -> bool:
        if self._dry_run:
            log.info(
                "dry-run: would emit event", extra={"reason": report.reason, "note": report.note}
            )
            return True
        written = await self._recorder.emit(report)
        if written and self._on_written is not None:
            self._on_written(report)
        return written

    async def level(self, scope: str, reports: Iterable[Report]) -> frozenset[str]:
        """Sends the reports of ``scope`` true now that are not sent yet; returns the keys
        sent (the scope's new state)."""
        now = tuple(reports)
        sent = self._sent.get(scope, frozenset())
        written = {r.key for r in unsent(sent, now) if await self.emit(r)}
        self._sent[scope] = still_sent(sent, now, written)
        return self._sent[scope]

    async def once(self, scope: str, report: Report) -> bool:
        """Sends ``report`` unless its key was sent in ``scope`` before; True if it is sent."""
        sent = self._sent.get(scope, frozenset())
        if report.key in sent:
            return True
        if not await self.emit(report):
            return False
        self._sent[scope] = sent | {report.key}
        return True

    def sent(self, scope: str) -> frozenset[str]:
        return self._sent.get(scope, frozenset())


def publisher_of(
    recorder: EventPublisher | Emitter,
    *,
    dry_run: bool,
    on_written: Callable[[Report], None] | None = None,
) -> EventPublisher:
    """The one Event publisher (the service's, shared by both controllers and the guard
    monitor), or a bare recorder wrapped in one of its own that keeps the meaning of
    dry-run (a controller made by a test)."""
    if isinstance(recorder, EventPublisher):
        return recorder
    return EventPublisher(recorder, dry_run=dry_run, on_written=on_written)
