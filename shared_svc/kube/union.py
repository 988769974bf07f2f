"""One cache of the union of several label selectors (``Resource.any_of``)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from kubernetes_asyncio.client import ApiClient

from shared_svc.k8s.objects import K8sObject
from shared_svc.kube.reflector import Cache
from shared_svc.kube.resources import Resource
from shared_svc.kube.store import EventHandler, Key, set_synced


class UnionCache:
    """One cache of the union of several label selectors (``Resource.any_of``): a
    list+watch per selector (each a :class:`~shared_svc.kube.reflector.Cache`, with its own resourceVersion,
    re-lists and backoff), read as one store. Requirements of one selector are ANDed, so
    a union takes several watches; with disjoint selectors each object is held once (an
    object that moves from one to another is, for a moment, in both: the newer copy is
    read). Synced when every part is.

    Read as one store without merging on every read: ``items()`` and ``cached_keys()``
    are merged once per change of a part (``generation``, the parts' own) and hand out
    the very same tuple until the next; ``get`` asks each part for the one key. (A watch
    event that changes only the resourceVersion of a kept object is no change of its
    part: it cannot change which of two copies is newer, since a part's stream is in
    resourceVersion order and tells of a pod leaving its selector before of its return.)"""

    def __init__(
        self,
        api: ApiClient,
        resource: Resource,
        *,
        on_synced: Callable[[bool], None] | None = None,
        backoff_max_seconds: float = 30.0,
        **options: Any,
    ) -> None:
        self.resource = resource
        self.synced = asyncio.Event()
        self._on_synced = on_synced  # told of each change of ``synced`` (the registry's gauge)
        if on_synced is not None:
            on_synced(False)
        self._merged: tuple[tuple[int, ...], tuple[Key, ...], tuple[K8sObject, ...]] | None = None
        self.parts: tuple[Cache, ...] = ()
        self.parts = tuple(
            Cache(
                api,
                dataclasses.replace(resource, any_of=(), label_selector=selector),
                on_synced=self._part_synced,
                backoff_max_seconds=backoff_max_seconds,
                **options,
            )
            for selector in resource.any_of
        )

    async def relist(self) -> None:
        """A complete list of every part (each one list: ``relists`` counts them all)."""
        for part in self.parts:
            await part.relist()

    def add_handler(self, handler: EventHandler) -> None:
        """``handler`` is told of every part's adds, updates and deletes (an object that
        moves from one selector to another: a delete by one part, an add by the other)."""
        for part in self.parts:
            part.add_handler(handler)

    def _part_synced(self, _: bool) -> None:
        synced = bool(self.parts) and all(p.synced.is_set() for p in self.parts)
        set_synced(self.synced, synced, self._on_synced)

    @property
    def generation(self) -> tuple[int, ...]:
        """The parts' generations: equal while no part changed."""
        return tuple(part.generation for part in self.parts)

    def _merge(self) -> tuple[tuple[Key, ...], tuple[K8sObject, ...]]:
        """The sorted keys and objects of the union (of a key in two parts, the newer
        copy), merged again only after a part changed."""
        generation = self.generation
        if self._merged is None or self._merged[0] != generation:
            store: dict[Key, K8sObject] = {}
            newest: dict[Key, int] = {}
            for part in self.parts:
                for key, obj in part._items.items():
                    rank = _rank(part._versions.get(key, ""))
                    if key not in store or rank > newest[key]:
                        store[key], newest[key] = obj, rank
            keys = tuple(sorted(store))
            self._merged = (generation, keys, tuple(store[k] for k in keys))
        return self._merged[1], self._merged[2]

    def get(self, name: str, namespace: str = "") -> K8sObject | None:
        """The newer copy of the parts' (no request, no merge)."""
        key = (namespace, name)
        found, newest = None, 0
        for part in self.parts:
            obj = part._items.get(key)
            if obj is not None:
                rank = _rank(part._versions.get(key, ""))
                if found is None or rank > newest:
                    found, newest = obj, rank
        return found

    def items(self) -> tuple[K8sObject, ...]:
        return self._merge()[1]

    def cached_keys(self) -> tuple[Key, ...]:
        return self._merge()[0]

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


def _rank(version: str) -> int:
    """A resourceVersion as a number to compare copies by (0 when it is not one)."""
    return int(version) if version.isdigit() else 0
