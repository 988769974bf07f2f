"""Event sources: from a cache's add/update/delete to the keys of a work queue.

controller-runtime's ``source.Kind`` + ``predicate`` + ``handler.EnqueueRequestsFromMapFunc``,
cut to what shared-svc needs. A cache (a :class:`Source`: ``kube.reflector.Cache``) hands
an :class:`~shared_svc.kube.store.EventHandler` each change with the old and the new
object; :class:`Enqueue` is such a handler: it builds an :class:`Event`, lets it through
only if every predicate agrees, maps it to a key and enqueues that key, or retries it at
once when the event is a re-list's replay (:func:`replayed`). Nothing here reads a
cache: the cost of an event does not depend on how many objects are cached.

Predicates:

- :class:`NewestVersions`: of several caches holding one object (the upgrade controller's
  state and parked node caches), or of one cache that re-lists, only a version newer than
  the newest one seen for the key passes, so the copy a second cache delivers later does
  not read as a change (nor as a change back);
- :class:`OwnWrites`: the echo of our own write (the resourceVersion the write answered)
  starts no reconcile: the reconcile that wrote it planned on what it wrote;
  :class:`WritesInFlight` (the upgrade controller's node patches) holds a key's events
  while its write is in flight, since the echo may come before the write's answer.

A cache hands out an update with an unchanged resourceVersion only as a re-list's replay,
which :class:`Enqueue` retries at once: no predicate filters on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, Protocol, TypeVar

from shared_svc.k8s.objects import K8sObject, meta
from shared_svc.kube.store import EventHandler

K = TypeVar("K", bound=Hashable)

EventType = Literal["add", "update", "delete"]


@dataclass(frozen=True, slots=True)
class Event:
    """One change of one object as a cache delivers it: ``old`` is None for an add,
    ``new`` is None for a delete."""

    type: EventType
    old: K8sObject | None
    new: K8sObject | None

    @property
    def obj(self) -> K8sObject:
        """The object as it is now (for a delete: its last state)."""
        obj = self.new if self.new is not None else self.old
        assert obj is not None
        return obj


Predicate = Callable[[Event], bool]


class Source(Protocol):
    """What a controller watches: a cache (``kube.reflector.Cache``, ``kube.union.UnionCache``)."""

    synced: asyncio.Event

    def add_handler(self, handler: EventHandler) -> None: ...


def all_synced(sources: Iterable[Source]) -> bool:
    """Every one of ``sources`` is synced."""
    return all(source.synced.is_set() for source in sources)


async def until_synced(stop: asyncio.Event, sources: Iterable[Source]) -> bool:
    """Waits until every source is synced (controller-runtime's ``WaitForCacheSync``: no
    polling, each cache's ``synced`` is awaited); False if ``stop`` came first."""
    stopper = asyncio.ensure_future(stop.wait())
    try:
        for source in sources:
            if source.synced.is_set():
                continue
            synced = asyncio.ensure_future(source.synced.wait())
            await asyncio.wait([stopper, synced], return_when=asyncio.FIRST_COMPLETED)
            synced.cancel()
            if stop.is_set():
                return False
        return True
    finally:
        stopper.cancel()


def replayed(event: Event) -> bool:
    """An update that hands out the very object the cache held: a list brought it again
    unchanged (``kube.store``: client-go's ``Replace``): the cache listed again, after its
    watch could not resume (an outage, 410 Gone)."""
    return event.type == "update" and event.old is event.new


def version_of(obj: K8sObject | None) -> str:
    return str(meta(obj).get("resourceVersion", "")) if isinstance(obj, dict) else ""


def _newer(version: str, than: str | None) -> bool:
    """Is ``version`` newer than ``than``? resourceVersions are compared as numbers when
    both are (kube-apiserver's are etcd revisions), else any other version is newer."""
    if than is None:
        return True
    if version.isdigit() and than.isdigit():
        return int(version) > int(than)
    return version != than


class NewestVersions(Generic[K]):
    """The newest resourceVersion seen per key; as a predicate, lets through only an
    event that brings a newer one (and remembers it). One dict lookup per event."""

    def __init__(self, key_of: Callable[[K8sObject], K]) -> None:
        self._key_of = key_of
        self._newest: dict[K, str] = {}

    def __call__(self, event: Event) -> bool:
        key, version = self._key_of(event.obj), version_of(event.obj)
        if not _newer(version, self._newest.get(key)):
            return False
        self._newest[key] = version
        return True

    def forget(self, key: K) -> None:
        """``key`` is gone from every cache: a later object of that name is new."""
        self._newest.pop(key, None)


class OwnWrites(Generic[K]):
    """The resourceVersion each of our own writes answered, per key; as a predicate, stops
    the echo of that write (every cache holding the object delivers it)."""

    def __init__(self, key_of: Callable[[K8sObject], K]) -> None:
        self._key_of = key_of
        self._written: dict[K, str] = {}

    def wrote(self, key: K, version: str) -> None:
        self._written[key] = version

    def __call__(self, event: Event) -> bool:
        return self._written.get(self._key_of(event.obj)) != version_of(event.obj)

    def forget(self, key: K) -> None:
        self._written.pop(key, None)


class WritesInFlight(OwnWrites[K]):
    """``OwnWrites`` that also knows the node patches still in flight (issue 22). The watch
    event of a patch may come before its answer (the cache's watch and the patch are two
    connections): such an event is held until the answer, then dropped if it is the echo
    (the version the patch answered) and handed to ``release`` (the work queue) if it is
    anything else: a change by someone else, before or after ours, is never lost. A failed
    write releases what it held. Without it, most nodes of a loaded wave had a second pass
    (a pod list for nothing) from their own record patch."""

    def __init__(
        self, key_of: Callable[[K8sObject], K], release: Callable[[K], None] = lambda _: None
    ) -> None:
        super().__init__(key_of)
        self._key = key_of
        self.release = release
        self._held: dict[K, set[str]] = {}  # node -> versions its events brought meanwhile

    def writing(self, key: K) -> None:
        self._held.setdefault(key, set())

    def __call__(self, event: Event) -> bool:
        held = self._held.get(self._key(event.obj))
        if held is None:
            return super().__call__(event)
        held.add(version_of(event.obj))
        return False

    def wrote(self, key: K, version: str) -> None:
        super().wrote(key, version)
        if self._held.pop(key, set()) - {version}:
            self.release(key)

    def failed(self, key: K) -> None:
        if self._held.pop(key, None):
            self.release(key)


class Enqueue(Generic[K]):
    """An event handler (``kube.store.EventHandler``) that enqueues ``key_of`` the event's
    object when every predicate lets the event through (in order: a predicate that
    remembers, like :class:`NewestVersions`, sees only what the earlier ones passed); a
    replay (:func:`replayed`) that gets through is handed to ``retry`` instead, when given."""

    def __init__(
        self,
        enqueue: Callable[[K], None],
        key_of: Callable[[K8sObject], K],
        predicates: Sequence[Predicate] = (),
        *,
        retry: Callable[[K], None] | None = None,
    ) -> None:
        self._enqueue = enqueue
        self._key_of = key_of
        self._predicates = tuple(predicates)
        self._retry = retry
        self.events = 0  # events handed to this source
        self.enqueued = 0  # ... of which enqueued a key

    def _handle(self, event: Event) -> None:
        self.events += 1
        if all(predicate(event) for predicate in self._predicates):
            self.enqueued += 1
            key = self._key_of(event.obj)
            if self._retry is not None and replayed(event):
                self._retry(key)
            else:
                self._enqueue(key)

    def on_add(self, new: K8sObject) -> None:
        self._handle(Event("add", None, new))

    def on_update(self, old: K8sObject, new: K8sObject) -> None:
        self._handle(Event("update", old, new))

    def on_delete(self, old: K8sObject) -> None:
        self._handle(Event("delete", old, None))
