"""The registry of caches: one per declaration, shared by the controllers that read it
(client-go's shared informer factory)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from kubernetes_asyncio.client import ApiClient

from shared_svc.kube.reflector import Informer
from shared_svc.kube.resources import Resource
from shared_svc.kube.union import UnionInformer

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
