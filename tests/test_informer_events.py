"""What a cache tells its handlers (issue 21): client-go's ``OnAdd``/``OnUpdate``/``OnDelete``
with the kept objects, from watch events and from a re-list (the difference of the two
stores, on resourceVersions), and a handler added late first hears of every object.

No API server: the store is filled as a complete list leaves it (``_replace``) and watch
events come through ``watch_once`` from a stream of event lines, as the server sends them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shared_svc.k8s.objects import K8sObject
from shared_svc.kube.reflector import Informer, Resource
from shared_svc.reconcile.selection import pod_fields


class Events:
    """An event handler that writes down what it is told: name, and the ``app`` label
    (``pod_fields`` keeps no resourceVersion: the cache keeps it beside the object)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, ...]] = []

    @staticmethod
    def _id(obj: K8sObject) -> str:
        m = obj["metadata"]
        return f"{m['name']}@{m['labels']['app']}"

    def on_add(self, new: K8sObject) -> None:
        self.seen.append(("add", self._id(new)))

    def on_update(self, old: K8sObject, new: K8sObject) -> None:
        self.seen.append(("update", self._id(old), self._id(new)))

    def on_delete(self, old: K8sObject) -> None:
        self.seen.append(("delete", self._id(old)))


class Lines:
    """A watch response: the given event lines, then the end (the server's timeout)."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self._lines = [json.dumps(e).encode() + b"\n" for e in events]
        self.content = self

    async def readline(self) -> bytes:
        return self._lines.pop(0) if self._lines else b""

    async def __aenter__(self) -> Lines:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


async def one_event(event: dict[str, Any]) -> Lines:
    return Lines([event])


def fill(informer: Informer, objects: list[K8sObject], resource_version: str = "100") -> None:
    """The cache as a complete list leaves it (what ``relist`` does after its pages)."""
    keys = [(o["metadata"].get("namespace", ""), o["metadata"]["name"]) for o in objects]
    items = {key: informer.resource.kept(o) for key, o in zip(keys, objects, strict=True)}
    versions = {key: o["metadata"]["resourceVersion"] for key, o in zip(keys, objects, strict=True)}
    informer._replace(items, versions, served=True, resource_version=resource_version)


def pod(name: str, version: str, app: str | None = None) -> K8sObject:
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "resourceVersion": version,
            "labels": {"app": app or f"v{version}"},
        },
        "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "i"}]},
    }


def pods_cache() -> tuple[Informer, list[int]]:
    changes: list[int] = []
    informer = Informer(
        object(),  # type: ignore[arg-type]  # no request is sent
        Resource("", "v1", "pods", "Pod", namespace="ns", project=pod_fields),
        on_change=lambda: changes.append(1),
    )
    return informer, changes


def test_a_relist_tells_handlers_what_it_added_changed_and_no_longer_found() -> None:
    informer, changes = pods_cache()
    events = Events()
    informer.add_handler(events)
    fill(informer, [pod("a", "1"), pod("b", "2"), pod("c", "3")])
    assert sorted(events.seen) == [("add", "a@v1"), ("add", "b@v2"), ("add", "c@v3")]
    events.seen.clear()
    fill(informer, [pod("a", "1"), pod("b", "4"), pod("d", "5")])
    assert sorted(events.seen) == [
        ("add", "d@v5"),
        ("delete", "c@v3"),
        ("update", "b@v2", "b@v4"),
    ]
    assert len(changes) == 2  # the level-triggered listeners: once per re-list that changed
    events.seen.clear()
    fill(informer, [pod("a", "1"), pod("b", "4"), pod("d", "5")])
    assert events.seen == [] and len(changes) == 2


def test_a_handler_added_to_a_synced_cache_first_hears_of_every_object() -> None:
    informer, _ = pods_cache()
    fill(informer, [pod("a", "1"), pod("b", "2")])
    events = Events()
    informer.add_handler(events)
    assert sorted(events.seen) == [("add", "a@v1"), ("add", "b@v2")]


async def test_watch_events_reach_handlers_with_the_old_and_new_kept_objects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    informer, changes = pods_cache()
    fill(informer, [pod("a", "1"), pod("b", "2")])
    events = Events()
    informer.add_handler(events)
    events.seen.clear()
    updated = pod("a", "6", app="y")
    dropped_only = pod("b", "7", app="v2")
    dropped_only["spec"]["containers"][0]["image"] = "j"  # a field the projection drops
    stream = Lines(
        [
            {"type": "MODIFIED", "object": updated},
            {"type": "MODIFIED", "object": dropped_only},
            {"type": "ADDED", "object": pod("c", "8")},
            {"type": "DELETED", "object": pod("a", "9", app="y")},
            {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "10"}}},
        ]
    )

    async def open_watch(params: dict[str, str], *, timeout: float) -> Lines:
        return stream

    monkeypatch.setattr(informer, "_open_watch", open_watch)
    assert await informer.watch_once() == "timeout"
    # The projection drops the container image, so b's change is no change at all; the
    # delete carries the object's last state.
    assert events.seen == [("update", "a@v1", "a@y"), ("add", "c@v8"), ("delete", "a@y")]
    assert len(changes) == 1 + 3
    assert [p["metadata"]["name"] for p in informer.items()] == ["b", "c"]
