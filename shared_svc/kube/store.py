"""The store of one cache (client-go's ``tools/cache`` store and its handler fan-out).

Objects by ``(namespace, name)`` with their resourceVersions, read by the controllers
(``get``, ``items``, ``cached_keys``); ``synced``; and the one channel of what changed:
every :class:`EventHandler` is handed each add, update and delete with the kept objects
(client-go's ``ResourceEventHandler``), a list as its events. What is kept is shared
across objects (:class:`SharedValues`). What a complete list or one watch event leaves
in the store of one resource is :class:`ResourceStore`'s; listing and watching are the
reflector's (``kube.reflector.Cache``, a ``ResourceStore``).

Reading costs nothing while nothing changes: a store counts its changes (``generation``)
and ``items()``/``cached_keys()`` hand out the very same tuple until the next one, so a
reconcile after a change elsewhere (a ClusterPolicy) neither sorts nor copies 20,000
cached pods, and a reader can key what it derives on that tuple's identity
(``reconcile.selection.index_workloads``). Every change of the contents passes a
counting point: replacing ``_items`` (a list), and the hand-out of each add, update
and delete (``_added``, ``_updated``, ``_deleted``), which ``ResourceStore`` calls right
after it changes ``_items``, before any handler runs.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from typing import Any, Protocol

from shared_svc.k8s.objects import K8sObject
from shared_svc.kube.resources import Resource
from shared_svc.kube.untrusted import MAX_DEPTH, has_pruned

Key = tuple[str, str]  # (namespace, name)

# The caches' one logger (``kube.reflector``'s): a kept object's warning is the cache's.
log = logging.getLogger("shared_svc.kube.reflector")

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
        differ). A string (most leaves: label keys and values, condition types) is its
        own key, interned where it is met rather than in a call of its own."""
        if isinstance(value, str):
            value = sys.intern(value)
            return value, value
        intern = sys.intern
        if isinstance(value, dict):
            out: dict[Any, Any] = {}
            parts = []
            for k, v in value.items():
                k = intern(k) if isinstance(k, str) else k
                if type(v) is str:
                    out[k] = key = intern(v)
                else:
                    out[k], key = self._share(v, depth + 1, unique=depth == 0 and k == "metadata")
                parts.append((k, key))
            return self._canonical(out, ("d", tuple(parts)), unique)
        if isinstance(value, list):
            items, keys = [], []
            for v in value:
                if type(v) is str:
                    v = key = intern(v)
                else:
                    v, key = self._share(v, depth + 1)
                items.append(v)
                keys.append(key)
            return self._canonical(items, ("l", tuple(keys)), unique)
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


def interned_maps(obj: K8sObject) -> K8sObject:
    """``obj`` with the keys and string values of its ``metadata.labels`` and
    ``metadata.annotations`` interned (``sys.intern``): one copy of each in the process.

    What a cache that keeps objects as parsed (no projection, so no :class:`SharedValues`)
    does instead (issue 33): every GPU node carries the same fifty-odd discovery labels,
    most with the same values, so 5,000 upgrading nodes held 5,000 copies of each string,
    about 5 KiB of the 8 KiB a node's metadata took. A few microseconds per object
    (SharedValues' whole-tree pass cost 0.13 ms per node event). Equal to ``obj``; the
    maps on the way are new, ``obj`` is not changed; a map or value of another type is
    kept as it is."""
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        return obj
    out = dict(meta)
    for field in ("labels", "annotations"):
        value = meta.get(field)
        if isinstance(value, dict):
            out[field] = {
                _intern(k): _intern(v)
                for k, v in value.items()  # keys are strings in JSON
            }
    return {**obj, "metadata": out}


def _intern(value: Any) -> Any:
    return sys.intern(value) if type(value) is str else value


class EventHandler(Protocol):
    """What a cache tells a handler (client-go's ``OnAdd``/``OnUpdate``/``OnDelete``): the
    objects as kept. ``on_delete`` gets the last state known (the watch event's object, or
    the cached one when a re-list no longer finds it)."""

    def on_add(self, new: K8sObject) -> None: ...
    def on_update(self, old: K8sObject, new: K8sObject) -> None: ...
    def on_delete(self, old: K8sObject) -> None: ...


def set_synced(
    synced: asyncio.Event, value: bool, on_synced: Callable[[bool], None] | None
) -> None:
    """``synced`` set or cleared, and ``on_synced`` told when that changes it (a cache's,
    a union's: the registry's gauge)."""
    if value == synced.is_set():
        return
    if value:
        synced.set()
    else:
        synced.clear()
    if on_synced is not None:
        on_synced(value)


def key_of(obj: K8sObject) -> tuple[str, str]:
    meta = obj.get("metadata", {})
    return meta.get("namespace", ""), meta.get("name", "")


class Store:
    """The objects of one cache, ``synced``, and the handlers told of each change."""

    def __init__(self, on_synced: Callable[[bool], None] | None = None) -> None:
        self.generation = 0  # changes of the contents so far (module docstring)
        self._sorted: tuple[int, tuple[Key, ...]] = (-1, ())  # (generation, sorted keys)
        self._objects: tuple[int, tuple[K8sObject, ...]] = (-1, ())  # (generation, items())
        self.synced = asyncio.Event()
        self._on_synced = on_synced  # told of each change of ``synced`` (the registry's gauge)
        if on_synced is not None:
            on_synced(False)
        self._handlers: list[EventHandler] = []
        self._items = {}
        self._versions: dict[Key, str] = {}  # key -> resourceVersion

    @property
    def _items(self) -> dict[Key, K8sObject]:
        return self._contents

    @_items.setter
    def _items(self, items: dict[Key, K8sObject]) -> None:
        self._contents = items
        self.generation += 1

    def add_handler(self, handler: EventHandler) -> None:
        """``handler`` is told of every add, update and delete from now on; a synced cache
        first hands it an add of each object it holds (as client-go does)."""
        self._handlers.append(handler)
        if self.synced.is_set():
            for obj in self._items.values():
                handler.on_add(obj)

    def _added(self, new: K8sObject) -> None:
        self.generation += 1
        for handler in self._handlers:
            handler.on_add(new)

    def _updated(self, old: K8sObject, new: K8sObject) -> None:
        self.generation += 1
        for handler in self._handlers:
            handler.on_update(old, new)

    def _deleted(self, old: K8sObject) -> None:
        self.generation += 1
        for handler in self._handlers:
            handler.on_delete(old)

    def get(self, name: str, namespace: str = "") -> K8sObject | None:
        """The cached object, if any (no request)."""
        return self._items.get((namespace, name))

    def cached_version(self, key: Key) -> str | None:
        """The resourceVersion the cache holds of ``key`` (None: not cached)."""
        return self._versions.get(key)

    def items(self) -> tuple[K8sObject, ...]:
        """Every cached object, by (namespace, name): the same tuple until a change."""
        at, objects = self._objects
        if at != self.generation:
            items = self._items
            objects = tuple(items[k] for k in self.cached_keys())
            self._objects = (self.generation, objects)
        return objects

    def cached_keys(self) -> tuple[Key, ...]:
        """The (namespace, name) of every cached object, sorted: the same tuple until a
        change."""
        at, keys = self._sorted
        if at != self.generation:
            keys = tuple(sorted(self._items))
            self._sorted = (self.generation, keys)
        return keys

    def _set_synced(self, value: bool) -> None:
        set_synced(self.synced, value, self._on_synced)

    def _hand_out_list(self, old_items: dict[Key, K8sObject]) -> None:
        """The events of a list, as client-go's ``Replace`` hands them out: an add of each
        object new to the store, an update of each one it held (the very same object, its
        resourceVersion unchanged, when the list brought it again as it was: a re-list's
        replay, which says the cache is listed again), a delete of each one the list no
        longer found. Once per list, never per watch event."""
        for key in self._versions:
            old = old_items.get(key)
            if old is None:
                self._added(self._items[key])
            else:
                self._updated(old, self._items[key])
        for key, old in old_items.items():
            if key not in self._items:
                self._deleted(old)


def log_newly_pruned(resource: Resource, keys: set[Key]) -> None:
    """Logs each object newly kept with a too-deep subtree cut."""
    for ns, name in sorted(keys):
        log.warning(
            "object nested too deep: kept with the deep part cut",
            extra={
                "resource": resource.describe(),
                "object": f"{ns}/{name}" if ns else name,
                "maxDepth": MAX_DEPTH,
            },
        )


class ResourceStore(Store):
    """The store of one resource's cache: what is kept of each object it is handed
    (:meth:`_keep`), from a complete list (:meth:`replace`) or one watch event
    (:meth:`apply`); whether the resource is served, the resourceVersion reached, and the
    objects kept with a too-deep subtree cut. Listing and watching are the reflector's
    (``kube.reflector.Cache``)."""

    def __init__(self, resource: Resource, on_synced: Callable[[bool], None] | None = None) -> None:
        self.resource = resource
        self._shared = SharedValues()  # repeated subtrees of the kept objects, once
        self.served = True
        self.resource_version = ""
        self.relists = 0
        self.pruned: set[Key] = set()  # objects kept with a too-deep subtree cut
        super().__init__(on_synced)

    def invalidate(self) -> None:
        """What it holds no longer holds (a reader knows it is about to list again): not
        synced until its next complete list."""
        self._set_synced(False)

    def _keep(self, obj: K8sObject) -> K8sObject:
        """What is kept of a list item or a watch event's object (``Resource.kept``: the
        resource's kind and apiVersion, metadata only or projected). A projection's
        repeated subtrees and strings are shared (:class:`SharedValues`: thousands of pods
        carry the same label sets and conditions). Any other cache (the metadata-only
        node caches: 5,000 upgrading nodes, events in waves) keeps the object as parsed
        with the strings of its labels and annotations interned (:func:`interned_maps`:
        microseconds, where the whole-tree pass cost 0.13 ms per node event)."""
        kept = self.resource.kept(obj)
        return self._shared(kept) if self.resource.project else interned_maps(kept)

    def replace(
        self,
        items: dict[Key, K8sObject],
        versions: dict[Key, str],
        *,
        served: bool,
        resource_version: str,
    ) -> None:
        """A complete list replaces the store (client-go's ``Store.Replace``): the kept
        objects and their resourceVersions; synced; the list's events handed out."""
        old_items = self._items
        self._items = items
        self._versions = versions
        self.served = served
        self.resource_version = resource_version
        self.relists += 1
        self._set_synced(True)
        if self._handlers:
            self._hand_out_list(old_items)

    def _note_pruned(self, keys: set[Key]) -> None:
        """Remembers the objects kept with a cut subtree; each newly cut one is logged."""
        if keys != self.pruned:
            log_newly_pruned(self.resource, keys - self.pruned)
            self.pruned = keys

    def apply(self, etype: str, obj: K8sObject, *, pruned: bool = False) -> None:
        """One watch event applied to the store (client-go's ``Store.Add``/``Update``/
        ``Delete``) and handed out: ``ADDED``/``MODIFIED`` keep ``obj`` (a change in a
        field the projection drops is no change), ``DELETED`` drops it and hands out its
        last state. ``pruned``: a subtree of ``obj`` was cut (``watch_event``)."""
        key = key_of(obj)
        rv = obj.get("metadata", {}).get("resourceVersion")
        if pruned and etype != "DELETED" and has_pruned(self.resource.kept(obj)):
            self._note_pruned(self.pruned | {key})
        elif key in self.pruned:
            self._note_pruned(self.pruned - {key})
        if etype == "DELETED":
            self._versions.pop(key, None)
            cached = self._items.pop(key, None)
            if cached is not None:
                # The object's last state (its final resourceVersion) is the event's.
                self._deleted(self._keep(obj) if self._handlers else cached)
        elif etype in ("ADDED", "MODIFIED"):
            self._versions[key] = rv or ""
            kept = self._keep(obj)
            old = self._items.get(key)
            if old != kept:
                self._items[key] = kept
                if old is None:
                    self._added(kept)
                else:
                    self._updated(old, kept)
