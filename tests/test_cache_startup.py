"""Start-up lists (issue 22), on the real API server: a cache's paged list is served from
the API server's watch cache, not from etcd (kube-apiserver 1.36 serves a consistent list,
``resourceVersion`` unset, from its cache: ConsistentListFromCache and cache snapshots for
the continue pages), so the lists of both controllers at start-up fetch no object from
etcd (one revision read per list: what makes the list consistent)."""

from __future__ import annotations

import re

import pytest

from shared_svc.kube.reflector import Cache, Resource
from shared_svc.reconcile.selection import pod_fields
from testenv import ControlPlane
from tests.svc import Kube

pytestmark = pytest.mark.apiserver


def list_counts(cp: ControlPlane, resource: str) -> dict[str, int]:
    """How many lists the API server served from its watch cache and from etcd (storage)."""
    status, text = cp.request("GET", "/metrics")
    assert status == 200, text
    out = {"cache": 0, "storage": 0, "storage_objects": 0}
    for line in str(text).splitlines():
        for name, where in (
            ("apiserver_cache_list_total{", "cache"),
            ("apiserver_storage_list_total{", "storage"),
            ("apiserver_storage_list_fetched_objects_total{", "storage_objects"),
        ):
            if line.startswith(name):
                labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
                if resource in (
                    labels.get("resource_prefix", "").strip("/"),
                    labels.get("resource", ""),
                ):
                    out[where] += int(float(line.rsplit(" ", 1)[1]))
    return out


async def test_a_paged_list_is_served_from_the_watch_cache(
    kube: Kube, control_plane: ControlPlane
) -> None:
    for i in range(5):
        await kube.core.create_namespaced_pod(
            kube.ns,
            {"metadata": {"name": f"p{i}"}, "spec": {"containers": [{"name": "c", "image": "x"}]}},
        )
    cache = Cache(
        kube.api,
        Resource("", "v1", "pods", "Pod", namespace=kube.ns, project=pod_fields),
        page_size=2,
    )
    before = list_counts(control_plane, "pods")
    await cache.relist()
    after = list_counts(control_plane, "pods")
    assert len(cache.items()) == 5
    # Three pages (limit 2), each served from the watch cache; etcd sends no object (the
    # one storage read of a consistent list is its revision: no objects fetched).
    assert after["cache"] - before["cache"] == 3
    assert after["storage_objects"] == before["storage_objects"]
