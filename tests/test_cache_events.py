"""What a cache tells its handlers (issues 21, 29): client-go's ``OnAdd``/``OnUpdate``/
``OnDelete`` with the kept objects, the one channel of what changed: from watch events and
from every list, as client-go's ``Replace`` hands one out (an add of each new object, an
update of each one held: the very same object when the list brought it again unchanged,
a replay; a delete of each one no longer found), and a handler added late first hears of
every object.

No API server: the store is filled as a complete list leaves it (``testenv.caches.fill``:
``Cache.replace``) and watch events come through ``watch_once`` from a stream of event
lines, as the server sends them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shared_svc.k8s.objects import K8sObject
from shared_svc.kube.reflector import Cache, Resource
from shared_svc.reconcile.selection import pod_fields
from testenv.caches import fill as fill


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


def pods_cache() -> Cache:
    return Cache(
        object(),  # type: ignore[arg-type]  # no request is sent
        Resource("", "v1", "pods", "Pod", namespace="ns", project=pod_fields),
    )


class Replays(Events):
    """Also writes down which updates hand out the very object the cache held."""

    def on_update(self, old: K8sObject, new: K8sObject) -> None:
        super().on_update(old, new)
        if old is new:
            self.seen.append(("replay", self._id(new)))


def test_a_list_tells_handlers_what_it_added_changed_brought_again_and_no_longer_found() -> None:
    cache = pods_cache()
    events = Replays()
    cache.add_handler(events)
    fill(cache, [pod("a", "1"), pod("b", "2"), pod("c", "3")])
    assert sorted(events.seen) == [("add", "a@v1"), ("add", "b@v2"), ("add", "c@v3")]
    events.seen.clear()
    fill(cache, [pod("a", "1"), pod("b", "4"), pod("d", "5")])
    assert sorted(events.seen) == [
        ("add", "d@v5"),
        ("delete", "c@v3"),
        ("replay", "a@v1"),
        ("update", "a@v1", "a@v1"),
        ("update", "b@v2", "b@v4"),
    ]
    events.seen.clear()
    # A re-list of what is cached: every object handed out again as it was (the replay by
    # which a re-list says "listed again"; runtime.source.replayed).
    fill(cache, [pod("a", "1"), pod("b", "4"), pod("d", "5")])
    assert sorted(e for e in events.seen if e[0] == "replay") == [
        ("replay", "a@v1"),
        ("replay", "b@v4"),
        ("replay", "d@v5"),
    ]
    assert len(events.seen) == 6


def test_a_handler_added_to_a_synced_cache_first_hears_of_every_object() -> None:
    cache = pods_cache()
    fill(cache, [pod("a", "1"), pod("b", "2")])
    events = Events()
    cache.add_handler(events)
    assert sorted(events.seen) == [("add", "a@v1"), ("add", "b@v2")]


async def test_watch_events_reach_handlers_with_the_old_and_new_kept_objects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = pods_cache()
    fill(cache, [pod("a", "1"), pod("b", "2")])
    events = Events()
    cache.add_handler(events)
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

    monkeypatch.setattr(cache, "_open_watch", open_watch)
    assert await cache.watch_once() == "timeout"
    # The projection drops the container image, so b's change is no change at all; the
    # delete carries the object's last state.
    assert events.seen == [("update", "a@v1", "a@y"), ("add", "c@v8"), ("delete", "a@y")]
    assert [p["metadata"]["name"] for p in cache.items()] == ["b", "c"]


def test_a_cache_tells_of_changes_one_way_handlers_with_objects() -> None:
    """No listener without an object (issue 29): a cache has handlers only."""
    import inspect

    from shared_svc.kube.store import Store
    from shared_svc.kube.union import UnionCache

    for kind in (Store, Cache, UnionCache):
        assert not hasattr(kind, "add_listener"), kind
        assert "on_change" not in inspect.signature(kind.__init__).parameters, kind


async def test_whether_a_crd_is_absent_is_asked_through_the_one_http_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``crd_absent`` reads the CRD's metadata through ``writer.raw_request`` (the typed
    client's call was the one request outside it)."""
    from kubernetes_asyncio.client.exceptions import ApiException

    from shared_svc.kube import reflector

    asked: list[tuple[str, str, str]] = []

    async def raw_request(api: Any, method: str, path: str, **kw: Any) -> Any:
        asked.append((method, path, kw.get("accept", "")))
        if path.endswith("/widgets.example.com"):
            raise ApiException(status=404, reason="Not Found")
        return {"metadata": {"name": path.rsplit("/", 1)[1]}}

    monkeypatch.setattr(reflector, "raw_request", raw_request)
    assert await reflector.crd_absent(object(), "widgets.example.com") is True  # type: ignore[arg-type]
    assert await reflector.crd_absent(object(), "gadgets.example.com") is False  # type: ignore[arg-type]
    assert await reflector.crd_absent(object(), None) is True  # type: ignore[arg-type]  # built-in
    crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    assert [(m, p) for m, p, _ in asked] == [
        ("GET", f"{crds}/widgets.example.com"),
        ("GET", f"{crds}/gadgets.example.com"),
    ]
    assert {a for _, _, a in asked} == {reflector.METADATA}
