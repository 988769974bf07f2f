"""Time plan() on worlds of growing size: the cost per pod must not grow (linear planning).

Run: python benchmarks/bench_plan.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared_svc.reconcile.model import Settings, World
from shared_svc.reconcile.planner import plan
from tests.worlds import (
    APPS,
    apply_plan,
    cluster_policy,
    daemonset,
    gc_spec,
    gpu_cluster,
    pod,
    world,
)

SIZES = (100, 1_000, 10_000)


def build(pods: int) -> World:
    """Both CRs, four DaemonSets, ``pods`` pods spread over them (one straggler each)."""
    per_app = pods // len(APPS)
    objects = [cluster_policy(), gpu_cluster(spec=gc_spec(monitor={"enabled": True}))]
    for app in APPS.values():
        objects.append(daemonset(app, desired=per_app))
        objects.extend(pod(app, f"{app}-{i}", common=i != per_app - 1) for i in range(per_app))
    w = world(objects)
    return apply_plan(w, plan(w, Settings()))  # settled Services, as in steady state


def measure(w: World, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        plan(w, Settings())
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    print(f"{'pods':>8} {'ms/plan':>10} {'us/pod':>10}")
    per_pod = {}
    for size in SIZES:
        seconds = measure(build(size), repeat=5 if size < 10_000 else 3)
        per_pod[size] = seconds / size
        print(f"{size:>8} {seconds * 1e3:>10.2f} {per_pod[size] * 1e6:>10.2f}")
    ratio = per_pod[10_000] / per_pod[1_000]
    print(f"per-pod cost at 10,000 vs 1,000 pods: {ratio:.2f}x (about 1 or less means linear)")


if __name__ == "__main__":
    main()
