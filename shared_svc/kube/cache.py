"""List-then-watch caches of raw objects (JSON dicts, as the core wants them).

One :class:`Informer` per resource: it lists, then watches from the list's
resourceVersion with bookmarks; on ``410 Gone`` (or an ERROR event) it re-lists; on
connection errors it reconnects with capped exponential backoff; every
``resync_seconds`` it re-lists anyway. ``synced`` is set only after a complete list,
and cleared while a re-list is needed, so a reconcile never runs on partial data.

A list that answers 404 means the resource is not served. That is only believed when
the resource's CustomResourceDefinition is really absent (``crd_name``): a freshly
restarted API server can answer 404 for custom resources before it has loaded their
CRDs, and deciding "no ClusterPolicy exists" from that would delete Services.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from shared_svc.aio import sleep_or_stop
from shared_svc.kube.writer import raw_request

log = logging.getLogger(__name__)

K8sObject = dict[str, Any]


@dataclass(frozen=True)
class Resource:
    """Where a kind lives: ``group`` '' is the core API."""

    group: str
    version: str
    plural: str
    kind: str
    namespace: str | None = None  # None: cluster-scoped, or all namespaces
    label_selector: str | None = None
    field_selector: str | None = None
    crd_name: str | None = None  # set for custom resources

    @property
    def path(self) -> str:
        base = "/api/v1" if not self.group else f"/apis/{self.group}/{self.version}"
        if self.namespace:
            return f"{base}/namespaces/{self.namespace}/{self.plural}"
        return f"{base}/{self.plural}"

    def describe(self) -> str:
        where = f" in {self.namespace}" if self.namespace else ""
        return f"{self.kind}{where}"


class NotServedYet(Exception):
    """404 on a custom resource whose CRD still exists: the server is warming up."""


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
        resync_seconds: float = 300.0,
        watch_timeout_seconds: int = 290,
        backoff_max_seconds: float = 30.0,
    ) -> None:
        self._api = api
        self.resource = resource
        self._on_change = on_change
        self._resync = resync_seconds
        self._watch_timeout = watch_timeout_seconds
        self._backoff_max = backoff_max_seconds
        self._items: dict[tuple[str, str], K8sObject] = {}
        self.synced = asyncio.Event()
        self.served = True
        self.resource_version = ""
        self.relists = 0
        self.last_error: str | None = None

    def items(self) -> tuple[K8sObject, ...]:
        return tuple(self._items[k] for k in sorted(self._items))

    def _query(self, params: dict[str, str]) -> list[tuple[str, str]]:
        query = list(params.items())
        if self.resource.label_selector:
            query.append(("labelSelector", self.resource.label_selector))
        if self.resource.field_selector:
            query.append(("fieldSelector", self.resource.field_selector))
        return query

    async def _open_watch(self, params: dict[str, str], *, timeout: float) -> Any:
        """The watch stream, unread (lists go through raw_request)."""
        resp = await self._api.call_api(
            self.resource.path,
            "GET",
            query_params=self._query(params),
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
            _preload_content=False,
            _request_timeout=timeout,
        )
        if not 200 <= resp.status <= 299:
            body = await resp.read()
            resp.release()
            raise ApiException(status=resp.status, reason=body.decode(errors="replace")[:300])
        return resp

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
        """A complete list replaces the cache; raises on failure (the cache keeps its contents)."""
        try:
            data = await raw_request(
                self._api, "GET", self.resource.path, query=self._query({}), timeout=60
            )
        except ApiException as exc:
            if exc.status == 404:
                if await self._crd_absent():
                    self._replace([], served=False, resource_version="")
                    return
                raise NotServedYet(
                    f"{self.resource.describe()} answers 404 but its CRD exists"
                ) from exc
            raise
        items = data.get("items") or []
        # Lists return items without kind/apiVersion; the core wants whole objects.
        api_version = (
            f"{self.resource.group}/{self.resource.version}"
            if self.resource.group
            else self.resource.version
        )
        for item in items:
            item.setdefault("apiVersion", api_version)
            item.setdefault("kind", self.resource.kind)
        self._replace(
            items, served=True, resource_version=data.get("metadata", {}).get("resourceVersion", "")
        )

    def _replace(self, items: list[K8sObject], *, served: bool, resource_version: str) -> None:
        new = {_key(i): i for i in items}
        changed = new != self._items or served != self.served or not self.synced.is_set()
        self._items = new
        self.served = served
        self.resource_version = resource_version
        self.relists += 1
        self.synced.set()
        if changed:
            self._on_change()

    async def watch_once(self) -> str:
        """Watches until the server ends the stream. Returns 'timeout', 'gone' or 'stopped'."""
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
        async with resp:
            while True:
                line = await resp.content.readline()
                if not line:
                    return "timeout"
                event = json.loads(line)
                etype, obj = event.get("type"), event.get("object") or {}
                if etype == "ERROR":
                    if obj.get("code") == 410:
                        return "gone"
                    raise ApiException(
                        status=obj.get("code", 500), reason=obj.get("message", "watch error")
                    )
                rv = obj.get("metadata", {}).get("resourceVersion")
                if rv:
                    self.resource_version = rv
                if etype == "BOOKMARK":
                    continue
                key = _key(obj)
                if etype == "DELETED" and self._items.pop(key, None) is not None:
                    self._on_change()
                elif etype in ("ADDED", "MODIFIED") and self._items.get(key) != obj:
                    self._items[key] = obj
                    self._on_change()

    async def run(self, stop: asyncio.Event) -> None:
        """Runs until ``stop`` is set. Never raises for API trouble: it backs off and retries."""
        failures = 0
        loop = asyncio.get_running_loop()
        next_resync = 0.0
        need_list = True
        while not stop.is_set():
            try:
                if need_list or loop.time() >= next_resync:
                    await self.relist()
                    next_resync = loop.time() + self._resync
                    need_list = False
                watch = asyncio.ensure_future(self.watch_once())
                stopper = asyncio.ensure_future(stop.wait())
                timer = asyncio.ensure_future(asyncio.sleep(max(0.0, next_resync - loop.time())))
                done, _ = await asyncio.wait(
                    {watch, stopper, timer}, return_when=asyncio.FIRST_COMPLETED
                )
                for task in (watch, stopper, timer):
                    if task not in done:
                        task.cancel()
                if watch in done:
                    outcome = watch.result()
                    if outcome == "gone":
                        need_list = True
                    elif not self.served:
                        # Not served: look again soon (a CRD installed later).
                        await sleep_or_stop(stop, min(self._resync, 30.0))
                        need_list = True
                failures = 0
                self.last_error = None
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"[:500]
                delay = min(self._backoff_max, 0.2 * 2 ** min(failures, 10)) * (
                    0.5 + random.random() / 2
                )
                log.warning(
                    "watch failed; will re-list",
                    extra={
                        "resource": self.resource.describe(),
                        "error": self.last_error,
                        "retry_in": round(delay, 2),
                    },
                )
                # Events may have been missed: no reconcile until a complete re-list.
                self.synced.clear()
                need_list = True
                await sleep_or_stop(stop, delay)


async def gather_until(stop: asyncio.Event, coros: list[Awaitable[None]]) -> None:
    """Runs tasks until ``stop``; cancels them after."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await stop.wait()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
