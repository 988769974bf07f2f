"""The controller loop on an in-process fake of the API: writes, leader gating, dry-run, retries."""

from __future__ import annotations

import asyncio

import pytest

from shared_svc.config import Config
from shared_svc.errors import UsageError
from shared_svc.kube.upgrade_io import ForeignKeyError, check_own_keys
from shared_svc.reconcile.model import Report
from shared_svc.upgrade import examples as ex
from shared_svc.upgrade.controller import NodeQueue, UpgradeController
from shared_svc.upgrade.planner import NodeChanged, NodePatch

PARKED = "nvidia.com/gpu-driver-upgrade.parked"


class Recorder:
    def __init__(self) -> None:
        self.reports: list[Report] = []

    async def emit(self, report: Report) -> bool:
        self.reports.append(report)
        return True


def make(
    io: ex.FakeUpgradeIO, *, leader: bool = True, **config: object
) -> tuple[UpgradeController, Recorder]:
    recorder = Recorder()
    cfg = Config(upgrade_controller=True, **config)  # type: ignore[arg-type]
    controller = UpgradeController(
        None, cfg, recorder, is_leader=lambda: leader, io=io, clock=lambda: 1000.0
    )
    io.on_change = controller.notify
    return controller, recorder


async def test_reconcile_writes_plan_and_emits_after_writes() -> None:
    io = ex.FakeUpgradeIO([ex.node(state="cordon-required")], [ex.declared_pod("a")])
    controller, recorder = make(io)
    requeue = await controller.reconcile("node-1")
    assert [type(w).__name__ for w in io.writes] == ["NodePatch", "PodAction"]
    assert io.nodes["node-1"]["metadata"]["labels"][PARKED] == "true"
    assert requeue == 5.0
    assert await controller.reconcile("node-1") == 5.0 and len(io.writes) == 2  # idempotent
    io.pods["node-1"] = []
    await controller.reconcile("node-1")
    assert [r.reason for r in recorder.reports] == ["GPUConsumersFreed"]
    status = controller.status()
    assert status["nodes"]["node-1"]["phase"] == "freed" and status["phases"]["freed"] == 1


async def test_follower_and_dry_run_write_nothing() -> None:
    for kwargs in ({"leader": False}, {"dry_run": True}):
        io = ex.FakeUpgradeIO(
            [ex.node(state="cordon-required")],
            [ex.declared_pod("a"), ex.pod("v", runtime_class="nvidia")],
        )
        controller, recorder = make(io, **kwargs)  # type: ignore[arg-type]
        await controller.reconcile("node-1")
        await controller.reconcile("node-1")
        assert io.writes == []
        assert controller.status()["nodes"]["node-1"]["pending"] == ["ml/a"]
        if kwargs.get("dry_run"):
            assert [r.reason for r in recorder.reports] == [
                "GPUConsumersDetected"
            ]  # once, not per pass
        else:
            assert recorder.reports == []


async def test_node_gone_forgets_status() -> None:
    io = ex.FakeUpgradeIO([ex.node(state="cordon-required")], [])
    controller, _ = make(io)
    await controller.reconcile("node-1")
    del io.nodes["node-1"]
    assert await controller.reconcile("node-1") is None
    assert controller.status()["nodes"] == {}


async def test_run_handles_nodes_retries_failures_and_stops() -> None:
    nodes = [ex.node(f"n{i}", state="pod-restart-required") for i in range(5)]
    pods = [ex.declared_pod(f"p{i}", node_name=f"n{i}") for i in range(5)]
    io = ex.FakeUpgradeIO(nodes, pods)
    io.fail_next = [RuntimeError("boom"), NodeChanged("n0")]
    controller, _ = make(io, backoff_base_seconds=0.001, upgrade_workers=3)
    stop = asyncio.Event()
    task = asyncio.create_task(controller.run(stop))
    controller.notify()
    for _ in range(500):
        if all(PARKED in n["metadata"]["labels"] for n in io.nodes.values()):
            break
        await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert all(PARKED in n["metadata"]["labels"] for n in io.nodes.values())
    assert sum(1 for w in io.writes if type(w).__name__ == "PodAction") == 5
    assert controller.status()["errors"] == {}  # the failure was retried and cleared


async def test_queue_deduplicates_and_reruns_a_node_changed_while_active() -> None:
    queue = NodeQueue()
    queue.add("a")
    queue.add("a")
    assert len(queue) == 1
    assert await queue.get() == "a"
    queue.add("a")  # changed while being handled
    assert len(queue) == 0
    queue.done("a")
    assert len(queue) == 1
    queue.add_after("b", 0.01)
    queue.add_after("b", 10)  # the earlier timer wins
    assert await asyncio.wait_for(queue.get(), 1) == "a"
    queue.done("a")
    assert await asyncio.wait_for(queue.get(), 1) == "b"
    queue.close()


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


async def test_trigger_requeues_every_known_node() -> None:
    io = ex.FakeUpgradeIO(
        [ex.node("a", state="cordon-required"), ex.node("b", state="upgrade-done")], []
    )
    controller, _ = make(io, leader=False)
    await controller.reconcile("a")
    await controller.reconcile("b")
    controller.trigger()
    assert len(controller._queue) == 2


def test_bad_consumer_selector_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="upgrade_consumer_selector"):
        make(ex.FakeUpgradeIO([], []), upgrade_consumer_selector="a in (b")


async def test_stop_finishes_the_node_in_flight() -> None:
    """SIGTERM never cuts a node's writes in half: the node patch and its evictions land."""

    class SlowIO(ex.FakeUpgradeIO):
        started = asyncio.Event()

        async def patch_node(self, patch: NodePatch) -> None:
            self.started.set()
            await asyncio.sleep(0.3)
            await super().patch_node(patch)

    io = SlowIO([ex.node(state="cordon-required")], [ex.declared_pod("a")])
    controller, _ = make(io)
    stop = asyncio.Event()
    task = asyncio.create_task(controller.run(stop))
    controller.notify()
    await asyncio.wait_for(io.started.wait(), 5)
    stop.set()  # while the node patch is in flight
    await asyncio.wait_for(task, 5)
    kinds = [type(w).__name__ for w in io.writes]
    assert kinds == ["NodePatch", "PodAction"], kinds
