"""ServiceMonitor discovery for the Services controller, a Runnable of the Manager:
whether the ServiceMonitor API is served (Prometheus Operator installed later, or
removed), every ``discovery_seconds`` or at once when woken (a write on its path was
refused: "404 page not found", or a 403 while its CRD is being deleted).

The ServiceMonitor cache is the registry's (its ``shared_svc_cache_synced`` is reported
with the others) but runs only while the API is served: :attr:`cache_runnable` is that
cache, switched by discovery (``runtime.manager.Switched``), a Runnable of the Manager
after discovery (started and stopped there, on SIGTERM before discovery). While the API
is not served the cache is empty, synced and ``served`` false, as a list of a resource
that is not served leaves a cache, so the controller waits for it only while it lists.
docs/architecture.md, "The Manager's runnables"."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from shared_svc.config import Config
from shared_svc.controllers.services.caches import service_monitors
from shared_svc.kube.reflector import Cache
from shared_svc.kube.registry import CacheRegistry
from shared_svc.kube.resources import CUSTOM_RESOURCE_DEFINITIONS, METADATA, SERVICE_MONITORS
from shared_svc.kube.writer import raw_request
from shared_svc.runtime.manager import Periodic, Switched

log = logging.getLogger("shared_svc.controller")


class ServiceMonitorDiscovery(Periodic):
    def __init__(
        self,
        api: ApiClient,
        config: Config,
        *,
        caches: CacheRegistry,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(
            "servicemonitor-discovery", self._discover, lambda: config.discovery_seconds
        )
        self._api = api
        self.on_change = on_change  # served or not, changed: what failed may work now
        self.served = False
        cache = caches.cache(service_monitors(config.namespace), runs=False)
        assert isinstance(cache, Cache)  # one selector: no union
        self.cache = cache
        self.cache_runnable = Switched(
            caches.runnable(self.cache), lambda: self.served, when_off=self._not_served
        )
        self._not_served()

    def _not_served(self) -> None:
        """The cache as a list of a resource not served leaves it: empty, synced."""
        self.cache.replace({}, {}, served=False, resource_version="")

    async def _served(self) -> bool:
        """The API lists ServiceMonitors and their CRD is not being deleted (its objects
        are, and creating one is refused: as good as gone)."""
        try:
            res = await raw_request(self._api, "GET", SERVICE_MONITORS.group_version)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        if not any(r.get("name") == "servicemonitors" for r in res.get("resources", [])):
            return False
        crd_name = self.cache.resource.crd_name
        assert crd_name is not None
        try:
            crd = await raw_request(
                self._api, "GET", CUSTOM_RESOURCE_DEFINITIONS.item(crd_name), accept=METADATA
            )
        except ApiException as exc:
            return exc.status != 404  # another answer (403: not granted) says nothing
        return not (crd.get("metadata") or {}).get("deletionTimestamp")

    async def _discover(self) -> None:
        try:
            served = await self._served()
        except Exception as exc:
            log.warning("discovery failed", extra={"error": str(exc)})
            served = self.served  # unknown: keep what we knew
        if served != self.served:
            log.info("ServiceMonitor API served" if served else "ServiceMonitor API not served")
            self.served = served
            if served:
                # Its "not served" no longer holds: no reconcile reads it until it has listed.
                self.cache.invalidate()
            self.cache_runnable.flip()  # the cache runs while served
            self.on_change()
