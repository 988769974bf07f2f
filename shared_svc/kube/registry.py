"""The registry of caches: one per declaration, shared by the controllers that read it
(client-go's shared informer factory), each cache a Runnable of the Manager
(controller-runtime's cache is one), and the one place that reports whether each cache
is synced (``on_synced``: the ``shared_svc_cache_synced`` gauge) and when every cache it
runs has synced (``on_all_synced``: at the start, and again after a cache re-listed)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kubernetes_asyncio.client import ApiClient

from shared_svc.kube.reflector import Cache
from shared_svc.kube.resources import Resource
from shared_svc.kube.union import UnionCache
from shared_svc.wait.runnable import Runnable

AnyCache = Cache | UnionCache


class CacheRunnable(Runnable):
    """One cache of the registry as a Runnable: its list+watch runs until stopped (it
    never raises for API trouble: it backs off and re-lists); ready once synced. The
    Manager starts every cache before the controllers that read them (all listing at
    once) and stops them after; each controller waits for the caches it reads to sync
    (``runtime.controller.Controller.run``: controller-runtime's ``WaitForCacheSync``)."""

    def __init__(self, cache: AnyCache) -> None:
        self.name = f"cache {cache.resource.describe()}"
        self.cache = cache

    async def run(self, stop: asyncio.Event) -> None:
        await self.cache.run(stop)
        if not stop.is_set():  # the Manager stops every part and the process exits non-zero
            raise RuntimeError(f"{self.name} ended unexpectedly")

    def ready(self) -> bool:
        return self.cache.synced.is_set()


class CacheRegistry:
    """One :class:`~shared_svc.kube.reflector.Cache` per :class:`Resource` (a declaration,
    made by the controller package that reads it: ``shared_svc.controllers``), shared by
    the controllers that read it (the Services and driver-upgrade controllers both read
    DaemonSets and ClusterPolicies): one list, one watch and one copy in memory, each
    reader adding its own event handlers.

    The readers only ask for caches (:meth:`cache`) and read them; the service hands
    :meth:`runnables` to its Manager, which runs them. A cache asked for with
    ``runs=False`` is made (and reported) here but run by its reader's own Runnable (the
    ServiceMonitor cache, run only while its API is served: :meth:`runnable`)."""

    def __init__(
        self,
        api: ApiClient,
        *,
        backoff_max_seconds: float = 30.0,
        on_synced: Callable[[str, bool], None] | None = None,
        on_all_synced: Callable[[], None] | None = None,
    ) -> None:
        self._api = api
        self._backoff_max = backoff_max_seconds  # every cache's reconnects: one option
        self._on_synced = on_synced  # (cache name, synced): the gauge of every cache
        # Every cache the registry runs is synced now (it was not a moment ago): the
        # objects listed are what the process keeps (``runtime.heap.freeze``).
        self._on_all_synced = on_all_synced
        self._synced: dict[Resource, bool] = {}
        self._every_one_synced = False  # of the caches it runs, as last reported
        self._caches: dict[Resource, CacheRunnable] = {}
        self._own: set[Resource] = set()  # run by the registry's Manager
        self._handed_out = False  # runnables() was called: no new cache after

    def cache(self, resource: Resource, *, runs: bool = True) -> AnyCache:
        """The cache of ``resource``, made on first ask. Its options are the
        declaration's (``resource``) and the registry's, so it does not matter which
        reader asks first. A cache is declared before the registry's caches are handed to
        their runner (it would never run)."""
        entry = self._caches.get(resource)
        if entry is None:
            if self._handed_out:
                raise RuntimeError(
                    f"cache {resource.describe()} asked for after the caches were started"
                )
            cache = (UnionCache if resource.any_of else Cache)(
                self._api,
                resource,
                on_synced=lambda synced: self._synced_changed(resource, synced),
                backoff_max_seconds=self._backoff_max,
            )
            self._caches[resource] = entry = CacheRunnable(cache)
        if runs:
            self._own.add(resource)
        return entry.cache

    def _synced_changed(self, resource: Resource, synced: bool) -> None:
        self._synced[resource] = synced
        if self._on_synced is not None:
            self._on_synced(resource.cache_name, synced)
        were, self._every_one_synced = self._every_one_synced, self._all_synced()
        if self._every_one_synced and not were and self._on_all_synced is not None:
            self._on_all_synced()

    def _all_synced(self) -> bool:
        """Every cache the registry runs is synced, once they run (after :meth:`runnables`)."""
        return self._handed_out and all(self._synced.get(r, False) for r in self._own)

    def caches(self) -> list[AnyCache]:
        """Every cache made, in the order first asked for."""
        return [entry.cache for entry in self._caches.values()]

    def runnable(self, cache: AnyCache) -> CacheRunnable:
        """The Runnable of a cache of this registry (for one its reader runs)."""
        return self._caches[cache.resource]

    def runnables(self) -> list[CacheRunnable]:
        """Every cache the registry runs, once, as a Runnable of the Manager (in the order
        first asked for)."""
        self._handed_out = True
        return [entry for resource, entry in self._caches.items() if resource in self._own]
