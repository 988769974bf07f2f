"""Benchmark (not a test): ``shared-svc run`` in the fleet world of issue 22, as a user runs it.

Starts the embedded control plane (the real kube-apiserver, no controller-manager) and
builds the fleet world on it: GPU Nodes as ``bench_memory.create_gpu_node`` makes them
(``tests/realistic.py``: labels, annotations and a kubelet's status, about 15 KiB), eight
operand DaemonSets in the operator namespace with one pod per node each (the four DCGM
apps of ``tests.worlds.APPS`` and nvidia-driver-daemonset,
nvidia-container-toolkit-daemonset, nvidia-device-plugin-daemonset and
gpu-feature-discovery; ``tests/realistic.api_pod``, 15-22 KiB, spec as created and status
written through the status subresource), and two other pods per node in another namespace
(GPU workloads, not declared consumers). One ClusterPolicy with auto-upgrade on (its gate
selects ``nvidia.com/gpu-driver-upgrade.consumer=true``) and the exporter Service's
``internalTrafficPolicy`` set. Every node carries
``nvidia.com/gpu-driver-upgrade-state``, as gpu-operator with auto-upgrade on leaves a fleet
(issue 33): the first ``--wave`` nodes ``upgrade-required``, every other ``upgrade-done``.

``--world``: ``fleet`` is 5,000 nodes (40,000 operator-namespace pods, 10,000 others);
``issue12`` is 1,000 nodes (8,000 operator-namespace pods, 2,000 others: the counts of issue
12's world, in the fleet's composition); ``both`` builds the 1,000-node world, measures it,
grows it to 5,000 nodes on the same control plane and measures again, and prints the cost
per node of the big world over the small one. ``--scale`` multiplies every count (smoke
runs). Populating runs ``--width`` requests at a time.

Each world is measured with ``bench_memory.measure_big``: ``shared-svc run`` as its own
process, shipped defaults, both controllers on; start -> ready (leading, /readyz 200),
VmRSS 10 s after, VmHWM, then over ``--window`` seconds (default 600: whole periods of both
resyncs, 300 s and 120 s) the API server's own write counts (Leases apart) and the CPU of
the process. The idle base is ``bench_memory.measure_small`` (one ClusterPolicy, the
DaemonSets, no nodes or pods), measured first.

In each world, in the same process after the window:

- ClusterPolicy change -> converged, ``--changes`` lone changes interleaved with the bare
  write of the same shape and the bare chain (the script's own CR patch, its watch seeing
  it, its own Service apply: the true floor; ``bench_controller.lone_changes``): median
  and p99, ratios to the chain (goal: median <= 1.15x, p99 <= 1.5x) and to the bare write;
- in the last world only, the first ``--wave`` nodes entering ``cordon-required`` at once
  with 2 declared consumers each, ``--runs`` times (``bench_upgrade.shared_runs``), against
  the bare waves of the same run (``bench_upgrade.bare_runs``), ``--runs`` sent before
  shared-svc starts and ``--runs`` after it stops: the API server drifts over a run (its
  heap, etcd, the Events left), and a floor measured only before would hide it. Makespan,
  ratio to all the bare waves (and to each half, printed).

Each figure is printed with its n and its budget (issues 22 and 32), with the date, the
machine, the commit and the load average before and after. ``--profile FILE`` runs
shared-svc under cProfile (``benchmarks/profiled_run.py``), switched on only for
``--profile-window`` seconds after the measured window (whose CPU figure it leaves alone),
and prints the top functions and the time of garbage collection (FILE.<nodes> per world).
``--trace FILE`` runs shared-svc
through ``benchmarks/traced_run.py`` (FILE.<nodes> per world) and prints where the time of
the CR change and of the chain goes (``bench_controller.print_breakdown``).
``--wave-profile FILE`` runs shared-svc under cProfile in the last world, switched on only
for the last wave (until every record says freedAt: its makespan is the profiler's, the
other waves' are not), and prints the top functions and the garbage collections.
``--apiserver-profile FILE`` saves kube-apiserver's CPU profile of the first
``--apiserver-seconds`` of the last wave of each kind (FILE.bare, FILE.shared,
FILE.bare-after; ``go tool pprof -top``).

    .venv/bin/python benchmarks/bench_fleet.py [--world fleet|issue12|both] [--scale 1]
        [--window 600] [--changes 60] [--wave 500] [--runs 3] [--width 32]
        [--profile FILE [--profile-window 240]] [--trace FILE] [--wave-profile FILE]
        [--apiserver-profile FILE [--apiserver-seconds 10]]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_controller import (
    CHAIN_MEDIAN_X,
    CHAIN_P99_X,
    Chain,
    commit,
    load,
    lone_changes,
    pct,
    print_breakdown,
    ratios,
    watch_services,
)
from bench_memory import (
    Run,
    _daemonset,
    _many,
    _pod,
    cpu_seconds,
    create_gpu_node,
    measure_big,
    measure_small,
    memory,
    print_profile,
    remove_worktree,
    worktree,
)
from bench_upgrade import (
    CONSUMER,
    CONSUMERS_NS,
    OPERATOR_NS,
    STATE,
    Watcher,
    bare_runs,
    node_name,
    shared_runs,
    workload_pod,
)
from kubernetes_asyncio.client import ApiClient

import testenv
from shared_svc.config import Config
from shared_svc.kube.writer import raw_request
from tests.kube import api_client, make_namespace
from tests.realistic import api_pod
from tests.svc import Kube, cp_body
from tests.worlds import APPS

OPERANDS = (
    *APPS.values(),
    "nvidia-driver-daemonset",
    "nvidia-container-toolkit-daemonset",
    "nvidia-device-plugin-daemonset",
    "gpu-feature-discovery",
)
OTHERS_NS = "bench-fleet-others"
OTHERS_PER_NODE = 2
CONSUMERS_PER_NODE = 2
WORLDS = {"issue12": (1000,), "fleet": (5000,), "both": (1000, 5000)}
# Budgets of issue 22 for the 5,000-node world.
HWM_MIB, READY_S, CPU_PCT = 150.0, 15.0, 2.0
CHANGE_MEDIAN_X, CHANGE_P99_X, WAVE_X = 1.5, 3.0, 1.3


def operand_pod(app: str, i: int) -> dict[str, Any]:
    pod = api_pod(app, f"{app}-{i:05d}", node_name(i), common=app in APPS.values())
    pod["metadata"]["namespace"] = OPERATOR_NS
    return pod


async def populate(api: ApiClient, lo: int, hi: int, wave: int, width: int) -> None:
    """Nodes ``lo`` to ``hi - 1``, their operand pods and their other pods; each body is
    made when its request is sent (50,000 pods of 20 KiB are not all held at once)."""

    async def operand(app: str, i: int) -> None:
        await _pod(api, operand_pod(app, i))

    async def other(i: int, j: int) -> None:
        name = f"batch-job-{i:05d}-{j}"
        await _pod(api, workload_pod(name, node_name(i), OTHERS_NS, {"app": "batch-job"}))

    await _many(
        [
            create_gpu_node(
                api, node_name(i), **{STATE: "upgrade-required" if i < wave else "upgrade-done"}
            )
            for i in range(lo, hi)
        ],
        width,
    )
    await _many(
        [operand(app, i) for i in range(lo, hi) for app in OPERANDS]
        + [other(i, j) for i in range(lo, hi) for j in range(OTHERS_PER_NODE)],
        width,
    )


def machine() -> str:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "?",
    )
    return f"{model}, {os.cpu_count()} CPUs, Linux {platform.release()}"


def budget(value: float, limit: float) -> str:
    return f"<= {limit:g}: {'met' if value <= limit else 'NOT met'}"


def own_writes(writes: dict[str, int]) -> int:
    """The writes besides Leases, without ``endpoints``: those are the API server's own
    (its ``kubernetes`` Service, one every 10 s; ``bench_memory``)."""
    return sum(n for resource, n in writes.items() if resource != "endpoints")


def whole_periods(window: float) -> bool:
    defaults = Config.model_fields
    periods = (defaults["resync_seconds"].default, defaults["upgrade_resync_seconds"].default)
    return window % math.lcm(*(int(p) for p in periods)) == 0


async def main(args: argparse.Namespace) -> None:
    sizes = [max(1, int(n * args.scale)) for n in WORLDS[args.world]]
    wave = min(max(1, int(args.wave * args.scale)), sizes[0])
    started_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_before = load()
    cp = await asyncio.get_running_loop().run_in_executor(None, testenv.start)
    api = await api_client(cp)
    results: dict[int, dict[str, Any]] = {}
    watcher: Watcher | None = None
    bare: list[float] = []
    bare_after: list[float] = []
    try:
        for ns in (OPERATOR_NS, CONSUMERS_NS, OTHERS_NS):
            await make_namespace(api, ns)
        await raw_request(
            api,
            "POST",
            "/apis/node.k8s.io/v1/runtimeclasses",
            body={"metadata": {"name": "nvidia"}, "handler": "nvidia"},
        )
        gate = {"podSelector": f"{CONSUMER}=true", "timeoutSeconds": 600}
        cluster_policy = cp_body(
            driver={"upgradePolicy": {"autoUpgrade": True, "waitForCompletion": gate}},
            dcgmExporter={"service": {"internalTrafficPolicy": "Cluster"}},
        )
        await Kube(api, OPERATOR_NS).create_cr(cluster_policy)
        for app in OPERANDS:
            await raw_request(
                api,
                "POST",
                f"/apis/apps/v1/namespaces/{OPERATOR_NS}/daemonsets",
                body=_daemonset(app, OPERATOR_NS),
            )
        idle = await measure_small(cp, OPERATOR_NS, None)
        print(f"idle base (no nodes, no pods): VmRSS {idle:.1f} MiB", flush=True)
        built = 0
        for nodes in sizes:
            t0 = time.monotonic()
            await populate(api, built, nodes, wave, args.width)
            built = nodes
            print(
                f"world: {nodes} Nodes, {nodes * len(OPERANDS)} operator-namespace pods, "
                f"{nodes * OTHERS_PER_NODE} other pods, built in {time.monotonic() - t0:.0f} s",
                flush=True,
            )
            last = nodes == sizes[-1]
            if last and args.before:
                await side_by_side_startups(cp, args.before, args.startups)
            if last and args.runs:
                watcher = Watcher(api)
                await watcher.start()
                bare = await bare_floor(api, cp, watcher, wave, args, "bare")
            then = in_world(api, cp, watcher if last else None, wave, args, cluster_policy)
            trace = f"{args.trace}.{nodes}" if args.trace else None
            profile = f"{args.profile}.{nodes}" if args.profile else None
            if last and args.wave_profile:
                profile = args.wave_profile
            if args.startup_profile:
                profile = f"{args.startup_profile}.{nodes}"
            results[nodes] = await measure_big(
                cp,
                OPERATOR_NS,
                None,
                args.window,
                profile,
                then=then,
                trace=trace,
                profile_window=args.profile_window,
                profile_rest=not (last and args.wave_profile),
                profile_startup=bool(args.startup_profile),
            )
            if last and args.runs:
                # The floor again, now that shared-svc has gone: the API server's own drift
                # over the run (its heap, etcd's size, the Events left) shows as the
                # difference between the bare waves before and after.
                assert watcher is not None
                bare_after = await bare_floor(api, cp, watcher, wave, args, "bare-after")
            scalars = {k: v for k, v in results[nodes].items() if not isinstance(v, list)}
            print(f"{nodes} nodes: {scalars}", flush=True)
    finally:
        if watcher is not None:
            await watcher.stop()
        await api.close()
        cp.stop()
    report(args, sizes, wave, idle, results, (bare, bare_after), started_at, load_before)


async def side_by_side_startups(cp: testenv.ControlPlane, ref: str, n: int) -> None:
    """``n`` start-ups of ``ref``'s tree and of this one, alternating, in the world as it
    is (its Services already in place): start -> ready, and the CPU seconds until ready
    of shared-svc and of kube-apiserver; printed with the medians."""
    tree = worktree(ref)
    runs: dict[str, list[tuple[float, float, float]]] = {ref: [], "this tree": []}
    try:
        for _ in range(n):
            for label, path in ((ref, tree), ("this tree", None)):
                apiserver = cp.processes["kube-apiserver"].pid
                server0, t0 = cpu_seconds(apiserver), time.monotonic()
                run = Run(cp, OPERATOR_NS, path)
                try:
                    await run.ready()
                    ready = time.monotonic() - t0
                    own, server = cpu_seconds(run.proc.pid), cpu_seconds(apiserver) - server0
                finally:
                    run.stop()
                runs[label].append((ready, own, server))
                print(
                    f"start-up, {label}: ready in {ready:.2f} s; CPU until ready: shared-svc "
                    f"{own:.2f} s, kube-apiserver {server:.2f} s",
                    flush=True,
                )
                await asyncio.sleep(5)  # the stopped process's watches gone
    finally:
        remove_worktree(tree)
    for label, measured in runs.items():
        ready, own, server = (statistics.median(m[i] for m in measured) for i in range(3))
        print(
            f"start-up medians, {label} (n = {n}): ready {ready:.2f} s, shared-svc CPU "
            f"{own:.2f} s, kube-apiserver CPU {server:.2f} s",
            flush=True,
        )


def server_profile(args: argparse.Namespace, kind: str) -> str | None:
    """Where kube-apiserver's CPU profile of the last wave of a kind goes (``--apiserver-profile``)."""
    return f"{args.apiserver_profile}.{kind}" if args.apiserver_profile else None


async def bare_floor(
    api: ApiClient,
    cp: testenv.ControlPlane,
    watcher: Watcher,
    wave: int,
    args: argparse.Namespace,
    kind: str,
) -> list[float]:
    """``--runs`` bare waves (``kind``: "bare" before shared-svc starts, "bare-after" once it
    has stopped), their makespans."""
    makespans, _ = await bare_runs(
        api,
        cp,
        watcher,
        wave,
        CONSUMERS_PER_NODE,
        args.runs,
        args.timeout,
        apiserver_profile=server_profile(args, kind),
        apiserver_seconds=args.apiserver_seconds,
        first_run=0 if kind == "bare" else args.runs,
    )
    return makespans


def in_world(
    api: ApiClient,
    cp: testenv.ControlPlane,
    watcher: Watcher | None,
    wave: int,
    args: argparse.Namespace,
    cluster_policy: dict[str, Any],
) -> Any:
    async def then(run: Run) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if args.changes:
            kube = Kube(api, OPERATOR_NS)
            services, task = await watch_services(kube)
            chain = Chain(api, await make_namespace(api, "bench-chain"))
            await chain.start(cp, cluster_policy)
            out["marks"] = []
            out["controller_ms"], out["bare_ms"], out["chain_ms"], _ = await lone_changes(
                kube, services, chain, args.changes, args.pause, out["marks"]
            )
            out["chain_steps"] = chain.steps
            await chain.stop()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if watcher is not None:
            out["makespans"], _, out["per_node"], _ = await shared_runs(
                api,
                cp,
                run,
                watcher,
                wave,
                CONSUMERS_PER_NODE,
                args.runs,
                args.timeout,
                args.wave_profile,
                server_profile(args, "shared"),
                args.apiserver_seconds,
            )
            if args.wave_profile:
                await asyncio.sleep(2)
                print_profile(args.wave_profile)
        out["hwm_after"] = memory(run.proc.pid)["VmHWM"]
        return out

    return then


def report(
    args: argparse.Namespace,
    sizes: list[int],
    wave: int,
    idle: float,
    results: dict[int, dict[str, Any]],
    bares: tuple[list[float], list[float]],
    started_at: str,
    load_before: str,
) -> None:
    print()
    print(
        f"shared-svc run (own process, shipped defaults, both controllers on), real "
        f"kube-apiserver; started {started_at}; {machine()}; commit {commit()}; load "
        f"average {load_before} at the start, {load()} at the end"
    )
    if args.scale != 1:
        print(f"scale {args.scale:g}: the budgets are for the full-size world")
    if not whole_periods(args.window):
        print(f"window {args.window:g} s is not whole periods of both resyncs (120 s, 300 s)")
    for nodes in sizes:
        r = results[nodes]
        print(
            f"{nodes} Nodes, {nodes * len(OPERANDS)} operator-namespace pods "
            f"({len(OPERANDS)} DaemonSets), {nodes * OTHERS_PER_NODE} other pods; n = 1 run"
        )
        rows = [
            ("start -> ready (s)", r["synced_in"], READY_S),
            ("VmRSS after sync (MiB)", r["rss_after_sync"], None),
            ("VmHWM after the window (MiB)", r["hwm"], HWM_MIB),
            (f"CPU over {args.window:g} s (% of a core)", r["cpu"], CPU_PCT),
            (f"other writes in {args.window:g} s", own_writes(r["other_writes"]), 0),
        ]
        if "hwm_after" in r:
            rows.append(("VmHWM after the in-world runs (MiB)", r["hwm_after"], HWM_MIB))
        for title, value, limit in rows:
            tail = budget(value, limit) if limit is not None else ""
            print(f"  {title:40}{value:10.2f}  {tail}")
        print(f"  {'Lease writes in the window':40}{r['lease_writes']:10d}  (any)")
        if r["other_writes"]:
            print(f"  writes by resource besides Leases: {r['other_writes']}")
    if len(sizes) == 2:
        small, big = (results[n] for n in sizes)
        print(f"cost per node, {sizes[1]} over {sizes[0]} nodes (<= 1: no worse than linear)")
        for title, key, base in (
            ("memory above the idle base", "rss_after_sync", idle),
            ("start -> ready", "synced_in", 0.0),
            ("CPU at steady state", "cpu", 0.0),
        ):
            per_small = (small[key] - base) / sizes[0]
            per_big = (big[key] - base) / sizes[1]
            ratio = per_big / per_small if per_small > 0 else math.inf
            print(f"  {title:40}{ratio:10.2f}  {budget(ratio, 1.0)}")
    for nodes in sizes:
        r = results[nodes]
        if "controller_ms" not in r:
            continue
        c, b, ch = r["controller_ms"], r["bare_ms"], r["chain_ms"]
        med, p99 = ratios(c, ch)
        print(
            f"{nodes} nodes: ClusterPolicy change -> converged, n = {len(c)}, against the "
            f"bare chain (CR patch, watch, Service apply; n = {len(ch)}): median "
            f"{statistics.median(c):.1f} ms vs {statistics.median(ch):.1f} ms = {med:.2f}x "
            f"({budget(med, CHAIN_MEDIAN_X)}); p99 {pct(c, 0.99):.1f} ms vs "
            f"{pct(ch, 0.99):.1f} ms = {p99:.2f}x ({budget(p99, CHAIN_P99_X)})"
        )
        med, p99 = ratios(c, b)
        print(
            f"  against the bare write (n = {len(b)}): median {statistics.median(b):.1f} ms, "
            f"{med:.2f}x ({budget(med, CHANGE_MEDIAN_X)}, issue 22); p99 "
            f"{pct(b, 0.99):.1f} ms, {p99:.2f}x ({budget(p99, CHANGE_P99_X)})"
        )
        if args.trace:
            print_breakdown(Path(f"{args.trace}.{nodes}"), r["marks"], r["chain_steps"])
    last = results[sizes[-1]]
    if "makespans" in last:
        before, after = bares
        bare = before + after
        m = statistics.median(last["makespans"])
        ratio = m / statistics.median(bare)
        print(
            f"{wave} nodes enter cordon-required at once, {CONSUMERS_PER_NODE} declared "
            f"consumers each, n = {len(last['makespans'])} waves (bare n = {len(bare)}, half "
            f"before shared-svc starts, half after it stops): makespan median {m:.2f} s vs "
            f"bare {statistics.median(bare):.2f} s = {ratio:.2f}x ({budget(ratio, WAVE_X)}); "
            f"per node median {statistics.median(last['per_node']):.2f} s "
            f"(n = {len(last['per_node'])})"
        )
        print(
            f"  waves {', '.join(f'{x:.2f}' for x in last['makespans'])} s; bare before "
            f"{', '.join(f'{x:.2f}' for x in before)} s, after "
            f"{', '.join(f'{x:.2f}' for x in after)} s; against the bare waves before alone "
            f"{m / statistics.median(before):.2f}x, after alone {m / statistics.median(after):.2f}x"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", choices=sorted(WORLDS), default="fleet")
    parser.add_argument("--scale", type=float, default=1.0, help="world size factor (smoke runs)")
    parser.add_argument("--window", type=float, default=600.0, help="steady-state seconds")
    parser.add_argument("--changes", type=int, default=60, help="lone CR changes (0: none)")
    parser.add_argument("--pause", type=float, default=0.5, help="seconds before each change")
    parser.add_argument("--wave", type=int, default=500, help="nodes entering cordon-required")
    parser.add_argument("--runs", type=int, default=3, help="waves of each kind (0: none)")
    parser.add_argument("--timeout", type=float, default=300, help="per wait, seconds")
    parser.add_argument("--width", type=int, default=32, help="requests at a time, populating")
    parser.add_argument("--trace", help="time shared-svc's steps into FILE.<nodes>")
    parser.add_argument("--profile", help="cProfile shared-svc after the window into FILE.<nodes>")
    parser.add_argument(
        "--profile-window", type=float, default=240.0, help="profiled seconds (with --profile)"
    )
    parser.add_argument(
        "--before",
        help="git ref: its start -> ready against this tree's, side by side in the last world",
    )
    parser.add_argument(
        "--startups", type=int, default=3, help="start-ups of each tree (with --before)"
    )
    parser.add_argument(
        "--startup-profile",
        help="cProfile shared-svc from its start until ready into FILE.<nodes> (print the top)",
    )
    parser.add_argument(
        "--wave-profile",
        help="cProfile shared-svc during the last wave into FILE (the last world; print the top)",
    )
    parser.add_argument(
        "--apiserver-profile",
        help="kube-apiserver's CPU profile of the last wave of each kind into FILE.bare, "
        "FILE.shared and FILE.bare-after (go tool pprof -top FILE.kind)",
    )
    parser.add_argument(
        "--apiserver-seconds",
        type=int,
        default=10,
        help="seconds of each kube-apiserver profile (from the wave's first patch)",
    )
    args = parser.parse_args()
    if min(args.scale, args.window, args.profile_window) <= 0 or args.width < 1:
        parser.error("--scale, --window, --profile-window and --width must be positive")
    if min(args.changes, args.runs) < 0:
        parser.error("--changes and --runs must be >= 0")
    if sum(map(bool, (args.profile, args.trace, args.wave_profile, args.startup_profile))) > 1:
        parser.error(
            "--profile, --wave-profile, --startup-profile and --trace each run shared-svc "
            "their own way: one at a time"
        )
    asyncio.run(main(args))
