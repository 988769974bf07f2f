"""The controller loop on an in-process fake of the API: writes, leader gating, dry-run, retries."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import weakref
from typing import Any

import pytest
from pydantic import ValidationError

from shared_svc.config import Config
from shared_svc.controllers.upgrade.io import ForeignKeyError, check_own_keys
from shared_svc.controllers.upgrade.reconciler import UpgradeReconciler
from shared_svc.kube.recorder import EventPublisher
from shared_svc.runtime.controller import controller_for
from shared_svc.runtime.source import Event, NewestVersions
from shared_svc.upgrade.node_plan import NodeChanged, NodePatch
from testenv import upgrade_examples as ex
from tests.kube import eventually
from tests.parts import managed
from tests.test_upgrade_cli import STATUS_NODE_KEYS

PARKED = "nvidia.com/gpu-driver-upgrade.parked"


Recorder = ex.ReportRecorder


def make(
    io: ex.FakeUpgradeIO, *, leader: bool = True, **config: object
) -> tuple[UpgradeReconciler, Recorder]:
    recorder = Recorder()
    cfg = Config(upgrade_controller=True, **config)  # type: ignore[arg-type]
    # A publisher that writes: ``recorder`` holds every Event the controller hands the
    # publisher, dry-run too (the service's publisher, dry-run, logs them instead).
    events = EventPublisher(recorder)
    controller = UpgradeReconciler(
        cfg, events, caches=io.caches, io=io, is_leader=lambda: leader, clock=lambda: 1000.0
    )
    return controller, recorder


def queued(controller: UpgradeReconciler) -> float:
    """The nodes waiting in the controller's work queue (``workqueue_depth``)."""
    registry = controller.metrics.registry
    return registry.get_sample_value("workqueue_depth", {"name": "upgrade"}) or 0.0


def events_of(controller: UpgradeReconciler) -> tuple[int, int]:
    """Node events handed to the controller, and how many of them enqueued the node."""
    handlers = controller.node_events
    return sum(h.events for h in handlers), sum(h.enqueued for h in handlers)


def gauges_follow_status(controller: UpgradeReconciler) -> None:
    """The metrics' counts, kept as each status changes, are those of the statuses shown."""
    controller.metrics.publish(gate=None, now=1000.0, eviction_timeout=600.0)
    registry = controller.metrics.registry
    shown = controller.status()
    for phase, count in shown["phases"].items():
        assert registry.get_sample_value("shared_svc_upgrade_nodes", {"phase": phase}) == count
    pending = sum(len(n["pending"]) for n in shown["nodes"].values())
    assert registry.get_sample_value("shared_svc_upgrade_pending_pods") == pending


async def test_reconcile_writes_plan_and_emits_after_writes() -> None:
    io = ex.FakeUpgradeIO([ex.node(state="cordon-required")], [ex.declared_pod("a")])
    controller, recorder = make(io)
    requeue = (await controller.reconcile("node-1")).requeue_after
    assert [type(w).__name__ for w in io.writes] == ["NodePatch", "PodAction"]
    assert io.nodes["node-1"]["metadata"]["labels"][PARKED] == "true"
    assert requeue == 5.0
    assert (await controller.reconcile("node-1")).requeue_after == 5.0 and len(
        io.writes
    ) == 2  # idempotent
    gauges_follow_status(controller)
    io.pods["node-1"] = []
    await controller.reconcile("node-1")
    assert [r.reason for r in recorder.reports] == ["GPUConsumersFreed"]
    status = controller.status()
    assert status["nodes"]["node-1"]["phase"] == "freed" and status["phases"]["freed"] == 1
    gauges_follow_status(controller)


async def test_follower_and_dry_run_write_nothing() -> None:
    """A standby hands no Event to the publisher, dry-run or not (``kube.writer.write_mode``:
    in dry-run the leader alone logs what it would send, as the Services controller does)."""
    for kwargs in ({"leader": False}, {"dry_run": True}, {"leader": False, "dry_run": True}):
        io = ex.FakeUpgradeIO(
            [ex.node(state="cordon-required")],
            [ex.declared_pod("a"), ex.pod("v", runtime_class="nvidia")],
        )
        controller, recorder = make(io, **kwargs)  # type: ignore[arg-type]
        await controller.reconcile("node-1")
        await controller.reconcile("node-1")
        assert io.writes == []
        assert controller.status()["nodes"]["node-1"]["pending"] == ["ml/a"]
        if kwargs.get("dry_run") and kwargs.get("leader", True):
            assert [r.reason for r in recorder.reports] == [
                "GPUConsumersDetected"
            ]  # once, not per pass
        else:
            assert recorder.reports == []


async def test_dry_run_writes_no_event_and_logs_each_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """dry_run means the same for both controllers (docs/operations.md "Dry-run")."""
    io = ex.FakeUpgradeIO(
        [ex.node(state="cordon-required")],
        [ex.declared_pod("a"), ex.pod("v", runtime_class="nvidia")],
    )
    recorder = Recorder()  # a bare recorder: the controller puts it in a dry-run publisher
    cfg = Config(upgrade_controller=True, dry_run=True)
    controller = UpgradeReconciler(cfg, recorder, caches=io.caches, io=io, clock=lambda: 1000.0)
    with caplog.at_level(logging.INFO, logger="shared_svc.kube.events"):
        for _ in range(3):
            await controller.reconcile("node-1")
    assert recorder.reports == [] and io.writes == []
    would = [r for r in caplog.records if r.getMessage() == "dry-run: would emit event"]
    assert [r.__dict__["reason"] for r in would] == ["GPUConsumersDetected"]


async def test_node_gone_forgets_status() -> None:
    io = ex.FakeUpgradeIO([ex.node(state="cordon-required")], [])
    controller, _ = make(io)
    await controller.reconcile("node-1")
    gauges_follow_status(controller)
    io.delete_node("node-1")  # no longer upgrading nor parked: in neither node cache
    assert (await controller.reconcile("node-1")).requeue_after is None
    assert controller.status()["nodes"] == {}
    gauges_follow_status(controller)  # all back to 0


async def test_run_handles_nodes_retries_failures_and_stops() -> None:
    nodes = [ex.node(f"n{i}", state="pod-restart-required") for i in range(5)]
    pods = [ex.declared_pod(f"p{i}", node_name=f"n{i}") for i in range(5)]
    io = ex.FakeUpgradeIO(nodes, pods)
    io.fail_next = [RuntimeError("boom"), NodeChanged("n0")]
    controller, _ = make(io, backoff_base_seconds=0.001, upgrade_workers=3)
    runtime = controller_for(controller)
    async with managed(runtime.runnables()):
        runtime.enqueue_all()
        await eventually(
            lambda: _true(all(PARKED in n["metadata"]["labels"] for n in io.nodes.values()))
        )
    assert all(PARKED in n["metadata"]["labels"] for n in io.nodes.values())
    assert sum(1 for w in io.writes if type(w).__name__ == "PodAction") == 5
    assert controller.status()["errors"] == {}  # the failure was retried and cleared


def test_patches_of_foreign_keys_are_refused() -> None:
    check_own_keys(
        NodePatch(
            "n",
            "1",
            ((PARKED, "true"),),
            (("shared-svc.nvidia.com/gpu-driver-upgrade-freed", "{}"),),
        ),
        "gpu",
    )
    for labels in (
        (("nvidia.com/gpu-driver-upgrade-state", "x"),),
        (("nvidia.com/gpu.deploy.dcgm", "false"),),
    ):
        try:
            check_own_keys(NodePatch("n", "1", labels), "gpu")
        except ForeignKeyError:
            continue
        raise AssertionError(f"{labels} accepted")


async def test_trigger_requeues_every_node_a_pass_can_change() -> None:
    """``a`` is being freed; ``b`` is at rest (``upgrade-done``, nothing of ours) and shown
    idle already, so a pass on it would change nothing (issue 33); ``c`` is at rest but not
    looked at yet."""
    io = ex.FakeUpgradeIO(
        [
            ex.node("a", state="cordon-required"),
            ex.node("b", state="upgrade-done"),
            ex.node("c", state="upgrade-done"),
        ],
        [],
    )
    controller, _ = make(io, leader=False)
    await controller.reconcile("a")
    await controller.reconcile("b")
    controller_for(controller).enqueue_all()  # the resync
    assert queued(controller) == 2


def test_bad_consumer_selector_is_refused_with_the_configuration() -> None:
    # The settings model parses it with the one selector parser (shared_svc.k8s.selectors).
    with pytest.raises(ValidationError, match=r"(?s)upgrade_consumer_selector.*unbalanced"):
        make(ex.FakeUpgradeIO([], []), upgrade_consumer_selector="a in (b")


async def test_stop_finishes_the_node_in_flight() -> None:
    """SIGTERM never cuts a node's writes in half: the node patch and its evictions land."""

    class SlowIO(ex.FakeUpgradeIO):
        started = asyncio.Event()

        async def patch_node(self, patch: NodePatch) -> str:
            self.started.set()
            await asyncio.sleep(0.3)
            return await super().patch_node(patch)

    io = SlowIO([ex.node(state="cordon-required")], [ex.declared_pod("a")])
    controller, _ = make(io)
    async with managed(controller_for(controller).runnables()):  # the first list's add: a pass
        await asyncio.wait_for(io.started.wait(), 5)
    # Stopped (as on SIGTERM) while the node patch was in flight.
    kinds = [type(w).__name__ for w in io.writes]
    assert kinds == ["NodePatch", "PodAction"], kinds


# --- issue 10, items 19 and 20: what the controller logs ---

LOGGER = "shared_svc.upgrade.controller"


def lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


async def test_unknown_state_is_warned_once_per_node_and_value(
    caplog: pytest.LogCaptureFixture,
) -> None:
    io = ex.FakeUpgradeIO(
        [ex.node("a", state="another-future-state"), ex.node("b", state="future-state")], []
    )
    controller, recorder = make(io)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for _ in range(3):
            await controller.reconcile("a")
            await controller.reconcile("b")
        node = copy.deepcopy(io.nodes["a"])
        node["metadata"]["labels"]["nvidia.com/gpu-driver-upgrade-state"] = "future-state"
        io.set_node(node)
        await controller.reconcile("a")
        await controller.reconcile("a")
    warned = lines(caplog, logging.WARNING)
    assert len(warned) == 3, warned
    assert all("UpgradeStateUnknown" in line and "keep" in line for line in warned)
    sent = [(r.reason, r.type, r.regarding.name) for r in recorder.reports]
    assert sent == [("UpgradeStateUnknown", "Warning", n) for n in ("a", "b", "a")]
    assert "another-future-state" in recorder.reports[0].note
    assert controller.status()["nodes"]["a"]["unknownState"] is True
    # The same keys as `shared-svc upgrade status -o json` (tests/test_upgrade_cli.py).
    assert set(controller.status()["nodes"]["a"]) == STATUS_NODE_KEYS


async def test_unknown_state_standby_logs_and_the_leader_sends_the_event() -> None:
    leader = False
    io = ex.FakeUpgradeIO([ex.node(state="future-state")], [])
    recorder = Recorder()
    controller = UpgradeReconciler(
        Config(upgrade_controller=True),
        recorder,
        caches=io.caches,
        io=io,
        is_leader=lambda: leader,
        clock=lambda: 1000.0,
    )
    await controller.reconcile("node-1")
    assert recorder.reports == []  # a standby sends no Event
    leader = True
    await controller.reconcile("node-1")
    await controller.reconcile("node-1")
    assert [r.reason for r in recorder.reports] == ["UpgradeStateUnknown"]


@pytest.mark.parametrize("kwargs", [{"leader": False}, {"dry_run": True}])
async def test_standby_and_dry_run_say_what_they_would_write_once(
    caplog: pytest.LogCaptureFixture, kwargs: dict[str, object]
) -> None:
    io = ex.FakeUpgradeIO([ex.node(state="cordon-required")], [ex.declared_pod("a")])
    controller, _ = make(io, **kwargs)  # type: ignore[arg-type]
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for _ in range(4):  # four polls of the same plan
            await controller.reconcile("node-1")
    info = lines(caplog, logging.INFO)
    assert len(info) == 2, info
    patch_line, evict_line = info
    assert "would patch node" in patch_line and f"label {PARKED}=true" in patch_line
    assert "write record" in patch_line and "resourceVersion" not in patch_line  # not the body
    assert "would evict GPU consumer ml/a" in evict_line
    who = "dry run" if kwargs.get("dry_run") else "standby"
    assert all(line.startswith(who) for line in info)
    debug = lines(caplog, logging.DEBUG)
    assert sum("would patch node" in line for line in debug) == 3  # the repeats
    assert sum("node patch {" in line for line in debug) == 4  # the whole patch: DEBUG only


async def test_refused_eviction_is_said_once_then_at_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    io = ex.FakeUpgradeIO(
        [ex.node(state="cordon-required")], [ex.declared_pod("a")], blocked=frozenset({"ml/a"})
    )
    controller, _ = make(io)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for _ in range(4):
            await controller.reconcile("node-1")
    info = [line for line in lines(caplog, logging.INFO) if "ml/a" in line]
    assert len(info) == 1, info
    assert "eviction of GPU consumer ml/a refused" in info[0] and "retrying" in info[0]
    assert sum("ml/a refused" in line for line in lines(caplog, logging.DEBUG)) == 3


async def test_delete_after_timeout_says_deleted(caplog: pytest.LogCaptureFixture) -> None:
    now = [1000.0]
    io = ex.FakeUpgradeIO(
        [ex.node(state="cordon-required")], [ex.declared_pod("a")], blocked=frozenset({"ml/a"})
    )
    cfg = Config(
        upgrade_controller=True,
        upgrade_eviction_timeout_seconds=10,
        upgrade_delete_after_timeout=True,
    )
    controller = UpgradeReconciler(cfg, Recorder(), caches=io.caches, io=io, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger=LOGGER):
        await controller.reconcile("node-1")  # evict: refused
        now[0] += 10
        await controller.reconcile("node-1")  # past the timeout: delete
    info = lines(caplog, logging.INFO)
    assert info[-1] == (
        "deleted GPU consumer ml/a after the eviction timeout (its PodDisruptionBudget ignored)"
    )
    assert not any("delete: evicted" in line for line in info)


async def test_accepted_eviction_says_evicted(caplog: pytest.LogCaptureFixture) -> None:
    io = ex.FakeUpgradeIO([ex.node(state="cordon-required")], [ex.declared_pod("a")])
    controller, _ = make(io)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        await controller.reconcile("node-1")
    assert lines(caplog, logging.INFO) == [
        "evicted GPU consumer ml/a (declared: matches nvidia.com/gpu-driver-upgrade.consumer=true)"
    ]


async def test_reconciles_are_counted_under_the_runtime_metric_names() -> None:
    from prometheus_client import CollectorRegistry

    nodes = [ex.node(f"n{i}", state="cordon-required") for i in range(2)]
    io = ex.FakeUpgradeIO(nodes, [ex.declared_pod("p", node_name="n0")])
    io.fail_next = [RuntimeError("boom")]
    registry = CollectorRegistry()
    cfg = Config(upgrade_controller=True, backoff_base_seconds=0.001)
    controller = UpgradeReconciler(
        cfg, Recorder(), caches=io.caches, io=io, is_leader=lambda: True, metrics=registry
    )
    sample = registry.get_sample_value
    ok = {"controller": "upgrade", "result": "success"}
    runtime = controller_for(controller)
    async with managed(runtime.runnables()):
        runtime.enqueue_all()
        await eventually(
            lambda: _true((sample("controller_runtime_reconcile_total", ok) or 0) >= 2)
        )
    assert (sample("controller_runtime_reconcile_total", ok) or 0) >= 2
    error = {"controller": "upgrade", "result": "error"}
    assert sample("controller_runtime_reconcile_total", error) == 1
    assert sample("controller_runtime_reconcile_errors_total", {"controller": "upgrade"}) == 1
    assert sample("workqueue_retries_total", {"name": "upgrade"}) == 1
    assert (sample("workqueue_adds_total", {"name": "upgrade"}) or 0) >= 3
    assert sample("shared_svc_upgrade_reconcile_total", {"result": "ok"}) is None
    status = controller.status()
    assert "dryRun" in status and "dry_run" not in status


async def _true(value: bool) -> bool:
    return value


async def test_its_own_node_patch_is_no_change_to_look_at() -> None:
    """The watch event of the controller's own record patch starts no pass: the pass that
    wrote it planned on what it wrote and asked to be polled while the consumers leave
    (a pod list per node saved in every wave). A change by anyone else starts one."""
    io = ex.FakeUpgradeIO([ex.node(state="cordon-required")], [ex.declared_pod("a")])
    io.echo_after_answer = True  # the patch's watch events come after its answer
    controller, _ = make(io)
    async with managed(controller_for(controller).runnables()):  # the first list: an add, a pass
        await eventually(lambda: _true(controller.reconciles == 1 and len(io.writes) == 2))
        # Both node caches deliver the node as the patch left it (its new resourceVersion):
        # the state cache's update, the parked cache's add (the parked label is new).
        await eventually(lambda: _true(events_of(controller)[0] == 3))
        await asyncio.sleep(0.3)  # a second pass would have been handed out by now
        assert controller.reconciles == 1
        assert events_of(controller) == (3, 1)
        # Someone else changes the node: looked at again (the second cache's copy: no change).
        changed = copy.deepcopy(io.nodes["node-1"])
        changed["metadata"]["labels"]["example.com/other"] = "x"
        changed["metadata"]["resourceVersion"] = str(
            int(changed["metadata"]["resourceVersion"]) + 1
        )
        io.set_node(changed)
        await eventually(lambda: _true(controller.reconciles == 2))
        assert events_of(controller) == (5, 2)


def test_of_two_cached_copies_of_a_node_the_newer_version_counts() -> None:
    """The state and parked caches see a node's change one after the other: whichever
    order they are read in, the newer copy's version is the node's."""
    old, new = ex.node(state="cordon-required"), ex.node(state="cordon-required")
    old["metadata"]["resourceVersion"], new["metadata"]["resourceVersion"] = "9", "10"
    for first, second in ((old, new), (new, old)):
        newest = NewestVersions(lambda n: n["metadata"]["name"])
        passed = [newest(Event("add", None, obj)) for obj in (first, second, new, old)]
        # The newer copy counts once, whichever cache brings it first; an older one never.
        assert passed == ([True, True, False, False] if first is old else [True] + [False] * 3)


class EchoBeforeAnswer(ex.FakeUpgradeIO):
    """Both node caches deliver the node as a patch left it before the patch's answer
    comes (two connections: seen on the real API server under load; the fake's own
    order), and ``foreign`` changes the node by someone else while the patch is in flight."""

    foreign = False

    async def patch_node(self, patch: NodePatch) -> str:
        version = await super().patch_node(patch)  # its echo delivered: before the answer
        echo = copy.deepcopy(self.nodes[patch.node])
        if self.foreign:
            self.foreign = False
            changed = copy.deepcopy(echo)
            changed["metadata"]["labels"]["example.com/other"] = "x"
            changed["metadata"]["resourceVersion"] = str(int(version) + 1)
            self.set_node(changed)
        await asyncio.sleep(0)  # the events are handled before the answer
        return version


@pytest.mark.parametrize("foreign", [False, True])
async def test_the_echo_of_a_patch_that_comes_before_its_answer_is_no_change_and_a_foreign_change_is(
    foreign: bool,
) -> None:
    """Issue 22: the pass that wrote the record is the only pass of a node whose consumers
    are leaving, whichever of the patch's answer and its watch event comes first; a change
    by someone else while the patch is in flight is looked at again."""
    io = EchoBeforeAnswer([ex.node(state="cordon-required")], [ex.declared_pod("a")])
    io.foreign = foreign
    controller, _ = make(io, upgrade_poll_seconds=600.0)
    async with managed(controller_for(controller).runnables()):  # the first list: an add, a pass
        await eventually(lambda: _true(len(io.writes) == 2))  # the record patch, the eviction
        if foreign:
            await eventually(lambda: _true(controller.reconciles == 2))
        await asyncio.sleep(0.3)
        assert controller.reconciles == (2 if foreign else 1)
        assert len(io.pod_lists) == controller.reconciles


class HeldLists(ex.FakeUpgradeIO):
    """Holds every pod list until ``want`` are in flight at once (bounded: after 5 s the
    lists are let go, and the peak says how many there were)."""

    def __init__(self, *args: object, want: int, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.want, self.now, self.peak = want, 0, 0
        self.all_in = asyncio.Event()

    async def pods_on_node(self, name: str, skip_namespace: str | None = None) -> list:  # type: ignore[type-arg]
        self.now += 1
        self.peak = max(self.peak, self.now)
        if self.now >= self.want:
            self.all_in.set()
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.all_in.wait(), 5)
            return await super().pods_on_node(name, skip_namespace)
        finally:
            self.now -= 1


async def test_a_wave_is_planned_64_nodes_at_once_by_default() -> None:
    """Issue 22: the passes of a wave wait for the API server, not for its CPU; 64 at
    once, as wide as the bare wave, by default (32 left a queue of hundreds of nodes)."""
    workers = Config().upgrade_workers
    assert workers == 64
    nodes = [ex.node(f"node-{i}", state="cordon-required") for i in range(workers + 6)]
    io = HeldLists(nodes, [], want=workers)
    controller, _ = make(io)
    async with managed(controller_for(controller).runnables()):  # the first lists' adds: every node
        await eventually(lambda: _true(controller.reconciles >= len(nodes)), 30)
        assert io.peak == workers


class _Pods(list):  # type: ignore[type-arg]
    """A pod list a weak reference can follow."""


class _Pod(dict):  # type: ignore[type-arg]
    """A pod a weak reference can follow."""


class WatchedLists(ex.FakeUpgradeIO):
    """Hands out copies of the pods, and at each write says whether any list or pod it
    handed out is still alive."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.handed: list[weakref.ref[Any]] = []
        self.alive_at_writes: list[int] = []

    async def pods_on_node(self, name: str, skip_namespace: str | None = None) -> list:  # type: ignore[type-arg]
        pods = _Pods(
            _Pod(copy.deepcopy(p)) for p in await super().pods_on_node(name, skip_namespace)
        )
        self.handed += [weakref.ref(pods), *map(weakref.ref, pods)]
        return pods

    def _alive(self) -> None:
        self.alive_at_writes.append(sum(ref() is not None for ref in self.handed))

    async def patch_node(self, patch: NodePatch) -> str:
        self._alive()
        return await super().patch_node(patch)

    async def evict(self, action: Any) -> str:
        self._alive()
        return await super().evict(action)


async def test_a_pass_lets_the_pods_it_listed_go_before_its_writes() -> None:
    """A wave runs 64 passes at once, each waiting on its writes: the pods a pass listed
    (whole objects, 15-22 KiB of JSON each) are not held while its writes go out, only
    its plan (issue 22: the wave's memory peak)."""
    io = WatchedLists(
        [ex.node(state="cordon-required")], [ex.declared_pod("a"), ex.declared_pod("b")]
    )
    controller, _ = make(io)
    await controller.reconcile("node-1")
    assert len(io.handed) == 3 and len(io.alive_at_writes) == 3  # the node patch, 2 evictions
    assert io.alive_at_writes == [0, 0, 0]
