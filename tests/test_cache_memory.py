"""What the caches keep, on the real API server (issue 12, memory): each object projected
to the fields the planners read as it arrives (list pages and watch events), lists read in
pages, re-lists decided on resourceVersions."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from shared_svc.kube.reflector import Cache, Resource
from shared_svc.kube.writer import raw_request
from shared_svc.reconcile.selection import pod_fields
from testenv import ControlPlane
from tests.kube import eventually
from tests.realistic import api_pod
from tests.svc import Kube, running, service_config

pytestmark = pytest.mark.apiserver


async def _true(value: bool) -> bool:
    return value


async def _create_pod(kube: Kube, name: str, labels: dict[str, str] | None = None) -> None:
    pod = api_pod("nvidia-dcgm-exporter", name, "node-00001")
    spec = pod["spec"]
    body = {
        "metadata": {"name": name, "labels": labels or {"app": "x"}},
        "spec": {
            "nodeName": "node-00001",
            "containers": [
                {"name": c["name"], "image": c["image"], "env": c["env"]}
                for c in spec["containers"]
            ],
        },
    }
    await kube.core.create_namespaced_pod(kube.ns, body)


class Spy:
    """An event handler that counts the changes the cache hands out (adds, deletes,
    updates to another object) apart from the replays of a re-list (an update handing
    out the very object held), and the query of every GET the cache sends."""

    def __init__(self, cache: Cache) -> None:
        self.changes = 0
        self.replays = 0
        self.queries: list[dict[str, str]] = []
        real = cache._get

        async def get(params: dict[str, str], **kw: Any) -> Any:
            self.queries.append(dict(params))
            return await real(params, **kw)

        cache._get = get  # type: ignore[method-assign]
        cache.add_handler(self)

    def on_add(self, new: Any) -> None:
        self.changes += 1

    def on_update(self, old: Any, new: Any) -> None:
        if old is new:
            self.replays += 1
        else:
            self.changes += 1

    def on_delete(self, old: Any) -> None:
        self.changes += 1


def pods_cache(kube: Kube, *, page_size: int = 500) -> tuple[Cache, Spy]:
    cache = Cache(
        kube.api,
        Resource("", "v1", "pods", "Pod", namespace=kube.ns, project=pod_fields),
        page_size=page_size,
    )
    return cache, Spy(cache)


async def test_a_list_is_read_in_pages_and_every_object_projected(kube: Kube) -> None:
    for i in range(5):
        await _create_pod(kube, f"p{i}")
    cache, spy = pods_cache(kube, page_size=2)
    await cache.relist()
    # Three pages of at most two, the later ones by continue token.
    assert [q.get("limit") for q in spy.queries] == ["2", "2", "2"]
    assert [bool(q.get("continue")) for q in spy.queries] == [False, True, True]
    live = (await raw_request(kube.api, "GET", f"/api/v1/namespaces/{kube.ns}/pods"))["items"]
    assert len(live) == 5 and all(p["spec"].get("containers") for p in live)
    for pod in live:
        pod.setdefault("apiVersion", "v1")
        pod.setdefault("kind", "Pod")
    by_name = {p["metadata"]["name"]: p for p in live}
    cached = cache.items()
    assert [p["metadata"]["name"] for p in cached] == [f"p{i}" for i in range(5)]
    for pod in cached:
        # Exactly what planning reads: no containers, no managedFields, no uid.
        assert pod == pod_fields(by_name[pod["metadata"]["name"]])
        assert "containers" not in pod["spec"] and "managedFields" not in pod["metadata"]
    assert cache.synced.is_set() and spy.changes == 5  # five adds


async def test_a_relist_decides_on_resource_versions(kube: Kube) -> None:
    await _create_pod(kube, "a")
    await _create_pod(kube, "b")
    cache, spy = pods_cache(kube)
    await cache.relist()
    assert (spy.changes, spy.replays) == (2, 0)
    await cache.relist()  # nothing changed: each object handed out again as it was
    assert (spy.changes, spy.replays) == (2, 2) and cache.relists == 2
    # A change the projection drops still changes the resourceVersion: an update.
    await kube.core.patch_namespaced_pod("a", kube.ns, {"metadata": {"annotations": {"x": "1"}}})
    await cache.relist()
    assert (spy.changes, spy.replays) == (3, 3)
    await kube.core.delete_namespaced_pod("b", kube.ns, grace_period_seconds=0)
    await cache.relist()
    assert (spy.changes, spy.replays) == (4, 4)
    assert [p["metadata"]["name"] for p in cache.items()] == ["a"]


async def test_a_relist_keeps_the_cached_objects_of_unchanged_versions(kube: Kube) -> None:
    """A re-list of an unchanged world keeps the very objects it holds (one store, not a
    second projected copy), handed out again as replays; a changed object is replaced, a
    deleted one is gone."""
    for name in ("a", "b", "c"):
        await _create_pod(kube, name)
    cache, spy = pods_cache(kube, page_size=2)
    await cache.relist()
    before = {p["metadata"]["name"]: p for p in cache.items()}
    await cache.relist()
    after = {p["metadata"]["name"]: p for p in cache.items()}
    assert all(after[n] is before[n] for n in ("a", "b", "c"))
    assert (spy.changes, spy.replays) == (3, 3) and cache.relists == 2
    await kube.core.patch_namespaced_pod("a", kube.ns, {"metadata": {"labels": {"app": "y"}}})
    await kube.core.delete_namespaced_pod("c", kube.ns, grace_period_seconds=0)
    await cache.relist()
    now = {p["metadata"]["name"]: p for p in cache.items()}
    assert sorted(now) == ["a", "b"] and (spy.changes, spy.replays) == (5, 4)
    assert now["a"] is not before["a"] and now["a"]["metadata"]["labels"] == {"app": "y"}
    assert now["b"] is before["b"]


async def test_watch_events_are_projected_and_dropped_fields_wake_nobody(kube: Kube) -> None:
    cache, spy = pods_cache(kube)
    stop = asyncio.Event()
    task = asyncio.ensure_future(cache.run(stop))
    try:
        await eventually(lambda: _true(cache.synced.is_set()), timeout=15)
        await _create_pod(kube, "w", {"app": "w"})
        await eventually(lambda: _true(len(cache.items()) == 1), timeout=15)
        [pod] = cache.items()
        assert "containers" not in pod["spec"] and pod["spec"]["nodeName"] == "node-00001"
        changes = spy.changes
        # An annotation (not read by planning) changes: the cache, as projected, does not.
        await kube.core.patch_namespaced_pod(
            "w", kube.ns, {"metadata": {"annotations": {"a": "1"}}}
        )
        # A label change afterwards arrives in order; by then the annotation was seen.
        await kube.core.patch_namespaced_pod("w", kube.ns, {"metadata": {"labels": {"app": "v"}}})
        await eventually(
            lambda: _true(cache.items()[0]["metadata"]["labels"] == {"app": "v"}), timeout=15
        )
        assert spy.changes == changes + 1
        assert "annotations" not in cache.items()[0]["metadata"]
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def _watches(cp: ControlPlane, resource: str) -> int:
    """Watches of ``resource`` open on the API server now (its own gauge)."""
    status, text = cp.request("GET", "/metrics")
    assert status == 200, text
    total = 0
    for line in str(text).splitlines():
        if line.startswith("apiserver_longrunning_requests{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            if labels.get("verb") == "WATCH" and labels.get("resource") == resource:
                total += int(float(line.rsplit(" ", 1)[1]))
    return total


async def test_both_controllers_share_one_cache_per_resource(
    control_plane: ControlPlane, kube: Kube
) -> None:
    """DaemonSets and ClusterPolicies are read by both controllers: one list, one watch and
    one copy (projected) for the two, and a change still wakes each of them."""
    before = {r: _watches(control_plane, r) for r in ("daemonsets", "clusterpolicies")}
    config = service_config(control_plane, kube.ns, upgrade_controller=True)
    async with running(config) as svc:
        assert svc.controller is not None and svc.upgrade is not None
        await eventually(lambda: _true(svc.ready()), timeout=30)
        ds = svc.controller.caches["daemonsets"]
        assert ds is svc.upgrade.caches.daemonsets
        assert svc.controller.caches["clusterpolicies"] is svc.upgrade.caches.cluster_policies
        await eventually(
            lambda: _true(
                {r: _watches(control_plane, r) - before[r] for r in before}
                == {"daemonsets": 1, "clusterpolicies": 1}
            ),
            timeout=15,
        )

        def ours(d: dict[str, Any]) -> bool:
            # The shared cache is cluster-wide: other tests' DaemonSets are in it too.
            meta = d["metadata"]
            return bool(meta["name"] == "nvidia-dcgm" and meta["namespace"] == kube.ns)

        # A DaemonSet change reaches both: one cache, a new snapshot for each reader.
        snapshot = svc.upgrade.caches.daemonsets.items()  # the same tuple until a change
        await kube.apps.create_namespaced_daemon_set(
            kube.ns,
            {
                "metadata": {"name": "nvidia-dcgm"},
                "spec": {
                    "selector": {"matchLabels": {"app": "nvidia-dcgm"}},
                    "template": {
                        "metadata": {"labels": {"app": "nvidia-dcgm"}},
                        "spec": {"containers": [{"name": "c", "image": "i"}]},
                    },
                },
            },
        )
        await eventually(
            lambda: _true(
                any(ours(d) for d in ds.items())
                and svc.upgrade.caches.daemonsets.items() is not snapshot
            ),
            timeout=15,
        )
        [cached] = [d for d in ds.items() if ours(d)]
        assert cached["spec"]["template"]["spec"] == {}  # containers dropped


async def test_an_expired_continue_token_starts_the_list_over(kube: Kube) -> None:
    """The API server answers 410 to a continue token older than its compaction window:
    the list starts over (once) instead of failing the cache."""
    for i in range(3):
        await _create_pod(kube, f"e{i}")
    cache, spy = pods_cache(kube, page_size=2)
    real = cache._get
    expired = [False]

    async def get(params: dict[str, str], **kw: Any) -> Any:
        if params.get("continue") and not expired[0]:
            expired[0] = True
            exc = ApiException(status=410, reason="Expired")
            exc.body = '{"reason": "Expired"}'
            raise exc
        return await real(params, **kw)

    cache._get = get  # type: ignore[method-assign]
    await cache.relist()
    assert expired[0] and cache.synced.is_set()
    assert [p["metadata"]["name"] for p in cache.items()] == ["e0", "e1", "e2"]
    # Sent on: the first page, then (the expired continue refused) the list from its start.
    assert [bool(q.get("continue")) for q in spy.queries] == [False, False, True]
