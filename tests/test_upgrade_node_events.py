"""Node events reach the upgrade controller as events (issue 21, issue 22): with 5,000
cached nodes, one node's label change plans that node only, and nothing iterates a node
cache on the way (counted: calls, not time).

The controller runs on its real caches, run by a Manager as the service runs it; only the
API is left out: the caches are filled as a list fills them (``testenv.caches.fill``) and
the change comes through ``watch_once`` from a stream of one watch event, as the API
server sends it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from shared_svc.config import Config
from shared_svc.controllers.upgrade import reconciler as controller_module
from shared_svc.controllers.upgrade.reconciler import UpgradeReconciler
from shared_svc.k8s.events import Report
from shared_svc.k8s.objects import K8sObject
from shared_svc.kube.reflector import Cache
from shared_svc.runtime.controller import controller_for
from shared_svc.upgrade import record
from shared_svc.upgrade.planner import plan_node
from shared_svc.upgrade.record import record_annotation_key
from shared_svc.upgrade.settings import UpgradeSettings
from testenv import upgrade_examples as ex
from tests.kube import eventually
from tests.parts import managed
from tests.test_cache_events import fill as _fill
from tests.test_cache_events import one_event as _stream
from tests.test_upgrade_controller import events_of, queued

NODES = 5_000
PARKED = 100  # the first nodes are parked too: in both node caches


class Recorder:
    async def emit(self, report: Report) -> bool:
        return True


class CountingStore(dict[Any, Any]):
    """A cache's store that counts every pass over it."""

    passes = 0

    def __iter__(self) -> Any:
        CountingStore.passes += 1
        return super().__iter__()

    def keys(self) -> Any:
        CountingStore.passes += 1
        return super().keys()

    def values(self) -> Any:
        CountingStore.passes += 1
        return super().values()

    def items(self) -> Any:
        CountingStore.passes += 1
        return super().items()


async def _true(value: bool) -> bool:
    return value


def no() -> bool:
    return False


def counted_plans(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the nodes the controller plans from now on, in order."""
    planned: list[str] = []
    real_plan = controller_module.plan_node

    def plan_node(node: K8sObject, *args: Any, **kwargs: Any) -> Any:
        planned.append(node["metadata"]["name"])
        return real_plan(node, *args, **kwargs)

    monkeypatch.setattr(controller_module, "plan_node", plan_node)
    return planned


async def test_one_label_change_among_5000_nodes_plans_that_node_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    io = ex.FakeUpgradeIO([], [])  # no pods; the caches are filled here
    planned = counted_plans(monkeypatch)
    controller = UpgradeReconciler(
        Config(upgrade_controller=True), Recorder(), caches=io.caches, io=io, is_leader=no
    )
    state_cache, parked_cache = controller.caches.nodes
    nodes = [
        ex.node(f"node-{i:05}", state="upgrade-done", parked=i < PARKED, resource_version=str(i))
        for i in range(1, NODES + 1)
    ]
    _fill(state_cache, nodes)
    _fill(parked_cache, nodes[: PARKED - 1])
    async with managed(controller_for(controller).runnables(), is_leader=no):
        # The first lists: every node once (a parked node's second copy is no change).
        await eventually(lambda: _true(controller.reconciles == NODES))
        assert sorted(planned) == sorted(n["metadata"]["name"] for n in nodes)
        planned.clear()
        assert isinstance(state_cache, Cache) and isinstance(parked_cache, Cache)
        for cache in (state_cache, parked_cache):
            cache._items = CountingStore(cache._items)
        CountingStore.passes = 0
        events_before = events_of(controller)[0]

        # One node, upgrading and parked, gets a label from someone else: both caches
        # bring its new version, one after the other.
        changed = ex.node(
            "node-00042",
            state="upgrade-done",
            parked=True,
            labels={"example.com/team": "a"},
            resource_version="5001",
        )
        for cache in (state_cache, parked_cache):
            monkeypatch.setattr(
                cache,
                "_open_watch",
                lambda params, timeout: _stream({"type": "MODIFIED", "object": changed}),
            )
            assert await cache.watch_once() == "timeout"
            # The pass of the first copy is over before the second copy arrives.
            await eventually(lambda: _true(controller.reconciles == NODES + 1))
        await asyncio.sleep(0.1)  # a second pass would have been handed out by now
        assert planned == ["node-00042"]
        assert controller.reconciles == NODES + 1
        assert events_of(controller)[0] - events_before == 2
        assert CountingStore.passes == 0, "a node cache was iterated for one event"


async def test_the_resync_enqueues_every_cached_node_once() -> None:
    """The resync (``trigger``) replays the caches, as client-go's does: before any pass,
    every node once, a node in both caches once; it is the one path that reads the whole
    node cache."""
    io = ex.FakeUpgradeIO([], [])
    controller = UpgradeReconciler(
        Config(upgrade_controller=True), Recorder(), caches=io.caches, io=io, is_leader=no
    )
    state_cache, parked_cache = controller.caches.nodes
    nodes = [ex.node(f"n{i}", state="upgrade-done", parked=i < 3) for i in range(10)]
    _fill(state_cache, nodes)
    _fill(parked_cache, nodes[:3])
    controller_for(controller).enqueue_all()  # the resync
    assert queued(controller) == 10


PERIOD = 0.3  # upgrade_resync_seconds of the next test
AT_REST = 2_000


async def test_the_resync_follows_the_nodes_in_an_upgrade_not_the_fleet_at_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 33: gpu-operator leaves every GPU node ``upgrade-done``. Among 2,000 such nodes
    and a few that are in an upgrade or hold something of ours, the resync's passes are
    the few's. What the resync guarantees holds: a node whose cached copy changed without
    its event is planned within one period, and a shown node that left the caches is
    dropped."""
    planned = counted_plans(monkeypatch)
    freed = plan_node(
        ex.node("recorded", state="cordon-required"),
        [ex.declared_pod("a", node_name="recorded")],
        [],
        UpgradeSettings(),
        now=1_700_000_000.0,
    )
    assert freed.record is not None
    few = [
        ex.node("upgrading-1", state="cordon-required"),
        ex.node("upgrading-2", state="upgrade-required", annotations={}),
        ex.node("parked", state="upgrade-done", parked=True),
        ex.node(
            "recorded",
            state="validation-required",
            annotations={record_annotation_key("gpu"): record.encode(freed.record)},
        ),
        ex.node(
            "unreadable", state="upgrade-done", annotations={record_annotation_key("gpu"): "x"}
        ),
    ]
    # upgrade-required with nothing of ours is at rest too: only four of the five follow.
    following = {"upgrading-1", "parked", "recorded", "unreadable"}
    rest = [ex.node(f"node-{i:05}", state="upgrade-done") for i in range(AT_REST)]
    io = ex.FakeUpgradeIO([*rest, *few], [])
    controller = UpgradeReconciler(
        Config(upgrade_controller=True, upgrade_resync_seconds=PERIOD),
        Recorder(),
        caches=io.caches,
        io=io,
        is_leader=no,
    )
    state_cache, _ = controller.caches.nodes
    assert isinstance(state_cache, Cache)
    async with managed(controller_for(controller).runnables(), is_leader=no):
        await eventually(lambda: _true(controller.reconciles >= AT_REST + len(few)))
        planned.clear()
        # A resync has looked at every node that can change (however slow the machine),
        # and two more periods pass.
        await eventually(lambda: _true(following <= set(planned)), timeout=30)
        await asyncio.sleep(2 * PERIOD)
        assert set(planned) == following, sorted(set(planned) - following)[:5]

        # A node at rest leaves rest, and its event is lost: the cache holds it all the same.
        lost = ex.node("node-00007", state="cordon-required", resource_version="9")
        gone = ("", "node-00008")
        items = {**state_cache._items, ("", "node-00007"): state_cache.resource.kept(lost)}
        del items[gone]  # and another leaves the caches unseen
        state_cache._items = items
        assert "node-00008" in controller.status()["nodes"]
        planned.clear()
        await eventually(lambda: _true("node-00007" in planned), timeout=10 * PERIOD)
        status = controller.status()
        assert status["nodes"]["node-00007"]["state"] == "cordon-required"
        await eventually(
            lambda: _true("node-00008" not in controller.status()["nodes"]), timeout=10 * PERIOD
        )
        assert set(planned) <= {*following, "node-00007"}
