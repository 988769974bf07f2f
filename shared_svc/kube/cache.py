"""List-then-watch caches of raw objects (JSON dicts, as the core wants them).

One :class:`Informer` per resource: it lists, then watches from the list's
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

``on_synced`` is called whenever ``synced`` changes (the ``shared_svc_cache_synced``
gauge).

What changed: each :class:`EventHandler` (client-go's ``ResourceEventHandler``) is
handed ``on_add(new)``, ``on_update(old, new)`` and ``on_delete(old)`` with the kept
objects, from watch events and from a re-list (the difference of the two stores, decided
on resourceVersions); a handler added to a synced cache is first handed an add of every
cached object, as client-go's ``AddEventHandler`` does. ``on_change`` listeners are told
once per watch event or re-list that changed anything (level-triggered readers that
re-read the whole cache). Filtering the events and mapping them to work-queue keys is
the runtime's (``shared_svc.runtime.source``).

Memory: lists are read in pages of ``page_size`` objects (``limit``/``continue``), and a
``project`` function (a pure one, e.g. ``reconcile.selectors.pod_fields``) is applied to
each object as it arrives, from a list page or a watch event, so only the fields the
planners read are kept and the whole object is dropped at once; what repeats across
objects (label sets, conditions, strings) is kept once (:class:`SharedValues`). A ``metadata_only``
resource is asked for as ``PartialObjectMetadata`` (``accept_header``): the server sends
only metadata, kept under the resource's own kind and apiVersion (``Resource.kept``).
A re-list replaces the store and compares only resourceVersions (kept per object aside
the projection) to decide whether anything changed: one ``on_change`` at most, no deep
comparison. An object whose resourceVersion is the cached one keeps its cached
(projected) object: it is neither projected again nor copied, so a re-list of an
unchanged world holds one store, not two.

A list that answers 404 means the resource is not served. That is only believed when
the resource's CustomResourceDefinition is really absent (``crd_name``): a freshly
restarted API server can answer 404 for custom resources before it has loaded their
CRDs, and deciding "no ClusterPolicy exists" from that would delete Services. A resource
not served is listed again every :data:`NOT_SERVED_RECHECK_SECONDS` (a CRD installed later).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import re
import sys
from collections.abc import Awaitable, Callable
from itertools import accumulate
from typing import Any, Protocol

import aiohttp
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from shared_svc.aio import sleep_or_stop
from shared_svc.k8s.objects import K8sObject
from shared_svc.kube.resources import JSON, METADATA, METADATA_LIST
from shared_svc.kube.resources import Resource as Resource
from shared_svc.kube.writer import body_text, status_of
from shared_svc.runtime.ratelimit import ItemExponentialFailureRateLimiter

log = logging.getLogger(__name__)

BACKOFF_BASE_SECONDS = 0.2  # the first reconnect waits 2x this (times jitter)
WATCH = "watch"  # the one key of a cache's backoff
NOT_SERVED_RECHECK_SECONDS = 30.0  # a resource not served is listed again this often

# --- robust JSON: fields nobody here judges must not stop the cache ---

MAX_DEPTH = 100
"""Nesting levels kept in one object; a deeper subtree is replaced by :data:`PRUNED`.

Kubernetes objects nest about 15 levels deep; CRDs with preserved unknown fields accept
any depth. Python's parser and every recursive function after it (copies, comparisons,
digests) fail near 1,000, so a hostile 1,200-level field would otherwise stop the cache."""
PRUNED = f"<pruned by shared-svc: nested deeper than {MAX_DEPTH} levels>"

_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
_NOT_QUOTE_OR_BRACKET = bytes(b for b in range(256) if b not in b'"[]{}')
_STEP = [0] * 256
for _b in b"[{":
    _STEP[_b] = 1
for _b in b"]}":
    _STEP[_b] = -1


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text (no recursion).

    Escaped backslashes, then escaped quotes, are dropped (JSON pairs backslashes from
    the left, as ``replace`` does), so every remaining quote opens or closes a string;
    of the quotes and brackets left, the brackets outside strings count. Bytes-level
    C operations only, but the final sum: it runs on every page of a re-list.
    """
    bare = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_QUOTE_OR_BRACKET)
    brackets = b"".join(bare.split(b'"')[::2])
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def _prune(raw: bytes, limit: int) -> bytes:
    """``raw`` with every array or object below ``limit`` levels replaced by PRUNED."""
    out: list[bytes] = []
    depth, cut_from, copied = 0, -1, 0
    for match in _TOKEN.finditer(raw):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            if depth == limit + 1:
                cut_from = match.start()
        elif token in (b"]", b"}"):
            depth -= 1
            if depth == limit and cut_from >= 0:
                out += [raw[copied:cut_from], json.dumps(PRUNED).encode()]
                copied, cut_from = match.end(), -1
    out.append(raw[copied:])
    return b"".join(out)


def loads(raw: bytes, *, envelope: int = 0) -> tuple[Any, bool]:
    """``json.loads``, but an object nested deeper than MAX_DEPTH keeps its shallower
    fields and gets PRUNED in place of the too-deep subtrees (``envelope``: container
    levels around the objects, 1 for a watch event, 2 for a list). Returns the value and
    whether anything was pruned."""
    limit = MAX_DEPTH + envelope
    if raw.count(b"{") + raw.count(b"[") <= limit or json_depth(raw) <= limit:
        return json.loads(raw), False
    return json.loads(_prune(raw, limit)), True


SHARED_VALUES_MAX = 65_536  # distinct shared subtrees remembered (then the table starts over)


class SharedValues:
    """One copy of each repeated subtree of the kept objects (label sets, condition lists:
    the pods of one DaemonSet revision carry the same ones), strings interned.

    Below the object itself and its ``metadata`` (which holds its name, so it is unique),
    a dict or list equal to one seen before is replaced by that one: thousands of pods
    hold one label set, one ``status`` per distinct conditions and one ``spec`` per node. The cached objects are
    read-only (two controllers share them; the planners are pure), so sharing is safe.
    Equal everywhere to what it replaces (the property tests plan over both). The table
    is bounded: past :data:`SHARED_VALUES_MAX` distinct subtrees it starts over (what is
    shared stays shared)."""

    def __init__(self, limit: int = SHARED_VALUES_MAX) -> None:
        self._limit = limit
        self._table: dict[Any, Any] = {}

    def __call__(self, value: Any) -> Any:
        return self._share(value, 0, unique=True)[0]

    def _share(self, value: Any, depth: int, *, unique: bool = False) -> tuple[Any, Any]:
        """The shared value and its content key (hashable, type-exact: 1, 1.0 and True
        differ)."""
        if isinstance(value, str):
            value = sys.intern(value)
            return value, value
        if isinstance(value, dict):
            out: dict[Any, Any] = {}
            parts = []
            for k, v in value.items():
                k = sys.intern(k) if isinstance(k, str) else k
                out[k], key = self._share(v, depth + 1, unique=depth == 0 and k == "metadata")
                parts.append((k, key))
            return self._canonical(out, ("d", tuple(parts)), unique)
        if isinstance(value, list):
            shared = [self._share(v, depth + 1) for v in value]
            return self._canonical(
                [v for v, _ in shared], ("l", tuple(k for _, k in shared)), unique
            )
        return value, (type(value), value)

    def _canonical(self, value: Any, key: Any, unique: bool) -> tuple[Any, Any]:
        if unique:
            return value, key
        known = self._table.get(key)
        if known is not None:
            return known, key
        if len(self._table) >= self._limit:
            self._table.clear()
        self._table[key] = value
        return value, key


def has_pruned(value: Any) -> bool:
    """Does ``value`` (a parsed object) hold a PRUNED subtree? Iterative, as it is only
    asked of objects that were parsed with ``loads``."""
    stack = [value]
    while stack:
        item = stack.pop()
        if item == PRUNED:
            return True
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def describe_error(exc: BaseException) -> str:
    """One stable line for an API error (the same trouble reads the same on every retry)."""
    if isinstance(exc, ApiException):
        status = status_of(exc)
        message = str(status.get("message") or "") if status else body_text(exc)
        return f"{exc.status} {exc.reason or ''}: {message}".strip(" :")[:300]
    if isinstance(exc, TimeoutError):
        return "TimeoutError: no answer in time"
    return f"{type(exc).__name__}: {exc}"[:300]


def retry_after(exc: ApiException, default: float = 1.0) -> float:
    """Seconds the server asked us to wait (Retry-After), else ``default``."""
    headers: Any = exc.headers or {}
    value = headers.get("Retry-After")
    try:
        return max(0.0, float(value)) if value is not None else default
    except ValueError:
        return default


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


class EventHandler(Protocol):
    """What a cache tells a handler (client-go's ``OnAdd``/``OnUpdate``/``OnDelete``): the
    objects as kept. ``on_delete`` gets the last state known (the watch event's object, or
    the cached one when a re-list no longer finds it)."""

    def on_add(self, new: K8sObject) -> None: ...
    def on_update(self, old: K8sObject, new: K8sObject) -> None: ...
    def on_delete(self, old: K8sObject) -> None: ...


def _key(obj: K8sObject) -> tuple[str, str]:
    meta = obj.get("metadata", {})
    return meta.get("namespace", ""), meta.get("name", "")


class Informer:
    """A list-then-watch cache of one resource."""

    def __init__(
        self,
        api: ApiClient,
        resource: Resource,
        *,
        on_change: Callable[[], None],
        watch_timeout_seconds: int = 60,
        backoff_max_seconds: float = 30.0,
        idle_timeout_seconds: float | None = None,
        on_synced: Callable[[bool], None] | None = None,
        page_size: int = 100,
    ) -> None:
        self._api = api
        self._page_size = page_size
        self.resource = resource
        # Several readers may share one cache (:class:`Informers`): each has its triggers.
        self._change_listeners = [on_change]
        self._handlers: list[EventHandler] = []
        self._synced_listeners = [on_synced] if on_synced else []
        self._watch_timeout = watch_timeout_seconds
        # The server ends each watch at its timeout: silence beyond that means a dead stream.
        self._idle_timeout = (
            idle_timeout_seconds if idle_timeout_seconds is not None else watch_timeout_seconds + 15
        )
        self._shared = SharedValues()  # repeated subtrees of the kept objects, once
        self._items: dict[tuple[str, str], K8sObject] = {}
        self._versions: dict[tuple[str, str], str] = {}  # key -> resourceVersion
        self.synced = asyncio.Event()
        self.served = True
        self.resource_version = ""
        self.relists = 0
        self.idle_watches = 0  # watches closed for silence (no event, no bookmark)
        self.throttled = 0  # 429 answers: waited for, cache kept
        self.last_error: str | None = None
        self.pruned: set[tuple[str, str]] = set()  # objects kept with a too-deep subtree cut
        # Reconnects: 0.4 s, 0.8 s, ... up to backoff_max_seconds, with jitter (the runtime's limiter).
        self._backoff = ItemExponentialFailureRateLimiter(
            BACKOFF_BASE_SECONDS, backoff_max_seconds, max_exponent=10, jitter=0.5
        )
        if on_synced:
            on_synced(False)

    def add_listener(
        self, on_change: Callable[[], None], on_synced: Callable[[bool], None] | None = None
    ) -> None:
        """Another reader of this cache: told of every change (and of ``synced``) too."""
        self._change_listeners.append(on_change)
        if on_synced:
            self._synced_listeners.append(on_synced)
            on_synced(self.synced.is_set())

    def add_handler(self, handler: EventHandler) -> None:
        """``handler`` is told of every add, update and delete from now on; a synced cache
        first hands it an add of each object it holds (as client-go does)."""
        self._handlers.append(handler)
        if self.synced.is_set():
            for obj in self._items.values():
                handler.on_add(obj)

    def _on_change(self) -> None:
        for listener in self._change_listeners:
            listener()

    def _added(self, new: K8sObject) -> None:
        for handler in self._handlers:
            handler.on_add(new)

    def _updated(self, old: K8sObject, new: K8sObject) -> None:
        for handler in self._handlers:
            handler.on_update(old, new)

    def _deleted(self, old: K8sObject) -> None:
        for handler in self._handlers:
            handler.on_delete(old)

    def get(self, name: str, namespace: str = "") -> K8sObject | None:
        """The cached object, if any (no request)."""
        return self._items.get((namespace, name))

    def items(self) -> tuple[K8sObject, ...]:
        return tuple(self._items[k] for k in sorted(self._items))

    def cached_keys(self) -> list[tuple[str, str]]:
        """The (namespace, name) of every cached object."""
        return list(self._items)

    def _set_synced(self, value: bool) -> None:
        if value == self.synced.is_set():
            return
        if value:
            self.synced.set()
        else:
            self.synced.clear()
        for listener in self._synced_listeners:
            listener(value)

    def _query(self, params: dict[str, str]) -> list[tuple[str, str]]:
        query = list(params.items())
        if self.resource.label_selector:
            query.append(("labelSelector", self.resource.label_selector))
        if self.resource.field_selector:
            query.append(("fieldSelector", self.resource.field_selector))
        return query

    async def _get(self, params: dict[str, str], *, timeout: float | aiohttp.ClientTimeout) -> Any:
        """The response, unread; a non-2xx answer raises ApiException with its headers
        (Retry-After) and body."""
        resp = await self._api.call_api(
            self.resource.path,
            "GET",
            query_params=self._query(params),
            header_params={
                "Accept": accept_header(self.resource, watch=params.get("watch") == "true")
            },
            auth_settings=["BearerToken"],
            _preload_content=False,
            _request_timeout=timeout,
        )
        if not 200 <= resp.status <= 299:
            body = await resp.read()
            resp.release()
            exc = ApiException(status=resp.status, reason=resp.reason)
            exc.body = body.decode(errors="replace")[:2000]
            exc.headers = resp.headers
            raise exc
        return resp

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

    async def _crd_absent(self) -> bool:
        if not self.resource.crd_name:
            return True
        try:
            await client.ApiextensionsV1Api(self._api).read_custom_resource_definition(
                self.resource.crd_name
            )
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return False

    async def relist(self) -> None:
        """A complete list replaces the cache; raises on failure (the cache keeps its contents).

        Read in pages; a continue token that expired (410) starts the list over once."""
        for attempt in (1, 2):
            try:
                listed = await self._list_pages()
            except ApiException as exc:
                if exc.status == 410 and attempt == 1:
                    continue
                raise
            if listed is None:  # not served
                self._replace({}, {}, served=False, resource_version="")
                return
            items, versions, resource_version, pruned = listed
            self._replace(items, versions, served=True, resource_version=resource_version)
            self._note_pruned(pruned)
            return

    async def _list_pages(
        self,
    ) -> tuple[dict[tuple[str, str], K8sObject], dict[tuple[str, str], str], str, set[Any]] | None:
        """Every page of the list, each object projected as its page is read (None: the
        resource is not served)."""
        keep = self._keep
        items: dict[tuple[str, str], K8sObject] = {}
        versions: dict[tuple[str, str], str] = {}
        pruned_keys: set[tuple[str, str]] = set()
        token = ""
        resource_version = ""
        while True:
            params = {"limit": str(self._page_size)} if self._page_size else {}
            if token:
                params["continue"] = token
            try:
                # A list answers at once; silence means a dead (pooled) connection.
                resp = await self._get(
                    params, timeout=aiohttp.ClientTimeout(total=60, sock_read=self._idle_timeout)
                )
            except ApiException as exc:
                if exc.status == 404 and not token:
                    if await self._crd_absent():
                        return None
                    raise NotServedYet(
                        f"{self.resource.describe()} answers 404 but its CRD exists"
                    ) from exc
                raise
            try:
                raw = await resp.read()
            finally:
                resp.release()
            data, pruned = loads(raw, envelope=2)
            del raw
            meta = data.get("metadata") or {}
            resource_version = meta.get("resourceVersion", "") or resource_version
            for item in data.get("items") or []:
                key = _key(item)
                if pruned and has_pruned(item):
                    pruned_keys.add(key)
                version = item.get("metadata", {}).get("resourceVersion", "")
                versions[key] = version
                # Unchanged since cached (same resourceVersion): keep the cached object,
                # so an unchanged world is held once, not twice, and not projected again.
                cached = self._items.get(key) if version else None
                if cached is not None and self._versions.get(key) == version:
                    items[key] = cached
                    continue
                items[key] = keep(item)
            del data
            token = meta.get("continue") or ""
            if not token:
                return items, versions, resource_version, pruned_keys

    def _keep(self, obj: K8sObject) -> K8sObject:
        """What is kept of a list item or a watch event's object (``Resource.kept``: the
        resource's kind and apiVersion, metadata only or projected). A projection's
        repeated subtrees and strings are shared (:class:`SharedValues`: thousands of pods
        carry the same label sets and conditions); a metadata-only cache holds the
        upgrading nodes and its events come in waves: kept as parsed (interning its
        strings cost 0.13 ms per node event)."""
        kept = self.resource.kept(obj)
        return self._shared(kept) if self.resource.project else kept

    def _replace(
        self,
        items: dict[tuple[str, str], K8sObject],
        versions: dict[tuple[str, str], str],
        *,
        served: bool,
        resource_version: str,
    ) -> None:
        # resourceVersions say whether anything changed: no deep comparison of every object.
        changed = versions != self._versions or served != self.served or not self.synced.is_set()
        old_items, old_versions = self._items, self._versions
        self._items = items
        self._versions = versions
        self.served = served
        self.resource_version = resource_version
        self.relists += 1
        self._set_synced(True)
        if changed and self._handlers:
            self._hand_out_difference(old_items, old_versions)
        if changed:
            self._on_change()

    def _hand_out_difference(
        self, old_items: dict[tuple[str, str], K8sObject], old_versions: dict[tuple[str, str], str]
    ) -> None:
        """The events of a re-list: what it added, changed (another resourceVersion) and no
        longer found. Once per re-list, never per watch event."""
        for key, version in self._versions.items():
            old = old_items.get(key)
            if old is None:
                self._added(self._items[key])
            elif old_versions.get(key) != version:
                self._updated(old, self._items[key])
        for key, old in old_items.items():
            if key not in self._items:
                self._deleted(old)

    def _note_pruned(self, keys: set[tuple[str, str]]) -> None:
        """Remembers the objects kept with a cut subtree; each newly cut one is logged."""
        if keys == self.pruned:
            return
        for ns, name in sorted(keys - self.pruned):
            log.warning(
                "object nested too deep: kept with the deep part cut",
                extra={
                    "resource": self.resource.describe(),
                    "object": f"{ns}/{name}" if ns else name,
                    "maxDepth": MAX_DEPTH,
                },
            )
        self.pruned = keys

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
                event, pruned = loads(line, envelope=1)
                etype, obj = event.get("type"), event.get("object") or {}
                if etype == "ERROR":
                    if obj.get("code") == 410:
                        return "gone"
                    exc = ApiException(
                        status=obj.get("code", 500), reason=obj.get("reason") or "watch error"
                    )
                    exc.body = json.dumps(obj).encode()
                    raise exc
                rv = obj.get("metadata", {}).get("resourceVersion")
                if rv:
                    self.resource_version = rv
                if etype == "BOOKMARK":
                    continue
                key = _key(obj)
                if pruned and etype != "DELETED":
                    self._note_pruned(self.pruned | {key})
                elif key in self.pruned:
                    self._note_pruned(self.pruned - {key})
                if etype == "DELETED":
                    self._versions.pop(key, None)
                    cached = self._items.pop(key, None)
                    if cached is not None:
                        # The object's last state (its final resourceVersion) is the event's.
                        self._deleted(self._keep(obj) if self._handlers else cached)
                        self._on_change()
                elif etype in ("ADDED", "MODIFIED"):
                    self._versions[key] = rv or ""
                    kept = self._keep(obj)
                    del obj, event
                    # A change in a field the projection drops is no change to the planners.
                    old = self._items.get(key)
                    if old != kept:
                        self._items[key] = kept
                        if old is None:
                            self._added(kept)
                        else:
                            self._updated(old, kept)
                        self._on_change()

    async def run(self, stop: asyncio.Event) -> None:
        """Runs until ``stop`` is set. Never raises for API trouble: it backs off and retries.

        Lists once, then watches; re-lists only when the watch cannot resume (see the
        module docstring), never on a timer."""
        need_list = True
        while not stop.is_set():
            try:
                if need_list:
                    await self.relist()
                    need_list = False
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
                        need_list = True
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
                        need_list = True
                    elif not self.served:
                        # Not served: look again soon (a CRD installed later).
                        await sleep_or_stop(stop, NOT_SERVED_RECHECK_SECONDS)
                        need_list = True
            except asyncio.CancelledError:
                raise
            except ApiException as exc:
                if exc.status != 429:
                    await self._failed(stop, exc)
                    need_list = True
                    continue
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
                await sleep_or_stop(stop, delay)
            except Exception as exc:
                await self._failed(stop, exc)
                need_list = True

    async def _failed(self, stop: asyncio.Event, exc: Exception) -> None:
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
        await sleep_or_stop(stop, delay)


class UnionInformer:
    """One cache of the union of several label selectors (``Resource.any_of``): a
    list+watch per selector (each an :class:`Informer`, with its own resourceVersion,
    re-lists and backoff), read as one store. Requirements of one selector are ANDed, so
    a union takes several watches; with disjoint selectors each object is held once (an
    object that moves from one to another is, for a moment, in both: the newer copy is
    read). Synced when every part is."""

    def __init__(
        self,
        api: ApiClient,
        resource: Resource,
        *,
        on_change: Callable[[], None],
        on_synced: Callable[[bool], None] | None = None,
        backoff_max_seconds: float = 30.0,
        **options: Any,
    ) -> None:
        self.resource = resource
        self.synced = asyncio.Event()
        self._change_listeners = [on_change]
        self._synced_listeners = [on_synced] if on_synced else []
        self.parts: tuple[Informer, ...] = ()
        self.parts = tuple(
            Informer(
                api,
                dataclasses.replace(resource, any_of=(), label_selector=selector),
                on_change=self._on_change,
                on_synced=self._part_synced,
                backoff_max_seconds=backoff_max_seconds,
                **options,
            )
            for selector in resource.any_of
        )
        if on_synced:
            on_synced(False)

    def add_listener(
        self, on_change: Callable[[], None], on_synced: Callable[[bool], None] | None = None
    ) -> None:
        self._change_listeners.append(on_change)
        if on_synced:
            self._synced_listeners.append(on_synced)
            on_synced(self.synced.is_set())

    def add_handler(self, handler: EventHandler) -> None:
        for part in self.parts:
            part.add_handler(handler)

    def _on_change(self) -> None:
        for listener in self._change_listeners:
            listener()

    def _part_synced(self, _: bool) -> None:
        value = bool(self.parts) and all(part.synced.is_set() for part in self.parts)
        if value == self.synced.is_set():
            return
        if value:
            self.synced.set()
        else:
            self.synced.clear()
        for listener in self._synced_listeners:
            listener(value)

    def _store(self) -> dict[tuple[str, str], K8sObject]:
        store: dict[tuple[str, str], K8sObject] = {}
        newest: dict[tuple[str, str], int] = {}
        for part in self.parts:
            for key, obj in part._items.items():
                version = part._versions.get(key, "")
                rank = int(version) if version.isdigit() else 0
                if key not in store or rank > newest[key]:
                    store[key], newest[key] = obj, rank
        return store

    def get(self, name: str, namespace: str = "") -> K8sObject | None:
        return self._store().get((namespace, name))

    def items(self) -> tuple[K8sObject, ...]:
        store = self._store()
        return tuple(store[k] for k in sorted(store))

    def cached_keys(self) -> list[tuple[str, str]]:
        return list(self._store())

    @property
    def served(self) -> bool:
        return all(part.served for part in self.parts)

    @property
    def relists(self) -> int:
        return sum(part.relists for part in self.parts)

    @property
    def last_error(self) -> str | None:
        return next((p.last_error for p in self.parts if p.last_error is not None), None)

    @property
    def pruned(self) -> set[tuple[str, str]]:
        return set().union(*(part.pruned for part in self.parts))

    async def run(self, stop: asyncio.Event) -> None:
        """Every part's list+watch, until ``stop``."""
        await asyncio.gather(*(part.run(stop) for part in self.parts))


Cache = Informer | UnionInformer


class Informers:
    """One :class:`Informer` per :class:`Resource` (a declaration: ``shared_svc.caches``),
    shared by the controllers that read it (the Services and driver-upgrade controllers
    both read DaemonSets and ClusterPolicies): one list, one watch and one copy in memory,
    each reader keeping its own triggers and handlers."""

    def __init__(self, api: ApiClient, *, backoff_max_seconds: float = 30.0) -> None:
        self._api = api
        self._backoff_max = backoff_max_seconds  # every cache's reconnects: one option
        self._informers: dict[Resource, Cache] = {}
        self._running: set[int] = set()

    def informer(
        self,
        resource: Resource,
        *,
        on_change: Callable[[], None],
        on_synced: Callable[[bool], None] | None = None,
    ) -> Cache:
        """The cache of ``resource``, made on first ask; ``on_change`` is called on its
        changes. Its options are the declaration's (``resource``) and the registry's, so
        it does not matter which reader asks first."""
        informer = self._informers.get(resource)
        if informer is None:
            informer = (UnionInformer if resource.any_of else Informer)(
                self._api,
                resource,
                on_change=on_change,
                on_synced=on_synced,
                backoff_max_seconds=self._backoff_max,
            )
            self._informers[resource] = informer
        else:
            informer.add_listener(on_change, on_synced)
        return informer

    async def run(self, informer: Cache, stop: asyncio.Event) -> None:
        """Runs ``informer`` until ``stop``: the first reader's call runs it, the others
        only wait for ``stop``."""
        if id(informer) in self._running:
            await stop.wait()
            return
        self._running.add(id(informer))
        try:
            await informer.run(stop)
        finally:
            self._running.discard(id(informer))


async def gather_until(stop: asyncio.Event, coros: list[Awaitable[None]]) -> None:
    """Runs tasks until ``stop``; cancels them after."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await stop.wait()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
