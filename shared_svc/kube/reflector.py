"""List-then-watch caches of raw objects (JSON dicts, as the core wants them): the reflector.

One :class:`Cache` per resource (client-go's reflector over its store; callers call it
what it is to them, a cache): it lists, then watches from the list's
resourceVersion with bookmarks; a watch the server ends at its timeout is resumed from
the resourceVersion the cache has. It re-lists only when the watch cannot resume: on
``410 Gone`` (or another ERROR event), after a failed request (reconnecting with capped
exponential backoff), and when a watch goes silent (below). A healthy watch is never
re-listed on a timer, as client-go's reflector: the API server guarantees a watch resumed
from a resourceVersion misses nothing, and answers 410 when it cannot. The controllers'
periodic resync reconciles again from the caches; it does not re-list them.
``synced`` is set only after a complete list, and cleared while a re-list is needed, so
a reconcile never runs on partial data.

Three troubles do not clear ``synced``:

- ``429 Too Many Requests`` means "slow down": the cache waits ``Retry-After`` and
  resumes its watch from the resourceVersion it has (nothing is missed).
- Every watch asks the server to end it after ``watch_timeout_seconds`` (60 s). A watch
  that brings nothing (no event, no bookmark, not even that end) for
  ``idle_timeout_seconds`` (default: 15 s more) is dead (a half-open connection, a server
  that stopped delivering): it is closed and the cache re-lists. Bookmarks alone would
  not do: the API server sends the first one only about two minutes into a watch.
- An object nested deeper than :data:`MAX_DEPTH` (an unknown field a CRD preserves) is
  kept with the too-deep subtrees replaced by :data:`PRUNED`, so its known fields still
  count; dropping a ClusterPolicy would read as "deleted".

``on_synced`` is called whenever ``synced`` changes (the registry's
``shared_svc_cache_synced`` gauge). A cache that stops running is no longer synced.

What changed, the one channel: each :class:`EventHandler` (client-go's
``ResourceEventHandler``) is handed ``on_add(new)``, ``on_update(old, new)`` and
``on_delete(old)`` with the kept objects, from watch events and from every list, as
client-go's ``Replace`` hands a list out: an add of each new object, an update of each
one the store held (the same object, resourceVersion unchanged, for one the list brought
again as it was: the replay by which a re-list says "listed again"), a delete of each
one no longer found. A handler added to a synced cache is first handed an add of every
cached object, as client-go's ``AddEventHandler`` does. Filtering the events and mapping
them to work-queue keys is the runtime's (``shared_svc.runtime.source``).

Memory: lists are read in pages of ``page_size`` objects (``limit``/``continue``), and a
``project`` function (a pure one, e.g. ``reconcile.selection.pod_fields``) is applied to
each object as it arrives, from a list page or a watch event, so only the fields the
planners read are kept and the whole object is dropped at once; a resource with a
``decoder`` (``kube.decode``: msgspec) builds only the fields its projection reads from
the page's bytes, the rest skipped, not built, and leaves to ``json.loads`` any text it
could read differently (the same kept objects, the same errors); what repeats across
objects (label sets, conditions, strings) is kept once (:class:`SharedValues`). A ``metadata_only``
resource is asked for as ``PartialObjectMetadata`` (``accept_header``): the server sends
only metadata, kept under the resource's own kind and apiVersion (``Resource.kept``).
A re-list replaces the store and compares only resourceVersions (kept per object aside
the projection), no deep comparison: an object whose resourceVersion is the cached one
keeps its cached (projected) object: it is neither projected again nor copied, so a
re-list of an unchanged world holds one store, not two.

A list that answers 404 means the resource is not served. That is only believed when
the resource's CustomResourceDefinition is really absent (``crd_name``): a freshly
restarted API server can answer 404 for custom resources before it has loaded their
CRDs, and deciding "no ClusterPolicy exists" from that would delete Services. A resource
not served is listed again every :data:`NOT_SERVED_RECHECK_SECONDS` (a CRD installed later).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from shared_svc.k8s.objects import K8sObject
from shared_svc.kube.resources import (
    CUSTOM_RESOURCE_DEFINITIONS,
    JSON,
    METADATA,
    METADATA_LIST,
)
from shared_svc.kube.resources import Resource as Resource
from shared_svc.kube.store import EventHandler as EventHandler
from shared_svc.kube.store import Key, ResourceStore, key_of
from shared_svc.kube.untrusted import has_pruned, loads
from shared_svc.kube.writer import describe_error, raw_request, request, retry_after
from shared_svc.wait.loop import repeat
from shared_svc.wait.ratelimit import ItemExponentialFailureRateLimiter

log = logging.getLogger(__name__)

BACKOFF_BASE_SECONDS = 0.2  # the first reconnect waits 2x this (times jitter)
WATCH = "watch"  # the one key of a cache's backoff
NOT_SERVED_RECHECK_SECONDS = 30.0  # a resource not served is listed again this often


def accept_header(resource: Resource, *, watch: bool) -> str:
    """The ``Accept`` of a cache's list pages and watches: whole objects, or (for a
    ``metadata_only`` resource) ``PartialObjectMetadataList`` pages and watch events whose
    objects are ``PartialObjectMetadata``. No fallback to whole objects: every API server
    since 1.15 serves ``meta.k8s.io/v1``, and a 406 is a clear error where a silent
    fallback would bring back what the cache is meant not to hold."""
    if not resource.metadata_only:
        return JSON
    return METADATA if watch else METADATA_LIST


class NotServedYet(Exception):
    """404 on a custom resource whose CRD still exists: the server is warming up."""


@dataclass
class Listed:
    """A complete list: the kept objects, their resourceVersions, the list's
    resourceVersion and the objects kept with a too-deep subtree cut."""

    items: dict[Key, K8sObject]
    versions: dict[Key, str]
    resource_version: str
    pruned: set[Key]


async def crd_absent(api: ApiClient, crd_name: str | None) -> bool:
    """Whether the CustomResourceDefinition is really absent (no CRD name: a built-in)."""
    if not crd_name:
        return True
    try:  # its metadata is all this reads (the one HTTP path: ``writer.raw_request``)
        await raw_request(api, "GET", CUSTOM_RESOURCE_DEFINITIONS.item(crd_name), accept=METADATA)
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise
    return False


async def list_pages(
    get: Callable[..., Awaitable[Any]],
    resource: Resource,
    api: ApiClient,
    *,
    page_size: int,
    idle_timeout: float,
    cached: tuple[dict[Key, K8sObject], dict[Key, str]],
    keep: Callable[[K8sObject], K8sObject],
) -> Listed | None:
    """Every page of the list (``get(params, timeout=...)``), each object kept (``keep``)
    as its page is read (None: the resource is not served). An object whose resourceVersion
    is the ``cached`` one keeps its cached object."""
    listed = Listed({}, {}, "", set())
    token = ""
    while True:
        params = {"limit": str(page_size)} if page_size else {}
        if token:
            params["continue"] = token
        try:
            # A list answers at once; silence means a dead (pooled) connection.
            resp = await get(
                params, timeout=aiohttp.ClientTimeout(total=60, sock_read=idle_timeout)
            )
        except ApiException as exc:
            if exc.status == 404 and not token:
                if await crd_absent(api, resource.crd_name):
                    return None
                raise NotServedYet(f"{resource.describe()} answers 404 but its CRD exists") from exc
            raise
        try:
            raw = await resp.read()
        finally:
            resp.release()
        token = read_page(raw, resource, listed, cached, keep)
        del raw
        if not token:
            return listed


def read_page(
    raw: bytes,
    resource: Resource,
    listed: Listed,
    cached: tuple[dict[Key, K8sObject], dict[Key, str]],
    keep: Callable[[K8sObject], K8sObject],
) -> str:
    """One list page's objects added to ``listed``, each kept (``keep``) but those whose
    resourceVersion is the ``cached`` one (their cached object is); the continue token.
    Of each object only the fields ``resource.decoder`` reads are decoded, when it has
    one (``untrusted.loads``: the same value or the same error)."""
    cached_items, cached_versions = cached
    fast = resource.decoder.page if resource.decoder else None
    data, pruned = loads(raw, envelope=2, fast=fast)
    meta = data.get("metadata") or {}
    listed.resource_version = meta.get("resourceVersion", "") or listed.resource_version
    for item in data.get("items") or []:
        key = key_of(item)
        if pruned and has_pruned(resource.kept(item)):  # what is kept lost a subtree
            listed.pruned.add(key)
        version = item.get("metadata", {}).get("resourceVersion", "")
        listed.versions[key] = version
        # Unchanged since cached (same resourceVersion): keep the cached object,
        # so an unchanged world is held once, not twice, and not projected again.
        cached_item = cached_items.get(key) if version else None
        if cached_item is not None and cached_versions.get(key) == version:
            listed.items[key] = cached_item
            continue
        listed.items[key] = keep(item)
    token: str = meta.get("continue") or ""
    return token


def watch_event(
    line: bytes, resource: Resource | None = None
) -> tuple[str | None, K8sObject, bool]:
    """One line of a watch stream: its type, its object and whether a subtree was cut
    (the caller asks whether the cut was in what it keeps: ``has_pruned``).
    An ERROR event raises as the :class:`ApiException` it stands for, except ``410 Gone``
    (the watch cannot resume: re-list), returned as type ``ERROR``."""
    decoder = resource.decoder if resource is not None else None
    event, pruned = loads(line, envelope=1, fast=decoder.event if decoder else None)
    etype, obj = event.get("type"), event.get("object") or {}
    if etype == "ERROR" and obj.get("code") != 410:
        exc = ApiException(status=obj.get("code", 500), reason=obj.get("reason") or "watch error")
        exc.body = json.dumps(obj).encode()
        raise exc
    return etype, obj, pruned


class Cache(ResourceStore):
    """A list-then-watch cache of one resource (client-go's reflector over its store: the
    store keeps what a list or a watch event brings, the cache lists and watches)."""

    def __init__(
        self,
        api: ApiClient,
        resource: Resource,
        *,
        watch_timeout_seconds: int = 60,
        backoff_max_seconds: float = 30.0,
        idle_timeout_seconds: float | None = None,
        on_synced: Callable[[bool], None] | None = None,
        page_size: int = 100,
    ) -> None:
        self._api = api
        self._page_size = page_size
        self._watch_timeout = watch_timeout_seconds
        # The server ends each watch at its timeout: silence beyond that means a dead stream.
        self._idle_timeout = (
            idle_timeout_seconds if idle_timeout_seconds is not None else watch_timeout_seconds + 15
        )
        self.idle_watches = 0  # watches closed for silence (no event, no bookmark)
        self.throttled = 0  # 429 answers: waited for, cache kept
        self.last_error: str | None = None
        self._need_list = True  # the next round lists first
        self._pause = 0.0  # the wait before the next round
        # Reconnects: 0.4 s, 0.8 s, ... up to backoff_max_seconds, with jitter (the runtime's limiter).
        self._backoff = ItemExponentialFailureRateLimiter(
            BACKOFF_BASE_SECONDS, backoff_max_seconds, max_exponent=10, jitter=0.5
        )
        super().__init__(resource, on_synced)

    def _query(self, params: dict[str, str]) -> list[Key]:
        query = list(params.items())
        if self.resource.label_selector:
            query.append(("labelSelector", self.resource.label_selector))
        if self.resource.field_selector:
            query.append(("fieldSelector", self.resource.field_selector))
        return query

    async def _get(self, params: dict[str, str], *, timeout: float | aiohttp.ClientTimeout) -> Any:
        """The response, unread (``writer.request``, the one HTTP path)."""
        return await request(
            self._api,
            "GET",
            self.resource.path,
            query=self._query(params),
            accept=accept_header(self.resource, watch=params.get("watch") == "true"),
            timeout=timeout,
        )

    async def _open_watch(self, params: dict[str, str], *, timeout: float) -> Any:
        """The watch stream, unread. Besides the total ``timeout``, a stream that sends
        nothing for ``idle_timeout_seconds`` is cut: the server ends every watch after
        ``watch_timeout_seconds``, so such a stream is dead."""
        return await self._get(
            params,
            timeout=aiohttp.ClientTimeout(
                total=timeout, sock_connect=30, sock_read=self._idle_timeout
            ),
        )

    async def relist(self) -> None:
        """A complete list replaces the cache; raises on failure (the cache keeps its contents).

        Read in pages; a continue token that expired (410) starts the list over once."""
        for attempt in (1, 2):
            try:
                listed = await list_pages(
                    self._get,
                    self.resource,
                    self._api,
                    page_size=self._page_size,
                    idle_timeout=self._idle_timeout,
                    cached=(self._items, self._versions),
                    keep=self._keep,
                )
            except ApiException as exc:
                if exc.status == 410 and attempt == 1:
                    continue
                raise
            if listed is None:  # not served
                self.replace({}, {}, served=False, resource_version="")
                return
            self.replace(
                listed.items,
                listed.versions,
                served=True,
                resource_version=listed.resource_version,
            )
            self._note_pruned(listed.pruned)
            return

    async def watch_once(self) -> str:
        """Watches until the stream ends. Returns 'timeout' (the server ended it), 'gone'
        (410: re-list) or 'idle' (nothing, not even a bookmark, for too long: re-list)."""
        if not self.served:
            return "timeout"
        resp = await self._open_watch(
            {
                "watch": "true",
                "resourceVersion": self.resource_version,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": str(self._watch_timeout),
            },
            timeout=self._watch_timeout + 30,
        )
        self._backoff.forget(WATCH)
        self.last_error = None
        async with resp:
            while True:
                try:
                    line = await resp.content.readline()
                except (TimeoutError, aiohttp.ServerTimeoutError):
                    return "idle"
                if not line:
                    return "timeout"
                etype, obj, pruned = watch_event(line, self.resource)
                if etype == "ERROR":  # 410 Gone (any other ERROR raised)
                    return "gone"
                rv = obj.get("metadata", {}).get("resourceVersion")
                if rv:
                    self.resource_version = rv
                if etype == "BOOKMARK" or etype is None:
                    continue
                self.apply(etype, obj, pruned=pruned)

    async def run(self, stop: asyncio.Event) -> None:
        """Runs until ``stop`` is set. Never raises for API trouble: it backs off and retries.

        Lists once, then watches; re-lists only when the watch cannot resume (see the
        module docstring), never on a timer. One :meth:`_round` after another on the one
        loop helper (``wait.loop.repeat``), each followed by the pause it asks for. Once
        stopped it is not synced: nothing keeps it current (a cache run again lists
        before a reader may trust it)."""
        self._need_list = True
        self._pause = 0.0
        try:
            await repeat(
                stop,
                lambda: self._round(stop),
                lambda: self._pause,
                name=f"cache {self.resource.describe()}",
            )
        finally:
            self._set_synced(False)

    async def _round(self, stop: asyncio.Event) -> None:
        """A list if one is needed, then one watch until it ends (or ``stop``); sets
        ``_pause``, the wait before the next round."""
        self._pause = 0.0
        try:
            if self._need_list:
                await self.relist()
                self._need_list = False
                self._backoff.forget(WATCH)
                self.last_error = None
            watch = asyncio.ensure_future(self.watch_once())
            stopper = asyncio.ensure_future(stop.wait())
            done, _ = await asyncio.wait({watch, stopper}, return_when=asyncio.FIRST_COMPLETED)
            for task in (watch, stopper):
                if task not in done:
                    task.cancel()
            if watch in done:
                outcome = watch.result()
                if outcome == "gone":
                    self._need_list = True
                elif outcome == "idle":
                    # A silent stream is a dead one (a half-open connection, a server
                    # that stopped delivering): the cache may be behind. Re-list.
                    self.idle_watches += 1
                    log.warning(
                        "watch silent for too long; re-listing",
                        extra={
                            "resource": self.resource.describe(),
                            "idle_seconds": self._idle_timeout,
                        },
                    )
                    self._need_list = True
                elif not self.served:
                    # Not served: look again soon (a CRD installed later).
                    self._pause = NOT_SERVED_RECHECK_SECONDS
                    self._need_list = True
        except asyncio.CancelledError:
            raise
        except ApiException as exc:
            if exc.status != 429:
                self._failed(exc)
                return
            # "Slow down", not "the cache is wrong": no event was missed (the watch
            # resumes from our resourceVersion), so keep the cache, synced, and wait.
            self.throttled += 1
            delay = retry_after(exc) * (1 + random.random() / 4)
            if self.last_error is None or not self.last_error.startswith("429"):
                log.info(
                    "API server asks to slow down; cache kept",
                    extra={"resource": self.resource.describe(), "retry_in": round(delay, 2)},
                )
            self.last_error = describe_error(exc)
            self._pause = delay
        except Exception as exc:
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        """A failed list or watch: re-list after the backoff (``_pause``)."""
        self.last_error = describe_error(exc)
        delay = self._backoff.when(WATCH)
        log.warning(
            "watch failed; will re-list",
            extra={
                "resource": self.resource.describe(),
                "error": self.last_error,
                "retry_in": round(delay, 2),
            },
        )
        # Events may have been missed: no reconcile until a complete re-list.
        self._set_synced(False)
        self._need_list = True
        self._pause = delay
