"""Benchmark (not a test): an upgrade wave on the real API server, ``shared-svc run`` as its own process.

Starts the embedded control plane (the real kube-apiserver; no kubelet, no controllers)
and builds: ``--nodes`` Nodes (default 200) in the gpu-operator state ``upgrade-required``,
each with ``--consumers`` declared consumer pods (default 2; ``tests/realistic.api_pod``
pods without their owner and operand nodeSelector, labelled
``nvidia.com/gpu-driver-upgrade.consumer=true``, their status written through the status
subresource), and a ClusterPolicy with auto-upgrade on whose gate
selects them. Then ``shared-svc run`` is started as its own process with the shipped
defaults and both controllers on (only the namespace, kubeconfig, pod name and HTTP port
are set besides; ``SHARED_SVC_UPGRADE_CONTROLLER=true``), and waits until it leads and is
ready.

Each repetition puts every node into ``cordon-required`` at once (one label patch per
node, sent concurrently, as gpu-operator's upgrade flow does for ``maxParallelUpgrades``
nodes) and times, from sending the first patch, with a watch of nodes and pods:

- **makespan**: until every node has its record annotation written and every consumer
  pod on it evicted (the eviction accepted: the pod has a ``deletionTimestamp``), the
  work of shared-svc; per node the same, median and p99 over all nodes of all runs;
- **freed**: until every node's record says ``freedAt`` (``GPUConsumersFreed``). This
  plays the kubelet (a terminating pod is deleted with grace 0 as soon as it is seen), and
  shared-svc looks at a node again only every ``upgrade_poll_seconds`` (5 s) while its
  consumers are leaving, so it is bounded below by that poll.

Each repetition also prints when the benchmark's own state patches had all landed (part
of the makespan: the clock starts at the first one) and the upgrade controller's counters
over it (passes, node patches, evictions, from its ``/metrics``). ``--profile FILE``
cProfiles shared-svc during the last repetition (``benchmarks/profiled_run.py``, as
``bench_memory.py --profile``) and prints the top functions.

Between repetitions the nodes go to ``upgrade-done`` (shared-svc removes its label and
record) and back to ``upgrade-required``, and new consumer pods are created.

    .venv/bin/python benchmarks/bench_upgrade.py [--nodes 200] [--consumers 2] [--runs 5] [--profile FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import pstats
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_memory import Run, _many, _pod, gpu_node, http_get, worktree
from kubernetes_asyncio.client import ApiClient

import testenv
from shared_svc.kube.writer import MERGE_PATCH, raw_request
from tests.kube import api_client, make_namespace
from tests.realistic import api_pod
from tests.svc import Kube, cp_body

STATE = "nvidia.com/gpu-driver-upgrade-state"
PARKED = "nvidia.com/gpu-driver-upgrade.parked"
RECORD = "shared-svc.nvidia.com/gpu-driver-upgrade-freed"
CONSUMER = "nvidia.com/gpu-driver-upgrade.consumer"
OPERATOR_NS = "gpu-operator"
CONSUMERS_NS = "bench-upgrade-consumers"


def node_name(i: int) -> str:
    return f"gpu-node-{i:04d}"


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


class Watcher:
    """Nodes and consumer pods, watched from a resourceVersion on; first times of interest."""

    def __init__(self, api: ApiClient) -> None:
        self.api = api
        self.record_at: dict[str, float] = {}  # node -> record annotation first seen
        self.freed_at: dict[str, float] = {}  # node -> record with freedAt first seen
        self.evicted_at: dict[str, float] = {}  # pod -> deletionTimestamp (or gone) first seen
        self._kubelet: set[asyncio.Task[Any]] = set()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        for path, query, handle in (
            ("/api/v1/nodes", [("labelSelector", STATE)], self._node),
            (f"/api/v1/namespaces/{CONSUMERS_NS}/pods", [], self._pod),
        ):
            listed = await raw_request(self.api, "GET", path, query=query)
            for item in listed.get("items") or []:
                handle("ADDED", item)
            rv = listed["metadata"]["resourceVersion"]
            self._tasks.append(asyncio.ensure_future(self._watch(path, query, rv, handle)))

    async def _watch(self, path: str, query: list[tuple[str, str]], rv: str, handle: Any) -> None:
        while True:
            resp = await self.api.call_api(
                path,
                "GET",
                query_params=[*query, ("watch", "true"), ("resourceVersion", rv)],
                header_params={"Accept": "application/json"},
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=aiohttp.ClientTimeout(total=None, sock_read=None),
            )
            async with resp:
                while line := await resp.content.readline():
                    event = json.loads(line)
                    obj = event.get("object") or {}
                    rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                    if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                        handle(event["type"], obj)

    def _node(self, _type: str, node: dict[str, Any]) -> None:
        meta = node["metadata"]
        record = (meta.get("annotations") or {}).get(RECORD)
        if record is None:
            return
        now = time.monotonic()
        self.record_at.setdefault(meta["name"], now)
        with contextlib.suppress(ValueError, AttributeError):
            if json.loads(record).get("freedAt"):
                self.freed_at.setdefault(meta["name"], now)

    def _pod(self, etype: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        if etype == "DELETED" or meta.get("deletionTimestamp"):
            self.evicted_at.setdefault(meta["name"], time.monotonic())
        if etype != "DELETED" and meta.get("deletionTimestamp"):
            # The kubelet's part: the containers are gone, confirm with grace 0.
            task = asyncio.ensure_future(self._finish(meta["name"]))
            self._kubelet.add(task)
            task.add_done_callback(self._kubelet.discard)

    async def _finish(self, name: str) -> None:
        with contextlib.suppress(Exception):
            await raw_request(
                self.api,
                "DELETE",
                f"/api/v1/namespaces/{CONSUMERS_NS}/pods/{name}",
                body={"gracePeriodSeconds": 0},
            )

    async def stop(self) -> None:
        for task in [*self._tasks, *self._kubelet]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._kubelet, return_exceptions=True)

    def reset(self) -> None:
        self.record_at.clear()
        self.freed_at.clear()
        self.evicted_at.clear()


async def set_state(api: ApiClient, nodes: int, state: str) -> None:
    await _many(
        [
            raw_request(
                api,
                "PATCH",
                f"/api/v1/nodes/{node_name(i)}",
                body={"metadata": {"labels": {STATE: state}}},
                content_type=MERGE_PATCH,
            )
            for i in range(nodes)
        ],
        width=64,
    )


def consumer_pods(run: int, nodes: int, per_node: int) -> dict[str, str]:
    """Pod name -> node, for one repetition."""
    return {f"job-r{run}-{i:04d}-{j}": node_name(i) for i in range(nodes) for j in range(per_node)}


async def create_consumers(api: ApiClient, pods: dict[str, str]) -> None:
    bodies = []
    for name, node in pods.items():
        pod = api_pod("gpu-job", name, node, common=False)
        pod["metadata"]["namespace"] = CONSUMERS_NS
        pod["metadata"]["labels"] = {"app": "gpu-job", CONSUMER: "true"}
        pod["metadata"].pop("ownerReferences", None)
        # A workload, not an operand: no nvidia.com/gpu.deploy.* nodeSelector (gpu-operator's
        # own pods, never ours to evict); the nvidia RuntimeClass stays (a GPU consumer).
        pod["spec"].pop("nodeSelector", None)
        bodies.append(pod)
    await _many([_pod(api, p) for p in bodies])


def node_done(watcher: Watcher, by_node: dict[str, list[str]], node: str) -> float | None:
    """When ``node``'s record was written and its last consumer evicted (None: not yet)."""
    times = [watcher.record_at.get(node)] + [watcher.evicted_at.get(p) for p in by_node[node]]
    return None if None in times else max(t for t in times if t is not None)


async def wait_for(check: Any, timeout: float, what: str, run: Run) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            _, status = http_get(run.port, "/status")
            raise SystemExit(f"timed out waiting for {what}; /status: {status[:3000]}")
        await asyncio.sleep(0.01)


async def records_gone(api: ApiClient, nodes: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        listed = await raw_request(api, "GET", "/api/v1/nodes", query=[("labelSelector", STATE)])
        left = [
            n["metadata"]["name"]
            for n in listed["items"]
            if RECORD in (n["metadata"].get("annotations") or {})
            or PARKED in (n["metadata"].get("labels") or {})
        ]
        if not left:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"upgrade-done did not clear {len(left)} of {nodes} nodes")
        await asyncio.sleep(0.5)


def upgrade_counters(run: Run) -> dict[str, float]:
    """The upgrade controller's passes and writes so far, from its /metrics."""
    _, body = http_get(run.port, "/metrics")
    wanted = (
        'controller_runtime_reconcile_total{controller="upgrade"',
        "shared_svc_upgrade_evictions_total",
        "shared_svc_upgrade_node_patches_total",
    )
    counts: dict[str, float] = {}
    for line in body.splitlines():
        if line.startswith(wanted):
            key, _, value = line.rpartition(" ")
            counts[key] = float(value)
    return counts


async def main(
    nodes: int,
    per_node: int,
    runs: int,
    ref: str | None,
    timeout: float = 300,
    profile: str | None = None,
) -> None:
    tree = worktree(ref) if ref else None
    cp = await asyncio.get_running_loop().run_in_executor(None, testenv.start)
    run: Run | None = None
    watcher: Watcher | None = None
    api = await api_client(cp)
    try:
        await make_namespace(api, OPERATOR_NS)
        await make_namespace(api, CONSUMERS_NS)
        await raw_request(
            api,
            "POST",
            "/apis/node.k8s.io/v1/runtimeclasses",
            body={"metadata": {"name": "nvidia"}, "handler": "nvidia"},
        )
        gate = {"podSelector": f"{CONSUMER}=true", "timeoutSeconds": 600}
        policy = {"upgradePolicy": {"autoUpgrade": True, "waitForCompletion": gate}}
        await Kube(api, OPERATOR_NS).create_cr(cp_body(driver=policy))
        await _many(
            [
                raw_request(
                    api,
                    "POST",
                    "/api/v1/nodes",
                    body=gpu_node(node_name(i), **{STATE: "upgrade-required"}),
                )
                for i in range(nodes)
            ]
        )
        run = Run(cp, OPERATOR_NS, tree, profile)
        await run.ready()
        watcher = Watcher(api)
        await watcher.start()
        makespans: list[float] = []
        freed: list[float] = []
        per_node_done: list[float] = []
        landed: list[float] = []
        for rep in range(runs):
            pods = consumer_pods(rep, nodes, per_node)
            await create_consumers(api, pods)
            await asyncio.sleep(2)  # quiet: shared-svc has seen the pods come (it does nothing)
            watcher.reset()
            before = upgrade_counters(run)
            if profile and rep == runs - 1:
                run.proc.send_signal(signal.SIGUSR1)
            t0 = time.monotonic()
            await set_state(api, nodes, "cordon-required")
            landed.append(time.monotonic() - t0)
            names = [node_name(i) for i in range(nodes)]
            by_node: dict[str, list[str]] = {n: [] for n in names}
            for pod, node in pods.items():
                by_node[node].append(pod)

            await wait_for(
                lambda: all(node_done(watcher, by_node, n) is not None for n in by_node),  # noqa: B023
                timeout,
                "evictions",
                run,
            )
            done = [node_done(watcher, by_node, n) or 0.0 for n in names]
            makespans.append(max(done) - t0)
            per_node_done.extend(d - t0 for d in done)
            await wait_for(
                lambda: len(watcher.freed_at) >= nodes,
                timeout,
                "freedAt on every node",
                run,
            )
            freed.append(max(watcher.freed_at.values()) - t0)
            if profile and rep == runs - 1:
                run.proc.send_signal(signal.SIGUSR2)
            after = upgrade_counters(run)
            print(
                f"run {rep + 1}: makespan {makespans[-1]:.2f} s (the {nodes} state patches "
                f"landed by {landed[-1]:.2f} s), freed {freed[-1]:.2f} s; counters: "
                + ", ".join(
                    f"{k} +{after[k] - before.get(k, 0):g}"
                    for k in sorted(after)
                    if after[k] != before.get(k, 0)
                ),
                flush=True,
            )
            await set_state(api, nodes, "upgrade-done")
            await records_gone(api, nodes)
            await set_state(api, nodes, "upgrade-required")
        if profile:
            await asyncio.sleep(2)
            stats = pstats.Stats(profile)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(40)
    finally:
        if watcher is not None:
            await watcher.stop()
        if run is not None:
            run.stop()
        await api.close()
        cp.stop()
        if tree:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", tree], check=False
            )

    print()
    print(
        f"shared-svc run (own process, shipped defaults, both controllers on), real API server; "
        f"{nodes} nodes x {per_node} declared consumer pods enter cordon-required at once"
        + (f"; shared-svc of git {ref}" if ref else "")
    )
    print(
        f"makespan (every record written, every consumer evicted), n={len(makespans)} runs: "
        f"median {statistics.median(makespans):.2f} s, p99 {percentile(makespans, 99):.2f} s, "
        f"min {min(makespans):.2f} s, max {max(makespans):.2f} s"
    )
    print(
        f"per node (its record written, its consumers evicted), n={len(per_node_done)}: "
        f"median {statistics.median(per_node_done):.2f} s, "
        f"p99 {percentile(per_node_done, 99):.2f} s"
    )
    print(
        f"freed (freedAt on every node; the kubelet played at once; 5 s poll), n={len(freed)}: "
        f"median {statistics.median(freed):.2f} s, p99 {percentile(freed, 99):.2f} s"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--consumers", type=int, default=2, help="declared pods per node")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=300, help="per wait, seconds")
    parser.add_argument("--ref", help="run shared-svc of this git ref (a worktree), not this tree")
    parser.add_argument(
        "--profile",
        help="cProfile shared-svc during the last repetition into FILE (benchmarks/profiled_run.py); print the top",
    )
    args = parser.parse_args()
    asyncio.run(main(args.nodes, args.consumers, args.runs, args.ref, args.timeout, args.profile))
