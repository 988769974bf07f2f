"""One cache of the union of several label selectors (``Resource.any_of``)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from kubernetes_asyncio.client import ApiClient

from shared_svc.k8s.objects import K8sObject
from shared_svc.kube.reflector import Informer
from shared_svc.kube.resources import Resource
from shared_svc.kube.store import EventHandler, Key


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

    async def relist(self) -> None:
        """A complete list of every part (each one list: ``relists`` counts them all)."""
        for part in self.parts:
            await part.relist()

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

    def _store(self) -> dict[Key, K8sObject]:
        store: dict[Key, K8sObject] = {}
        newest: dict[Key, int] = {}
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

    def cached_keys(self) -> list[Key]:
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
    def pruned(self) -> set[Key]:
        return set().union(*(part.pruned for part in self.parts))

    async def run(self, stop: asyncio.Event) -> None:
        """Every part's list+watch, until ``stop``."""
        await asyncio.gather(*(part.run(stop) for part in self.parts))
