"""Benchmark (not a test): an upgrade wave on the real API server, ``shared-svc run`` as its own process.

Starts the embedded control plane (the real kube-apiserver; no kubelet, no controllers)
and builds: ``--nodes`` GPU Nodes (default 200) in the gpu-operator state
``upgrade-required``, each as a GPU node looks (``tests/realistic.py``: discovery labels
and annotations, a kubelet's status with capacity, conditions and images written through
the status subresource; about 15 KiB), each with ``--consumers`` declared consumer pods
(default 2; ``tests/realistic.api_pod`` pods without their owner and operand
nodeSelector, labelled ``nvidia.com/gpu-driver-upgrade.consumer=true``, their status
written through the status subresource), and a ClusterPolicy with auto-upgrade on whose
gate selects them. Then ``shared-svc run`` is started as its own process with the shipped
defaults and both controllers on (only the namespace, kubeconfig, pod name and HTTP port
are set besides; ``SHARED_SVC_UPGRADE_CONTROLLER=true``), and waits until it leads and is
ready.

Each repetition puts every node into ``cordon-required`` at once (one label patch per
node, sent concurrently, as gpu-operator's upgrade flow does for ``maxParallelUpgrades``
nodes) and times, from sending the first patch, with a watch of nodes and pods (their
metadata only: the instrument reads nothing else):

- **makespan**: until every node has its record annotation written and every consumer
  pod on it evicted (the eviction accepted: the pod has a ``deletionTimestamp``), the
  work of shared-svc; per node the same, median and p99 over all nodes of all runs;
- **freed**: until every node's record says ``freedAt`` (``GPUConsumersFreed``). This
  plays the kubelet: a terminating pod is deleted with grace 0, once,
  ``--kubelet-delay`` seconds after it is seen terminating (default 0: at once, the
  harshest case, as every kubelet's delete then lands inside the wave on these cores; a
  real container takes at least its exit and the kubelet's sync). shared-svc looks at a
  node again after its own record patch and then every ``upgrade_poll_seconds`` (5 s)
  while its consumers are leaving.

Each repetition also prints when the benchmark's own state patches had all landed (part
of the makespan: the clock starts at the first one), the upgrade controller's counters
over it (passes, node patches, evictions, from its ``/metrics``), the CPU seconds of
etcd, kube-apiserver, shared-svc and the benchmark itself until the makespan's end
(``/proc/PID/stat``; they share the machine's cores), and the API server's own request
counts by verb and resource over the same time (``apiserver_request_total``; the
evictions' PodDisruptionBudget lists are the API server's own). ``--profile FILE``
cProfiles shared-svc during the last repetition (``benchmarks/profiled_run.py``, as
``bench_memory.py --profile``) and prints the top functions; ``--apiserver-profile
FILE`` saves kube-apiserver's own CPU profile of the first 4 s of the last repetition
(``go tool pprof -top FILE``).

**bare**, side by side in the same run: before shared-svc starts, the same number of
repetitions in which the benchmark sends the writes shared-svc would send itself, per
node as soon as its state patch lands (``bare_wave``: the record patch, then the
evictions at once; no reads, no reaction time), timed the same way, with the same
kubelet and instrument: the floor this API server and machine allow. The ratio
shared-svc / bare is printed.

Between repetitions the nodes go to ``upgrade-done`` (shared-svc removes its label and
record) and back to ``upgrade-required``, and new consumer pods are created.

    .venv/bin/python benchmarks/bench_upgrade.py [--nodes 200] [--consumers 2] [--runs 5]
        [--kubelet-delay 0] [--profile FILE] [--apiserver-profile FILE] [--ref REF]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pstats
import signal
import ssl
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_memory import (
    Run,
    _many,
    _pod,
    cpu_seconds,
    create_gpu_node,
    http_get,
    request_counts,
    worktree,
)
from kubernetes_asyncio.client import ApiClient

import testenv
from shared_svc.kube.resources import METADATA
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
    """Nodes and consumer pods, watched from a resourceVersion on (their metadata only,
    all the times need); first times of interest."""

    def __init__(self, api: ApiClient, kubelet_delay: float = 0.0) -> None:
        self.api = api
        self.kubelet_delay = kubelet_delay  # seconds a container takes to exit after SIGTERM
        self.record_at: dict[str, float] = {}  # node -> record annotation first seen
        self.freed_at: dict[str, float] = {}  # node -> record with freedAt first seen
        self.evicted_at: dict[str, float] = {}  # pod -> deletionTimestamp (or gone) first seen
        self._kubelet: set[asyncio.Task[Any]] = set()
        self._confirmed: set[str] = set()  # pods the kubelet's part has deleted
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
                # The instrument reads only metadata: as PartialObjectMetadata, the API
                # server encodes and this process parses a fraction of each pod.
                header_params={"Accept": METADATA},
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
        if (
            etype != "DELETED"
            and meta.get("deletionTimestamp")
            and meta["name"] not in self._confirmed
        ):
            # The kubelet's part: the containers are gone, confirm with grace 0 (once: the
            # pod is seen terminating more than once).
            self._confirmed.add(meta["name"])
            task = asyncio.ensure_future(self._finish(meta["name"]))
            self._kubelet.add(task)
            task.add_done_callback(self._kubelet.discard)

    async def _finish(self, name: str) -> None:
        await asyncio.sleep(self.kubelet_delay)
        with contextlib.suppress(Exception):
            await raw_request(
                self.api,
                "DELETE",
                f"/api/v1/namespaces/{CONSUMERS_NS}/pods/{name}",
                body={"gracePeriodSeconds": 0},
                accept=METADATA,  # a kubelet reads no answer (and speaks protobuf)
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
    bodies = [
        workload_pod(name, node, CONSUMERS_NS, {"app": "gpu-job", CONSUMER: "true"})
        for name, node in pods.items()
    ]
    await _many([_pod(api, p) for p in bodies])


def workload_pod(name: str, node: str, ns: str, labels: dict[str, str]) -> dict[str, Any]:
    """A GPU workload's pod (``tests/realistic.api_pod``) on ``node``: ``labels`` only, no
    owner, and no nvidia.com/gpu.deploy.* nodeSelector (that is gpu-operator's own pods,
    never ours to evict); the nvidia RuntimeClass stays (a GPU consumer)."""
    pod = api_pod("gpu-job", name, node, common=False)
    pod["metadata"]["namespace"] = ns
    pod["metadata"]["labels"] = labels
    pod["metadata"].pop("ownerReferences", None)
    pod["spec"].pop("nodeSelector", None)
    return pod


async def bare_wave(api: ApiClient, nodes: int, by_node: dict[str, list[str]]) -> None:
    """The writes of a wave without shared-svc, sent by the benchmark itself: per node, its
    state patch and, as soon as it lands, what shared-svc writes for it (one node patch
    with the parked label and a record of the same shape, and the evictions of its
    consumers, at once). No reads and no reaction time: the floor an ideal client would
    reach on this API server, with the same kubelet and instrument."""

    async def one(i: int) -> None:
        name = node_name(i)
        path = f"/api/v1/nodes/{name}"
        state = {"metadata": {"labels": {STATE: "cordon-required"}}}
        await raw_request(api, "PATCH", path, body=state, content_type=MERGE_PATCH)
        record = {
            "version": 1,
            "since": "2026-11-30T00:00:00Z",
            "parkedLabel": True,
            "freedAt": None,
            "pods": [
                {"namespace": CONSUMERS_NS, "name": pod, "uid": "", "blocked": False}
                for pod in by_node[name]
            ],
            "detectedReported": [],
        }
        body = {
            "metadata": {
                "labels": {PARKED: "true"},
                "annotations": {RECORD: json.dumps(record, separators=(",", ":"))},
            }
        }
        await raw_request(api, "PATCH", path, body=body, content_type=MERGE_PATCH, accept=METADATA)
        await asyncio.gather(
            *(
                raw_request(
                    api,
                    "POST",
                    f"/api/v1/namespaces/{CONSUMERS_NS}/pods/{pod}/eviction",
                    body={
                        "apiVersion": "policy/v1",
                        "kind": "Eviction",
                        "metadata": {"name": pod, "namespace": CONSUMERS_NS},
                    },
                )
                for pod in by_node[name]
            )
        )

    await _many([one(i) for i in range(nodes)], width=64)


async def clear_bare(api: ApiClient, nodes: int) -> None:
    """Removes what ``bare_wave`` wrote (shared-svc does it on ``upgrade-done``)."""
    undo = {"metadata": {"labels": {PARKED: None}, "annotations": {RECORD: None}}}
    await _many(
        [
            raw_request(
                api, "PATCH", f"/api/v1/nodes/{node_name(i)}", body=undo, content_type=MERGE_PATCH
            )
            for i in range(nodes)
        ],
        width=64,
    )


def by_node_of(pods: dict[str, str], nodes: int) -> dict[str, list[str]]:
    by_node: dict[str, list[str]] = {node_name(i): [] for i in range(nodes)}
    for pod, node in pods.items():
        by_node[node].append(pod)
    return by_node


def node_done(watcher: Watcher, by_node: dict[str, list[str]], node: str) -> float | None:
    """When ``node``'s record was written and its last consumer evicted (None: not yet)."""
    times = [watcher.record_at.get(node)] + [watcher.evicted_at.get(p) for p in by_node[node]]
    return None if None in times else max(t for t in times if t is not None)


async def wait_for(check: Any, timeout: float, what: str, run: Run | None) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            status = http_get(run.port, "/status")[1] if run else "(no shared-svc)"
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


APISERVER_PROFILE_SECONDS = 4


def fetch_apiserver_profile(
    cp: testenv.ControlPlane, out: str, seconds: int = APISERVER_PROFILE_SECONDS
) -> None:
    """kube-apiserver's own CPU profile (``/debug/pprof/profile``) of the first ``seconds``
    of a wave, written to ``out`` (read it with ``go tool pprof``)."""
    req = urllib.request.Request(
        f"{cp.url}/debug/pprof/profile?seconds={seconds}",
        headers={"Authorization": f"Bearer {cp.admin_token}"},
    )
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # 127.0.0.1, its own CA
    with urllib.request.urlopen(req, context=context, timeout=seconds + 30) as r:
        Path(out).write_bytes(r.read())


async def start_apiserver_profile(
    cp: testenv.ControlPlane, out: str | None, seconds: int
) -> asyncio.Future[None] | None:
    """``fetch_apiserver_profile`` in a thread, once the profile has started (None: no ``out``)."""
    if out is None:
        return None
    fetched = asyncio.get_running_loop().run_in_executor(
        None, fetch_apiserver_profile, cp, out, seconds
    )
    await asyncio.sleep(0.2)  # the profile has started
    return fetched


def cpu_of(pids: dict[str, int]) -> dict[str, float]:
    """User+system CPU seconds so far of each named process (``bench_memory.cpu_seconds``);
    a process that is gone is left out."""
    out: dict[str, float] = {}
    for name, pid in pids.items():
        with contextlib.suppress(OSError):
            out[name] = cpu_seconds(pid)
    return out


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


async def bare_runs(
    api: ApiClient,
    cp: testenv.ControlPlane,
    watcher: Watcher,
    nodes: int,
    per_node: int,
    runs: int,
    timeout: float,
    apiserver_profile: str | None = None,
    apiserver_seconds: int = APISERVER_PROFILE_SECONDS,
    first_run: int = 0,
) -> tuple[list[float], dict[str, float]]:
    """``runs`` bare waves (``bare_wave``) over the first ``nodes`` nodes, without shared-svc:
    each one's makespan, and the CPU seconds of the control plane and the benchmark summed.
    ``apiserver_profile``: kube-apiserver's CPU profile of the first ``apiserver_seconds``
    of the last wave, into that file. ``first_run``: the number of bare waves before these
    (their consumer pods' names, their lines)."""
    bare_pids = {name: proc.pid for name, proc in cp.processes.items()}
    bare_pids["benchmark"] = os.getpid()
    bare_cpu: dict[str, float] = {}
    bare: list[float] = []
    for rep in range(runs):
        pods = consumer_pods(1000 + first_run + rep, nodes, per_node)
        await create_consumers(api, pods)
        await asyncio.sleep(2)
        watcher.reset()
        by_node = by_node_of(pods, nodes)
        last = rep == runs - 1
        profiled = await start_apiserver_profile(
            cp, apiserver_profile if last else None, apiserver_seconds
        )
        cpu_before = cpu_of(bare_pids)
        t0 = time.monotonic()
        await bare_wave(api, nodes, by_node)
        await wait_for(
            lambda: all(node_done(watcher, by_node, n) is not None for n in by_node),  # noqa: B023
            timeout,
            "evictions (bare)",
            None,
        )
        cpu_wave = cpu_of(bare_pids)
        bare.append(max(node_done(watcher, by_node, n) or 0.0 for n in by_node) - t0)
        cpu = {k: cpu_wave[k] - cpu_before.get(k, 0.0) for k in cpu_wave}
        for k, v in cpu.items():
            bare_cpu[k] = bare_cpu.get(k, 0.0) + v
        print(
            f"bare run {first_run + rep + 1}: makespan {bare[-1]:.2f} s; CPU seconds: "
            + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()),
            flush=True,
        )
        if profiled is not None:
            await profiled
        await set_state(api, nodes, "upgrade-done")
        await clear_bare(api, nodes)
        await set_state(api, nodes, "upgrade-required")
    return bare, bare_cpu


async def shared_runs(
    api: ApiClient,
    cp: testenv.ControlPlane,
    run: Run,
    watcher: Watcher,
    nodes: int,
    per_node: int,
    runs: int,
    timeout: float,
    profile: str | None = None,
    apiserver_profile: str | None = None,
    apiserver_seconds: int = APISERVER_PROFILE_SECONDS,
) -> tuple[list[float], list[float], list[float], dict[str, float]]:
    """``runs`` waves over the first ``nodes`` nodes with ``run`` (shared-svc) doing the work:
    the makespans, the freed times, the per-node times and the CPU seconds summed.
    ``profile``: shared-svc (under ``profiled_run``) profiled in the last wave until every
    record says freedAt; ``apiserver_profile``: kube-apiserver's CPU profile of the first
    ``apiserver_seconds`` of the last wave."""
    pids = {name: proc.pid for name, proc in cp.processes.items()}
    pids |= {"shared-svc": run.proc.pid, "benchmark": os.getpid()}
    cpu_totals: dict[str, float] = {}
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
        server_profile = await start_apiserver_profile(
            cp, apiserver_profile if rep == runs - 1 else None, apiserver_seconds
        )
        requests_before = request_counts(cp)
        cpu_before = cpu_of(pids)
        t0 = time.monotonic()
        await set_state(api, nodes, "cordon-required")
        landed.append(time.monotonic() - t0)
        names = [node_name(i) for i in range(nodes)]
        by_node = by_node_of(pods, nodes)

        await wait_for(
            lambda: all(node_done(watcher, by_node, n) is not None for n in by_node),  # noqa: B023
            timeout,
            "evictions",
            run,
        )
        cpu_wave, cpu_wave_at = cpu_of(pids), time.monotonic()
        requests_wave = request_counts(cp)
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
        cpu = {k: cpu_wave[k] - cpu_before.get(k, 0.0) for k in cpu_wave}
        for k, v in cpu.items():
            cpu_totals[k] = cpu_totals.get(k, 0.0) + v
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
        print(
            "  CPU seconds until the makespan's end: "
            + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items())
            + f" (machine: {os.cpu_count()} CPUs x {cpu_wave_at - t0:.2f} s = "
            f"{(os.cpu_count() or 1) * (cpu_wave_at - t0):.2f})",
            flush=True,
        )
        if server_profile is not None:
            await server_profile
        print(
            "  API requests until the makespan's end (watches apart): "
            + ", ".join(
                f"{verb} {what} {requests_wave[verb, what] - requests_before.get((verb, what), 0)}"
                for verb, what in sorted(requests_wave)
                if requests_wave[verb, what] != requests_before.get((verb, what), 0)
                and verb not in ("WATCH", "WATCHLIST")
            ),
            flush=True,
        )
        await set_state(api, nodes, "upgrade-done")
        await records_gone(api, nodes)
        await set_state(api, nodes, "upgrade-required")
    return makespans, freed, per_node_done, cpu_totals


async def main(
    nodes: int,
    per_node: int,
    runs: int,
    ref: str | None,
    timeout: float = 300,
    profile: str | None = None,
    apiserver_profile: str | None = None,
    kubelet_delay: float = 0.0,
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
                create_gpu_node(api, node_name(i), **{STATE: "upgrade-required"})
                for i in range(nodes)
            ]
        )
        watcher = Watcher(api, kubelet_delay)
        await watcher.start()
        bare, bare_cpu = await bare_runs(api, cp, watcher, nodes, per_node, runs, timeout)
        run = Run(cp, OPERATOR_NS, tree, profile)
        await run.ready()
        makespans, freed, per_node_done, cpu_totals = await shared_runs(
            api, cp, run, watcher, nodes, per_node, runs, timeout, profile, apiserver_profile
        )
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
        f"bare (the same writes sent by the benchmark as each state patch lands, no "
        f"shared-svc; before it starts), n={len(bare)} runs: median {statistics.median(bare):.2f} s, "
        f"p99 {percentile(bare, 99):.2f} s; shared-svc / bare: median "
        f"{statistics.median(makespans) / statistics.median(bare):.2f}x, p99 "
        f"{percentile(makespans, 99) / percentile(bare, 99):.2f}x"
    )
    print(
        f"per node (its record written, its consumers evicted), n={len(per_node_done)}: "
        f"median {statistics.median(per_node_done):.2f} s, "
        f"p99 {percentile(per_node_done, 99):.2f} s"
    )
    print(
        f"freed (freedAt on every node; the kubelet's delete {kubelet_delay:g} s after the "
        f"eviction; 5 s poll), n={len(freed)}: "
        f"median {statistics.median(freed):.2f} s, p99 {percentile(freed, 99):.2f} s"
    )
    print(
        f"CPU seconds per run from the first state patch to the makespan's end, mean of {runs}: "
        + ", ".join(f"{k} {v / runs:.2f}" for k, v in cpu_totals.items())
    )
    print(
        f"the same for bare, mean of {runs}: "
        + ", ".join(f"{k} {v / runs:.2f}" for k, v in bare_cpu.items())
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
    parser.add_argument(
        "--apiserver-profile",
        help=f"kube-apiserver's CPU profile of the first {APISERVER_PROFILE_SECONDS} s of the last "
        "repetition into FILE (go tool pprof -top FILE)",
    )
    parser.add_argument(
        "--kubelet-delay",
        type=float,
        default=0.0,
        help="seconds from a pod seen terminating to the kubelet's delete (its containers' exit)",
    )
    args = parser.parse_args()
    asyncio.run(
        main(
            args.nodes,
            args.consumers,
            args.runs,
            args.ref,
            args.timeout,
            args.profile,
            args.apiserver_profile,
            args.kubelet_delay,
        )
    )
