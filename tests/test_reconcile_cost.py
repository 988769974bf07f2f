"""A reconcile costs what changed, not what is cached (issue 22): the caches hand out the
very same tuple while nothing changes (a store, and the union of the operator-pod cache,
a pod moving between its parts included), ``get`` on the union reads one key, and a
reconcile after a ClusterPolicy change neither passes over the cached pods nor indexes
them again, while its plan is the plan from scratch (counted: calls and passes, not time).

The Services controller runs on its real caches; only the API is left out: the caches
are filled as a list fills them (``testenv.caches.fill``) and changes come through
``watch_once`` from a stream of one watch event, as the API server sends it."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest

from shared_svc.config import Config
from shared_svc.controllers.services.reconciler import KEY, ServicesReconciler
from shared_svc.k8s.events import Report
from shared_svc.k8s.objects import K8sObject
from shared_svc.k8s.selectors import Selector
from shared_svc.kube.reflector import Cache
from shared_svc.kube.union import UnionCache
from shared_svc.reconcile import selection
from shared_svc.reconcile.planner import plan
from tests import worlds
from tests.parts import services_controller
from tests.test_cache_events import fill, one_event, pods_cache
from tests.test_cache_events import pod as plain_pod
from tests.test_reconcile_hold import add_cluster_policy, gpu_cluster_running, held_messages
from tests.test_upgrade_node_events import CountingStore

NODES = 20


class Recorder:
    async def emit(self, report: Report) -> bool:
        return True


class NoWriter:
    """A standby's writer: it plans, never writes."""

    def __init__(self) -> None:
        self.writes: dict[str, int] = {}


def _versioned(objects: list[K8sObject], first: int) -> list[K8sObject]:
    for i, obj in enumerate(objects):
        obj["metadata"]["resourceVersion"] = str(first + i)
    return objects


def standby() -> ServicesReconciler:
    """The Services controller as a standby (it plans, never writes) on its real caches,
    made but not run: no request is sent (also ``benchmarks/bench_reconcile.py``'s)."""
    return services_controller(Config(), writer=NoWriter(), leader=False)


def _controller() -> ServicesReconciler:
    ctrl = standby()
    pods = _versioned(
        [
            worlds.pod(app, f"{app}-{n}", node=f"node-{n}", common=n % 7 != 0)
            for app in worlds.APPS.values()
            for n in range(NODES)
        ],
        1000,
    )
    fill(_union(ctrl), pods)  # each pod in the part of its DCGM app
    fill(
        ctrl.caches["daemonsets"],
        _versioned([worlds.daemonset(app, desired=NODES) for app in worlds.APPS.values()], 10),
    )
    fill(ctrl.caches["clusterpolicies"], _versioned([worlds.cluster_policy()], 1))
    fill(ctrl.caches["gpuclusters"], _versioned([worlds.gpu_cluster()], 2))
    fill(ctrl.caches["services"], [])
    return ctrl


async def _watch(monkeypatch: pytest.MonkeyPatch, cache: Cache, event: K8sObject) -> None:
    """``cache`` brings one watch event, as the API server sends it."""
    monkeypatch.setattr(cache, "_open_watch", lambda params, timeout: one_event(event))
    assert await cache.watch_once() == "timeout"


def _union(ctrl: ServicesReconciler) -> UnionCache:
    union = ctrl.caches["pods"]
    assert isinstance(union, UnionCache)
    return union


def _counted(union: UnionCache) -> None:
    for part in union.parts:
        part._items = CountingStore(part._items)
    union.items()  # the store was replaced: read once
    CountingStore.passes = 0


def test_an_unchanged_store_hands_out_the_same_tuple_and_a_change_a_new_one() -> None:
    cache = pods_cache()
    fill(cache, [plain_pod("b", "2"), plain_pod("a", "1")])
    cache._items = CountingStore(cache._items)
    items, keys = cache.items(), cache.cached_keys()
    assert [p["metadata"]["name"] for p in items] == ["a", "b"]
    assert keys == (("ns", "a"), ("ns", "b"))
    CountingStore.passes = 0
    assert cache.items() is items and cache.cached_keys() is keys
    assert CountingStore.passes == 0, "an unchanged store was passed over"
    fill(cache, [plain_pod("a", "1"), plain_pod("c", "3")])
    assert [p["metadata"]["name"] for p in cache.items()] == ["a", "c"]
    assert cache.cached_keys() == (("ns", "a"), ("ns", "c"))


async def test_a_watch_event_is_a_new_tuple_and_a_change_the_projection_drops_is_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = pods_cache()
    fill(cache, [plain_pod("a", "1"), plain_pod("b", "2")])
    before = cache.items()
    dropped_only = plain_pod("a", "3", app="v1")
    dropped_only["spec"]["containers"][0]["image"] = "j"  # a field the projection drops
    for event, same in (
        ({"type": "MODIFIED", "object": dropped_only}, True),
        ({"type": "MODIFIED", "object": plain_pod("a", "4", app="y")}, False),
        ({"type": "ADDED", "object": plain_pod("c", "5")}, False),
        ({"type": "DELETED", "object": plain_pod("b", "6")}, False),
    ):
        await _watch(monkeypatch, cache, event)
        after = cache.items()
        assert (after is before) == same
        assert after == tuple(cache._items[k] for k in sorted(cache._items))
        before = after
    assert [(p["metadata"]["name"], p["metadata"]["labels"]["app"]) for p in before] == [
        ("a", "y"),
        ("c", "v5"),
    ]


async def test_the_union_hands_out_the_same_tuple_until_a_part_changes_a_move_included(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    union = _union(_controller())
    _counted(union)
    items, keys = union.items(), union.cached_keys()
    assert union.items() is items and union.cached_keys() is keys
    assert CountingStore.passes == 0, "an unchanged union was merged again"
    name = "nvidia-dcgm-3"
    old = union.get(name, worlds.NS)
    assert old is not None and old in items
    assert CountingStore.passes == 0, "get merged the parts"

    # The pod moves to the common-label part (its newer copy arrives there first) ...
    moved = copy.deepcopy(old)
    moved["metadata"]["resourceVersion"] = "5000"
    moved["metadata"]["labels"]["app"] = "someone-else"
    await _watch(monkeypatch, union.parts[4], {"type": "ADDED", "object": moved})
    CountingStore.passes = 0
    newer = union.get(name, worlds.NS)
    assert CountingStore.passes == 0, "get merged the changed parts"
    assert newer is not None and newer["metadata"]["labels"]["app"] == "someone-else"
    in_both = union.items()
    assert in_both is not items and len(in_both) == len(items)
    assert newer in in_both and old not in in_both
    assert union.cached_keys() is keys or union.cached_keys() == keys

    # ... then leaves the first one.
    gone = copy.deepcopy(old)
    gone["metadata"]["resourceVersion"] = "5001"
    await _watch(monkeypatch, union.parts[0], {"type": "DELETED", "object": gone})
    moved_items = union.items()
    assert moved_items is not in_both and moved_items == in_both
    assert union.get(name, worlds.NS) is newer
    assert union.items() is moved_items


async def test_a_reconcile_after_a_cluster_policy_change_does_not_pass_over_the_pods(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ctrl = _controller()
    indexed: list[int] = []
    build = selection.build_pod_index

    def counting(pods: Any, namespace: str) -> selection.PodIndex:
        indexed.append(len(pods))
        return build(pods, namespace)

    monkeypatch.setattr(selection, "build_pod_index", counting)
    selection.pod_index.clear()
    _counted(_union(ctrl))
    assert (await ctrl.reconcile(KEY)).result == "success"
    assert ctrl.last_reconcile["result"] == "standby"
    assert indexed == [4 * NODES]
    first = ctrl.last_plan

    # A ClusterPolicy change (as in the fleet benchmark): no pod is touched.
    changed = worlds.cluster_policy(
        spec={"dcgmExporter": {"service": {"internalTrafficPolicy": "Cluster"}}}
    )
    changed["metadata"]["resourceVersion"] = "3000"
    cps = ctrl.caches["clusterpolicies"]
    assert isinstance(cps, Cache)
    await _watch(monkeypatch, cps, {"type": "MODIFIED", "object": changed})
    assert (await ctrl.reconcile(KEY)).result == "success"
    ctrl.status()
    assert indexed == [4 * NODES], "the pods were indexed again for a ClusterPolicy change"
    assert CountingStore.passes == 0, "a pod cache was passed over for a ClusterPolicy change"
    assert ctrl.last_plan != first  # the change is planned
    settings = ctrl._config.core_settings(service_monitor_served=False)
    selection.pod_index.clear()
    assert ctrl.last_plan == plan(ctrl.snapshot(), settings)  # the plan from scratch
    assert len(indexed) == 2
    second = ctrl.last_plan

    # A pod change is indexed again, and planned as from scratch.
    straggler = worlds.pod("nvidia-dcgm", "nvidia-dcgm-1", node="node-1", common=False)
    straggler["metadata"]["resourceVersion"] = "3001"
    part = _union(ctrl).parts[0]
    await _watch(monkeypatch, part, {"type": "MODIFIED", "object": straggler})
    assert (await ctrl.reconcile(KEY)).result == "success"
    assert len(indexed) == 3
    kept = ctrl.last_plan
    assert kept != second  # one more straggler
    selection.pod_index.clear()
    assert kept == plan(ctrl.snapshot(), settings)


def test_a_held_selector_counts_the_covered_nodes_once_while_the_pods_stay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hold asks which nodes two selectors cover (a pass over the serving pods): asked
    again after a change of the CRs alone, the pods are not passed over again."""
    matched: list[int] = []
    matches = Selector.matches
    monkeypatch.setattr(
        Selector, "matches", lambda self, labels: matched.append(1) or matches(self, labels)
    )
    selection.pod_index.clear()
    held = add_cluster_policy(gpu_cluster_running(["a", "b"]), [])
    settings = Config().core_settings(service_monitor_served=False)
    first = plan(held, settings)
    assert held_messages(first) and matched
    matched.clear()
    changed = worlds.cluster_policy(
        spec={"dcgmExporter": {"enabled": False}, "dcgm": {"enabled": True}}
    )
    cr_only = replace(held, cluster_policies=(changed,))
    assert cr_only.pods is held.pods
    again = plan(cr_only, settings)
    assert held_messages(again) == held_messages(first)
    assert matched == [], "the serving pods were matched again"
    selection.pod_index.clear()
    assert again == plan(cr_only, settings)


def test_the_kept_pod_index_holds_the_pods_own_label_sets_not_a_copy_per_pod() -> None:
    """The index outlives its plan (kept for the next), so it holds no object per pod of
    its own: every full garbage collection passes over what lives long."""
    pods = tuple(
        worlds.pod(app, f"{app}-{n}", node=f"node-{n}", common=n % 2 == 0)
        for app in worlds.APPS.values()
        for n in range(5)
    )
    index = selection.build_pod_index(pods, worlds.NS)
    assert len(index.serving_labels) == len(pods)
    assert all(
        labels is pod["metadata"]["labels"]
        for labels, pod in zip(index.serving_labels, pods, strict=True)
    )
    odd = worlds.pod("nvidia-dcgm", "odd", node="node-0")
    odd["metadata"]["labels"]["n"] = 1  # not text: left out, as labels_of does
    (labels,) = selection.build_pod_index((odd,), worlds.NS).serving_labels
    assert "n" not in labels and labels["app"] == "nvidia-dcgm"
