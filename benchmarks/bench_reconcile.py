"""Benchmark (not a test): one reconcile of the Services controller in process, with the
fleet's DCGM pods in its real caches (issue 22).

The controller runs as a standby (it plans, never writes) on its real caches, filled as a
complete list fills them (``Cache.replace``): ``--nodes`` nodes x 4 DCGM pods
(``tests/realistic.py`` pods, projected and shared as the pod cache keeps them; written once to
~/.cache/shared-svc/bench-reconcile), the four DaemonSets and both CRs. It times the
snapshot, the plan and the whole ``reconcile`` after a ClusterPolicy change, and the
whole reconcile after one pod change. In-process wall times: label them with the machine's
load.

    .venv/bin/python benchmarks/bench_reconcile.py [--nodes 5000] [--repeat 20]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import pickle
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared_svc.controllers.services.reconciler import KEY
from shared_svc.kube.union import UnionCache
from shared_svc.reconcile.planner import plan
from shared_svc.reconcile.selection import pod_fields
from tests.realistic import api_daemonset, api_pod
from tests.test_cache_events import fill
from tests.test_reconcile_cost import standby
from tests.worlds import APPS, cluster_policy, gc_spec, gpu_cluster

CACHE = Path.home() / ".cache" / "shared-svc" / "bench-reconcile"


def projected_pods(nodes: int, namespace: str) -> list[tuple[dict[str, Any], str]]:
    """(projected pod, resourceVersion) of the 4 DCGM apps on each node (made once)."""
    path = CACHE / f"pods-{nodes}-{namespace}.pickle"
    if path.exists():
        with path.open("rb") as f:
            kept: list[tuple[dict[str, Any], str]] = pickle.load(f)
            return kept
    out, rv = [], 1000
    for app in APPS.values():
        for n in range(nodes):
            pod = api_pod(app, f"{app}-{n:05}", f"node-{n:05}")
            pod["metadata"]["namespace"] = namespace
            rv += 1
            out.append((pod_fields(pod), str(rv)))
    CACHE.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        pickle.dump(out, f)
    return out


def figures(seconds: list[float]) -> str:
    ms = [s * 1000 for s in seconds]
    return f"median {statistics.median(ms):.2f} ms (min {min(ms):.2f}, max {max(ms):.2f}, n = {len(ms)})"


async def measure(nodes: int, repeat: int) -> None:
    ctrl = standby()
    config = ctrl._config
    ns = config.namespace
    pods = projected_pods(nodes, ns)
    union = ctrl.caches["pods"]
    assert isinstance(union, UnionCache)
    keys = [(p["metadata"]["namespace"], p["metadata"]["name"]) for p, _ in pods]
    part = union.parts[0]  # every pod has a DCGM app: the first part's
    part.replace(  # kept as the cache keeps them: repeated subtrees shared (SharedValues)
        {k: part._shared(p) for k, (p, _) in zip(keys, pods, strict=True)},
        {k: v for k, (_, v) in zip(keys, pods, strict=True)},
        served=True,
        resource_version="5000",
    )
    for other in union.parts[1:]:
        fill(other, [])
    daemonsets = [api_daemonset(app, nodes) for app in APPS.values()]
    for ds in daemonsets:
        ds["metadata"]["namespace"] = ns
    fill(ctrl.caches["daemonsets"], daemonsets)  # type: ignore[arg-type]
    cp = cluster_policy()
    cp["metadata"]["resourceVersion"] = "1"
    gc = gpu_cluster(spec=gc_spec())
    gc["metadata"]["resourceVersion"] = "2"
    fill(ctrl.caches["clusterpolicies"], [cp])  # type: ignore[arg-type]
    fill(ctrl.caches["gpuclusters"], [gc])  # type: ignore[arg-type]
    fill(ctrl.caches["services"], [])  # type: ignore[arg-type]
    settings = config.core_settings(service_monitor_served=False)
    version = 10

    def cluster_policy_change() -> None:
        nonlocal version
        version += 1
        changed = cluster_policy(
            spec={
                "dcgmExporter": {
                    "service": {"internalTrafficPolicy": ("Local", "Cluster")[version % 2]}
                }
            }
        )
        changed["metadata"]["resourceVersion"] = str(version)
        fill(ctrl.caches["clusterpolicies"], [changed], str(version))  # type: ignore[arg-type]

    assert (await ctrl.reconcile(KEY)).result == "success"
    snapshot, planned, whole, pod_change = [], [], [], []
    for _ in range(repeat):
        cluster_policy_change()
        t = time.perf_counter()
        world = ctrl.snapshot()
        snapshot.append(time.perf_counter() - t)
        t = time.perf_counter()
        plan(world, settings)
        planned.append(time.perf_counter() - t)
    for _ in range(repeat):
        cluster_policy_change()
        t = time.perf_counter()
        assert (await ctrl.reconcile(KEY)).result == "success"
        whole.append(time.perf_counter() - t)
    for i in range(max(1, repeat // 2)):
        # One pod changes (a label), as a re-list that found it changed leaves the store.
        items, versions = dict(part._items), dict(part._versions)
        key = keys[i]
        pod = copy.deepcopy(items[key])
        pod["metadata"]["labels"] = {**pod["metadata"]["labels"], "bench": str(i)}
        items[key], versions[key] = pod, str(900_000 + i)
        part.replace(items, versions, served=True, resource_version=str(900_000 + i))
        t = time.perf_counter()
        assert (await ctrl.reconcile(KEY)).result == "success"
        pod_change.append(time.perf_counter() - t)
    print(f"{nodes} nodes, {len(pods)} cached DCGM pods, in process:")
    print(f"  after a ClusterPolicy change: snapshot {figures(snapshot)}")
    print(f"  after a ClusterPolicy change: plan {figures(planned)}")
    print(f"  after a ClusterPolicy change: reconcile (standby) {figures(whole)}")
    print(f"  after one pod change: reconcile (standby) {figures(pod_change)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    if args.nodes < 1 or args.repeat < 1:
        parser.error("--nodes and --repeat are at least 1")
    asyncio.run(measure(args.nodes, args.repeat))


if __name__ == "__main__":
    main()
