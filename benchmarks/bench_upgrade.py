"""Driver-upgrade controller figures: reaction time and memory.

Runs the real controller loop (queue, workers, planner, shell logic) on an in-process
fake of the API (``examples.FakeUpgradeIO``), so the figures are the controller's own
cost without network latency. Prints:

- time from a node entering a freeing state (the cache change) to its evictions being
  requested, for one node alone and for 100 nodes entering at once;
- planner throughput (nodes planned per second, 10 pods per node);
- memory (tracemalloc, and process max RSS) with 1,000 nodes and 10,000 pods cached and
  every node planned once.

Usage: python benchmarks/bench_upgrade.py [--nodes 1000] [--pods-per-node 10]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import time
import tracemalloc
from typing import Any

from shared_svc.config import Config
from shared_svc.reconcile.model import Report
from shared_svc.upgrade.controller import UpgradeController
from shared_svc.upgrade.planner import PodAction, plan_node
from shared_svc.upgrade.settings import UpgradeSettings
from shared_svc.upgrade.states import state_label_key
from testenv import upgrade_examples as ex


class Recorder:
    async def emit(self, report: Report) -> None:
        pass


class TimedIO(ex.FakeUpgradeIO):
    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.first_eviction: dict[str, float] = {}

    async def evict(self, action: PodAction) -> str:
        self.first_eviction.setdefault(self.node_of[action.key], time.perf_counter())
        return await super().evict(action)


def world(
    n_nodes: int, pods_per_node: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    nodes = [ex.node(f"node-{i:04d}", state="upgrade-required") for i in range(n_nodes)]
    pods = []
    for i in range(n_nodes):
        for j in range(pods_per_node):
            name, node_name = f"p-{i:04d}-{j:02d}", f"node-{i:04d}"
            if j == 0:
                pods.append(ex.declared_pod(name, node_name=node_name))
            elif j == 1:
                pods.append(ex.pod(name, node_name=node_name, runtime_class="nvidia"))
            elif j == 2:
                pods.append(
                    ex.pod(name, node_name=node_name, resources={"limits": {"nvidia.com/gpu": 1}})
                )
            else:
                pods.append(ex.pod(name, node_name=node_name, owner_kind="ReplicaSet"))
    daemonsets = [ex.daemonset(f"ds-{k}", declared=k % 2 == 0) for k in range(20)]
    return nodes, pods, daemonsets


async def reaction(n_nodes: int, pods_per_node: int, flipping: int) -> list[float]:
    nodes, pods, daemonsets = world(n_nodes, pods_per_node)
    io = TimedIO(nodes, pods, daemonsets)
    config = Config(upgrade_controller=True, upgrade_detection="evict", upgrade_resync_seconds=3600)
    controller = UpgradeController(None, config, Recorder(), io=io)
    io.on_change = controller.notify
    stop = asyncio.Event()
    task = asyncio.create_task(controller.run(stop))
    controller.notify()
    while controller.reconciles < n_nodes:  # noqa: ASYNC110 - the first pass over every node
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    key = state_label_key("gpu")
    started: dict[str, float] = {}
    for i in range(flipping):
        name = f"node-{i:04d}"
        changed = ex.apply_patch(
            io.nodes[name], ex.NodePatch(name, None, ((key, "cordon-required"),))
        )
        started[name] = time.perf_counter()
        io.set_node(changed)
    while len(io.first_eviction) < flipping:  # noqa: ASYNC110 - polling the fake is the measurement
        await asyncio.sleep(0.001)
    stop.set()
    await task
    return [io.first_eviction[n] - started[n] for n in started]


def throughput(n_nodes: int, pods_per_node: int) -> float:
    nodes, pods, daemonsets = world(n_nodes, pods_per_node)
    by_node: dict[str, list[dict[str, Any]]] = {}
    for p in pods:
        by_node.setdefault(p["spec"]["nodeName"], []).append(p)
    settings = UpgradeSettings(detection="evict")
    key = state_label_key("gpu")
    for n in nodes:
        n["metadata"]["labels"][key] = "cordon-required"
    t0 = time.perf_counter()
    for n in nodes:
        plan_node(n, by_node[n["metadata"]["name"]], daemonsets, settings, 1e9)
    return n_nodes / (time.perf_counter() - t0)


async def memory(n_nodes: int, pods_per_node: int) -> tuple[float, float]:
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    nodes, pods, daemonsets = world(n_nodes, pods_per_node)
    io = ex.FakeUpgradeIO(nodes, pods, daemonsets)
    config = Config(upgrade_controller=True, upgrade_detection="evict", upgrade_resync_seconds=3600)
    controller = UpgradeController(None, config, Recorder(), io=io)
    for name in list(io.nodes):
        await controller.reconcile(name)
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return (current - base) / 2**20, (peak - base) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--pods-per-node", type=int, default=10)
    args = parser.parse_args()

    one = asyncio.run(reaction(args.nodes, args.pods_per_node, 1))
    print(
        f"reaction, 1 node of {args.nodes} enters cordon-required: {one[0] * 1000:.2f} ms to its first eviction"
    )
    many = sorted(asyncio.run(reaction(args.nodes, args.pods_per_node, 100)))
    print(
        f"reaction, 100 nodes at once (4 workers): median {statistics.median(many) * 1000:.1f} ms, "
        f"p95 {many[94] * 1000:.1f} ms, max {many[-1] * 1000:.1f} ms"
    )
    print(
        f"planner: {throughput(args.nodes, args.pods_per_node):,.0f} nodes/s ({args.pods_per_node} pods per node, 20 DaemonSets)"
    )
    current, peak = asyncio.run(memory(args.nodes, args.pods_per_node))
    print(
        f"memory, {args.nodes} nodes + {args.nodes * args.pods_per_node} pods cached, every node planned: "
        f"{current:.1f} MiB held, {peak:.1f} MiB peak (tracemalloc)"
    )
    print(f"process max RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f} MiB")


if __name__ == "__main__":
    main()
