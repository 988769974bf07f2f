"""The operator-pod cache holds the DCGM pods only (issue 22), on the real API server: the
union of the four DCGM apps (``app=`` each) and the two common labels, as six disjoint
list+watches merged into one store (``shared_svc.controllers.services.caches.operator_pods``); the other
operands' pods are neither listed nor kept, and planning over the cache is planning over
every pod of the namespace."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from shared_svc.config import Config
from shared_svc.controllers import shared_caches
from shared_svc.controllers.services import caches
from shared_svc.kube.union import UnionCache
from shared_svc.kube.writer import raw_request
from shared_svc.reconcile.model import Settings, World
from shared_svc.reconcile.planner import plan
from shared_svc.reconcile.selection import pod_fields
from tests import worlds
from tests.kube import eventually
from tests.parts import managed
from tests.svc import Kube

pytestmark = pytest.mark.apiserver

DCGM, EXPORTER = "nvidia.com/gpu-operator.dcgm", "nvidia.com/gpu-operator.dcgm-exporter"
PODS: dict[str, dict[str, str]] = {
    # the four DCGM apps (the gate's pods), with or without a common label
    "dcgm-0": {"app": "nvidia-dcgm", DCGM: "true"},
    "exporter-0": {"app": "nvidia-dcgm-exporter"},
    "dcgm-dra-0": {"app": "nvidia-dcgm-dra", DCGM: "true"},
    "exporter-dra-0": {"app": "nvidia-dcgm-exporter-dra", EXPORTER: "true"},
    # a common label alone selects a pod for the hold, whatever its app
    "common-dcgm": {"app": "someone-else", DCGM: "true"},
    "common-exporter": {EXPORTER: "true"},
    "common-both": {DCGM: "true", EXPORTER: "true"},
    # the other operands: most of the namespace, read by no rule
    "driver-0": {"app": "nvidia-driver-daemonset"},
    "gfd-0": {"app": "gpu-feature-discovery", DCGM: "false"},
    "toolkit-0": {"app": "nvidia-container-toolkit-daemonset"},
}
WATCHED = {name for name in PODS if not name.startswith(("driver", "gfd", "toolkit"))}


async def _create_pods(kube: Kube) -> None:
    for i, (name, labels) in enumerate(sorted(PODS.items())):
        body = {
            "metadata": {"name": name, "labels": labels},
            "spec": {
                "nodeName": f"node-{i % 3}",
                "containers": [{"name": "c", "image": "registry.invalid/x:1"}],
            },
        }
        await kube.core.create_namespaced_pod(kube.ns, body)
        # Ready, as a kubelet would report it (the hold counts ready pods).
        await kube.core.patch_namespaced_pod_status(
            name,
            kube.ns,
            {"status": {"conditions": [{"type": "Ready", "status": "True"}]}},
        )


async def _true(value: bool) -> bool:
    return value


def _names(cache: Any) -> set[str]:
    return {p["metadata"]["name"] for p in cache.items()}


def _disjoint(cache: UnionCache) -> bool:
    """Each kept pod in one part's store only."""
    stored = [key for part in cache.parts for key in part._items]
    return len(stored) == len(set(stored))


async def test_the_pod_cache_holds_the_dcgm_pods_and_plans_as_every_pod_does(kube: Kube) -> None:
    await _create_pods(kube)
    config = Config(namespace=kube.ns)
    registry = shared_caches.registry(kube.api, config)
    cache = registry.cache(caches.declare(config)["pods"])
    assert isinstance(cache, UnionCache) and len(cache.parts) == 6
    async with managed(registry.runnables()):
        await eventually(lambda: _true(cache.synced.is_set()), timeout=30)
        assert _names(cache) == WATCHED
        assert _disjoint(cache) and sum(len(part._items) for part in cache.parts) == len(WATCHED)
        # The four apps' pods are four lists (read at once), one app each.
        by_part = [{name for _, name in part._items} for part in cache.parts]
        assert by_part[:4] == [{"dcgm-0"}, {"dcgm-dra-0"}, {"exporter-0"}, {"exporter-dra-0"}]

        # The plan over the cache is the plan over every pod of the namespace.
        live = (await raw_request(kube.api, "GET", f"/api/v1/namespaces/{kube.ns}/pods"))["items"]
        assert {p["metadata"]["name"] for p in live} == set(PODS)
        for pod in live:
            pod.setdefault("apiVersion", "v1")
            pod.setdefault("kind", "Pod")
        daemonsets = tuple(
            {**ds, "metadata": {**ds["metadata"], "namespace": kube.ns}}
            for ds in (
                worlds.daemonset(app)
                for app in (
                    "nvidia-dcgm",
                    "nvidia-dcgm-exporter",
                    "nvidia-dcgm-dra",
                    "nvidia-dcgm-exporter-dra",
                )
            )
        )
        whole = World(
            cluster_policies=(worlds.cluster_policy(),),
            daemonsets=daemonsets,
            pods=tuple(pod_fields(p) for p in live),
        )
        settings = Settings(namespace=kube.ns)
        result = plan(replace(whole, pods=cache.items()), settings)
        assert result == plan(whole, settings) and result.objects

        # Watches follow a pod into and out of the union, and across its parts.
        await kube.core.patch_namespaced_pod(
            "driver-0", kube.ns, {"metadata": {"labels": {EXPORTER: "true"}}}
        )
        await eventually(lambda: _true("driver-0" in _names(cache)), timeout=30)
        await kube.core.patch_namespaced_pod(
            "common-both", kube.ns, {"metadata": {"labels": {"app": "nvidia-dcgm"}}}
        )
        await kube.core.patch_namespaced_pod(
            "exporter-0", kube.ns, {"metadata": {"labels": {"app": "nvidia-driver-daemonset"}}}
        )
        # exporter-0 leaves the union; common-both moves from the common-label part to the
        # app part (its old part drops it on its own watch, so wait for both).
        expected = (WATCHED | {"driver-0"}) - {"exporter-0"}
        await eventually(lambda: _true(_names(cache) == expected and _disjoint(cache)), timeout=30)
        assert (kube.ns, "common-both") in cache.parts[0]._items  # app=nvidia-dcgm
