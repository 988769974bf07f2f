"""ServiceMonitor discovery for the Services controller, a Runnable of the Manager:
whether the ServiceMonitor API is served (Prometheus Operator installed later, or
removed), every ``discovery_seconds`` or at once when woken (a write met "404 page not
found" on its path, or its cache saw the CRD go).

Its ServiceMonitor cache is its own, not one of the shared registry's (which are the
Manager's Runnables, fixed at start): it exists only while the API is served, made when
discovery finds the API and stopped when the API goes or discovery stops (on SIGTERM
after the controller, before the shared caches). Only the Services controller reads it.
docs/architecture.md, "The Manager's runnables"."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from shared_svc.config import Config
from shared_svc.controllers.services import caches
from shared_svc.kube.reflector import Resource
from shared_svc.kube.registry import Cache
from shared_svc.kube.resources import SERVICE_MONITORS
from shared_svc.kube.writer import raw_request
from shared_svc.runtime.manager import Periodic

log = logging.getLogger("shared_svc.controller")


class ServiceMonitorDiscovery(Periodic):
    def __init__(
        self,
        api: ApiClient,
        config: Config,
        *,
        make_informer: Callable[[Resource], Cache],
        on_change: Callable[[], None],
    ) -> None:
        self.wake = asyncio.Event()
        super().__init__(
            "servicemonitor-discovery",
            self._discover,
            lambda: config.discovery_seconds,
            wake=self.wake,
            on_stop=self._stop_informer,
        )
        self._api = api
        self._namespace = config.namespace
        self._make_informer = make_informer
        self._on_change = on_change  # served or not, changed: what failed may work now
        self.served = False
        self.informer: Cache | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    async def _served(self) -> bool:
        try:
            res = await raw_request(self._api, "GET", SERVICE_MONITORS.group_version)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return any(r.get("name") == "servicemonitors" for r in res.get("resources", []))

    async def _discover(self) -> None:
        try:
            served = await self._served()
        except Exception as exc:
            log.warning("discovery failed", extra={"error": str(exc)})
            served = self.served  # unknown: keep what we knew
        if served and self.informer is None:
            self._stop = asyncio.Event()
            self.informer = self._make_informer(caches.service_monitors(self._namespace))
            self._task = asyncio.ensure_future(self.informer.run(self._stop))
        elif not served and self.informer is not None:
            await self._stop_informer()
        if served != self.served:
            log.info("ServiceMonitor API served" if served else "ServiceMonitor API not served")
            self.served = served
            self._on_change()

    async def _stop_informer(self) -> None:
        self._stop.set()
        if self._task:
            await asyncio.gather(self._task, return_exceptions=True)
        self.informer, self._task = None, None
