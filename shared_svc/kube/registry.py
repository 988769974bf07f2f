"""The registry of caches: one per declaration, shared by the controllers that read it
(client-go's shared informer factory), each cache a Runnable of the Manager
(controller-runtime's cache is one)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from kubernetes_asyncio.client import ApiClient

from shared_svc.kube.reflector import Informer
from shared_svc.kube.resources import Resource
from shared_svc.kube.union import UnionInformer
from shared_svc.wait.runnable import Runnable

Cache = Informer | UnionInformer


class CacheRunnable(Runnable):
    """One cache of the registry as a Runnable: its list+watch runs until stopped (it
    never raises for API trouble: it backs off and re-lists); ready once synced. The
    Manager starts every cache before the controllers that read them (all listing at
    once) and stops them after; the controllers wait for the caches they read to sync
    (controller-runtime's ``WaitForCacheSync``)."""

    def __init__(self, cache: Cache) -> None:
        self.name = f"cache {cache.resource.describe()}"
        self.cache = cache

    async def run(self, stop: asyncio.Event) -> None:
        await self.cache.run(stop)
        if not stop.is_set():  # the Manager stops every part and the process exits non-zero
            raise RuntimeError(f"{self.name} ended unexpectedly")

    def ready(self) -> bool:
        return self.cache.synced.is_set()


class Informers:
    """One :class:`Informer` per :class:`Resource` (a declaration: ``shared_svc.controllers.services.caches``),
    shared by the controllers that read it (the Services and driver-upgrade controllers
    both read DaemonSets and ClusterPolicies): one list, one watch and one copy in memory,
    each reader keeping its own triggers and handlers.

    The readers only ask for caches (:meth:`informer`) and read them; whoever made the
    registry runs them: the service hands :meth:`runnables` to its Manager, a controller
    made without the service's registry (tests, tools) runs its own with :meth:`run`."""

    def __init__(self, api: ApiClient, *, backoff_max_seconds: float = 30.0) -> None:
        self._api = api
        self._backoff_max = backoff_max_seconds  # every cache's reconnects: one option
        self._caches: dict[Resource, CacheRunnable] = {}
        self._handed_out = False  # runnables() or run() was called: no new cache after

    def informer(
        self,
        resource: Resource,
        *,
        on_change: Callable[[], None],
        on_synced: Callable[[bool], None] | None = None,
    ) -> Cache:
        """The cache of ``resource``, made on first ask; ``on_change`` is called on its
        changes. Its options are the declaration's (``resource``) and the registry's, so
        it does not matter which reader asks first. A cache is declared before the
        registry's caches are handed to their runner (it would never run)."""
        entry = self._caches.get(resource)
        if entry is None:
            if self._handed_out:
                raise RuntimeError(
                    f"cache {resource.describe()} asked for after the caches were started"
                )
            cache = (UnionInformer if resource.any_of else Informer)(
                self._api,
                resource,
                on_change=on_change,
                on_synced=on_synced,
                backoff_max_seconds=self._backoff_max,
            )
            self._caches[resource] = CacheRunnable(cache)
            return cache
        entry.cache.add_listener(on_change, on_synced)
        return entry.cache

    def runnables(self) -> list[CacheRunnable]:
        """Every cache, once, as a Runnable of the Manager (in the order first asked for)."""
        self._handed_out = True
        return list(self._caches.values())

    async def run(self, stop: asyncio.Event) -> None:
        """Runs every cache until ``stop``, all listing at once (a registry without a
        Manager)."""
        await gather_until(stop, [entry.run(stop) for entry in self.runnables()])


async def gather_until(stop: asyncio.Event, coros: list[Awaitable[None]]) -> None:
    """Runs tasks until ``stop``; cancels them after."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await stop.wait()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
