"""Benchmark (not a test): CR change -> converged Service, as a user runs shared-svc.

Starts the embedded control plane (the real kube-apiserver) and ``shared-svc run`` as a
separate process with the shipped defaults (leader election on, coalescing 0.2 s, resync
300 s; only the namespace, kubeconfig and HTTP port are set). Then, ``--changes`` times,
interleaved:

- the measured change: flip ``spec.dcgmExporter.service.internalTrafficPolicy`` of the
  ClusterPolicy (merge patch) and time from sending it until a watch on the Services
  shows the exporter Service with the new value;
- the bare write that change needs: the same flip as a server-side apply of a Service
  of the same shape that shared-svc does not manage, sent by this script and timed the
  same way (from sending it until the watch shows it);
- the bare chain, the true floor of the change (issue 32): what the change is made of,
  done by this script alone. A merge patch of the same flip on a CR of its own (a twin of
  the ClusterPolicy CRD under the group ``bench.shared-svc.example``: the same schema and
  body, so the same cost, but no controller watches it), its own watch seeing the CR's
  new version, then its own server-side apply of a second bare Service, in a namespace
  shared-svc does not watch (nothing reacts to it), until a watch there shows it. The CR
  change is these two round trips with shared-svc's reaction between them; the chain is
  the same two with the script's.

Each write starts after a pause (``--pause``, 0.5 s by default) longer than the
coalescing spacing, so every measured change is a lone change, as a user makes them.
Then a burst: ``--burst`` CR changes sent back to back, and the reconciles they caused
(from the process's /metrics). Prints median and p99 with n, the ratios to the chain (the
goal: median <= 1.15x, p99 <= 1.5x) and to the bare write, writes per change, the
process's VmRSS/VmHWM from /proc (idle after start, and at the end), the load average
before and after, and the commit measured.

``--trace FILE`` runs shared-svc through ``benchmarks/traced_run.py`` (a timestamp per step
of each reconcile in FILE, on the benchmark's clock) and prints where the time of the CR
change and of the chain goes, step by step.

    .venv/bin/python benchmarks/bench_controller.py [--changes 60] [--burst 50] [--trace FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import json

from bench_memory import http_get, leading, memory
from kubernetes_asyncio import client

import testenv
from shared_svc.kube.resources import GVR, SERVICES
from shared_svc.kube.writer import APPLY, MERGE_PATCH, request
from tests.kube import api_client, make_namespace
from tests.svc import Kube, cp_body

NAME = "nvidia-dcgm-exporter"
BARE = "bench-bare-exporter"
CHAIN_SERVICE = "bench-chain-exporter"  # the chain's Service
# The chain's CR: a twin of the ClusterPolicy CRD no controller watches.
CHAIN_GROUP = "bench.shared-svc.example"
CHAIN_PLURAL = "clusterpolicies"
CHAIN_CR = "bench-chain"
# Goals of issue 32: the CR change against the bare chain.
CHAIN_MEDIAN_X, CHAIN_P99_X = 1.15, 1.5
CLUSTER_POLICIES = GVR("nvidia.com", "v1", "clusterpolicies")
CHAIN_CRS = GVR(CHAIN_GROUP, "v1", CHAIN_PLURAL)


# The benchmark's own requests are lean, the same for the CR change and the chain: a
# request and its answer read, not parsed into models (kubernetes_asyncio's models cost
# the benchmark milliseconds of CPU per request, which on 2 cores compete with the API
# server and shared-svc for the time measured).


async def send(
    api: client.ApiClient,
    method: str,
    path: str,
    body: Any,
    content_type: str,
    query: list[tuple[str, str]] | None = None,
) -> None:
    resp = await request(api, method, path, body=body, content_type=content_type, query=query)
    try:
        await resp.read()
    finally:
        resp.release()


async def watch_lines(api: client.ApiClient, path: str) -> Any:
    """Each event of a watch of ``path``, as (type, object), watched again as it ends."""
    while True:
        query = [("watch", "true"), ("timeoutSeconds", "300")]
        resp = await request(api, "GET", path, query=query, timeout=330)
        try:
            while line := await resp.content.readline():
                event = json.loads(line)
                yield event["type"], event["object"]
        finally:
            resp.release()


async def patch_policy(api: client.ApiClient, path: str, policy: str) -> None:
    """The CR change: a merge patch of the exporter Service's internalTrafficPolicy."""
    await send(api, "PATCH", path, policy_patch(policy), MERGE_PATCH)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def counter(metrics: str, name: str) -> float:
    """The sum of a metric's samples over all labels."""
    return sum(
        float(m.group(1))
        for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", metrics, flags=re.MULTILINE)
    )


class ServiceWatch:
    """Records when each version of the Services of a namespace showed which policy."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.seen: asyncio.Queue[tuple[float, str, str]] = asyncio.Queue()

    async def run(self) -> None:
        async for _, obj in watch_lines(self.kube.api, SERVICES.collection(self.kube.ns)):
            self.seen.put_nowait(
                (
                    time.perf_counter(),
                    obj["metadata"]["name"],
                    obj["spec"].get("internalTrafficPolicy"),
                )
            )

    async def wait_for(self, name: str, value: str) -> float:
        while True:
            at, got_name, got = await self.seen.get()
            if (got_name, got) == (name, value):
                return at


def bare_body(ns: str, policy: str, name: str = BARE) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": ns, "labels": {"app": name}},
        "spec": {
            "selector": {"app": "nvidia-dcgm-exporter"},
            "ports": [{"name": "gpu-metrics", "port": 9400, "targetPort": 9400}],
            "internalTrafficPolicy": policy,
        },
    }


def policy_patch(policy: str) -> dict[str, Any]:
    return {"spec": {"dcgmExporter": {"service": {"internalTrafficPolicy": policy}}}}


def chain_crd() -> dict[str, Any]:
    """The ClusterPolicy CRD the control plane has (testenv/crds), under the chain's group."""
    crd: dict[str, Any] = yaml.safe_load(
        (testenv.PROJECT_CRDS / "nvidia.com_clusterpolicies.yaml").read_text()
    )
    crd["metadata"] = {"name": f"{CHAIN_PLURAL}.{CHAIN_GROUP}"}
    crd["spec"]["group"] = CHAIN_GROUP
    return crd


class Chain:
    """The bare chain: the script's CR patch, its watch seeing the CR, its Service apply
    (in a namespace of its own, ``ns``, with a Service watch of its own)."""

    def __init__(self, api: client.ApiClient, ns: str) -> None:
        self.api = api
        self.custom = client.CustomObjectsApi(api)
        self.ns = ns
        self.seen: asyncio.Queue[str] = asyncio.Queue()
        self.services = ServiceWatch(Kube(api, ns))
        self._tasks: list[asyncio.Future[None]] = []
        self.steps: list[dict[str, float]] = []  # each chain's times (perf_counter)

    async def start(self, cp: testenv.ControlPlane, cluster_policy: dict[str, Any]) -> None:
        """The CRD (applied: once per control plane), the CR (the ClusterPolicy's body, so
        a patch costs what the ClusterPolicy's does) and the chain's Service (the
        ClusterPolicy's policy), and the CR watch."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, cp.apply_manifests, [chain_crd()])
        await loop.run_in_executor(None, cp.wait_established, [f"{CHAIN_PLURAL}.{CHAIN_GROUP}"])
        body = {
            **cluster_policy,
            "apiVersion": f"{CHAIN_GROUP}/v1",
            "metadata": {"name": CHAIN_CR},
        }
        policy = body["spec"]["dcgmExporter"]["service"]["internalTrafficPolicy"]
        try:
            await self.custom.create_cluster_custom_object(CHAIN_GROUP, "v1", CHAIN_PLURAL, body)
        except client.exceptions.ApiException as exc:
            if exc.status != 409:  # a world kept from an earlier chain
                raise
            await self._patch(policy)
        await _apply(self.api, self.ns, policy, CHAIN_SERVICE)
        self._tasks = [
            asyncio.ensure_future(self._watch()),
            asyncio.ensure_future(self.services.run()),
        ]
        await asyncio.sleep(2)  # both watches open

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _watch(self) -> None:
        async for _, obj in watch_lines(self.api, CHAIN_CRS.collection()):
            if obj["metadata"]["name"] == CHAIN_CR:
                spec = obj["spec"]["dcgmExporter"]["service"]
                self.seen.put_nowait(str(spec.get("internalTrafficPolicy")))

    async def _patch(self, policy: str) -> None:
        await patch_policy(self.api, CHAIN_CRS.item(CHAIN_CR), policy)

    async def once(self, policy: str) -> float:
        """One chain to ``policy``: milliseconds from sending the CR patch until the
        Service watch shows the chain's Service with it."""
        start = time.perf_counter()
        await self._patch(policy)
        answered = time.perf_counter()
        while await asyncio.wait_for(self.seen.get(), 30) != policy:
            pass
        cr_seen = time.perf_counter()
        await _apply(self.api, self.ns, policy, CHAIN_SERVICE)
        applied = time.perf_counter()
        seen = await asyncio.wait_for(self.services.wait_for(CHAIN_SERVICE, policy), 30)
        self.steps.append(
            {"start": start, "answered": answered, "cr_seen": cr_seen, "ws": cr_seen}
            | {"we": applied, "seen": seen}
        )
        return (seen - start) * 1000


def trace_steps(trace: Path) -> list[tuple[float, str]]:
    out = []
    for line in trace.read_text().splitlines():
        at, _, step = line.partition(" ")
        out.append((float(at), step))
    return sorted(out)


def shared_svc_steps(
    steps: list[tuple[float, str]], start: float, answered: float, seen: float
) -> dict[str, float] | None:
    """The steps of shared-svc's reconcile of one CR change (traced_run.py's marks): the
    ClusterPolicy event, the reconcile, its plan and its Service write."""
    out = {"start": start, "answered": answered, "seen": seen}
    wanted = (
        ("cr_seen", lambda s: s.startswith("event clusterpolicies")),
        ("rs", lambda s: s == "reconcile-start"),
        ("ps", lambda s: s == "plan-start"),
        ("pe", lambda s: s == "plan-end"),
        ("ws", lambda s: s == "write-start"),
        ("we", lambda s: s == "write-end"),
    )
    i = 0
    for at, step in steps:
        if at < start:
            continue
        if i == len(wanted) or at > seen + 1.0:
            break
        name, matches = wanted[i]
        if matches(step):
            out[name] = at
            i += 1
    return out if i == len(wanted) else None


def print_breakdown(
    trace: Path, marks: list[tuple[float, float, float]], chain: list[dict[str, float]]
) -> None:
    """Where the time goes: medians, in ms from sending the CR patch, of the CR change
    (shared-svc's steps from ``trace``) and of the chain (the script's)."""
    steps = trace_steps(trace)
    traced = [t for t in (shared_svc_steps(steps, *m) for m in marks) if t is not None]
    if not traced:
        print(f"--trace: no reconcile of a CR change found in {trace}")
        return

    def med(rows: list[dict[str, float]], a: str, b: str) -> float:
        return statistics.median((r[b] - r[a]) * 1000 for r in rows)

    print(
        f"where the time goes (medians, ms; n = {len(traced)} traced CR changes, {len(chain)} chains)"
    )
    print(f"{'':44}{'CR change':>11}{'chain':>11}")
    for title, a, b in (
        ("CR patch sent -> answered", "start", "answered"),
        ("CR patch sent -> CR event seen", "start", "cr_seen"),
        ("CR event seen -> Service write sent", "cr_seen", "ws"),
        ("Service write sent -> answered", "ws", "we"),
        ("Service write sent -> Service seen", "ws", "seen"),
        ("CR patch sent -> Service seen", "start", "seen"),
    ):
        print(f"{title:44}{med(traced, a, b):11.2f}{med(chain, a, b):11.2f}")
    print(
        f"shared-svc between the event and the write: to the reconcile "
        f"{med(traced, 'cr_seen', 'rs'):.2f}, snapshot {med(traced, 'rs', 'ps'):.2f}, "
        f"plan {med(traced, 'ps', 'pe'):.2f}, to the write {med(traced, 'pe', 'ws'):.2f} ms"
    )


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def commit() -> str:
    """The commit measured, ``+dirty`` when the checkout has changes."""
    run = lambda *a: subprocess.run(  # noqa: E731
        ["git", "-C", str(ROOT), *a], capture_output=True, text=True, check=False
    ).stdout.strip()
    head = run("rev-parse", "--short", "HEAD") or "?"
    return head + ("+dirty" if run("status", "--porcelain", "--untracked-files=no") else "")


async def main(changes: int, burst: int, pause: float, trace: Path | None = None) -> None:
    started_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_before = load()
    cp = await asyncio.get_running_loop().run_in_executor(None, testenv.start)
    proc: subprocess.Popen[bytes] | None = None
    fd, log_name = tempfile.mkstemp(prefix="shared-svc-bench-", suffix=".log")
    log = os.fdopen(fd, "wb")
    try:
        api = await api_client(cp)
        kube = Kube(api, await make_namespace(api, "bench"))
        cluster_policy = cp_body(dcgmExporter={"service": {"internalTrafficPolicy": "Cluster"}})
        await kube.create_cr(cluster_policy)
        port = testenv.free_port()
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("SHARED_SVC_")},
            "KUBECONFIG": str(cp.kubeconfig),
            "OPERATOR_NAMESPACE": kube.ns,
            "POD_NAME": "shared-svc-bench",
            "SHARED_SVC_BIND_ADDRESS": "127.0.0.1",
            "SHARED_SVC_PORT": str(port),
        }
        argv = [str(Path(sys.executable).with_name("shared-svc")), "run"]
        if trace is not None:  # benchmarks/traced_run.py: the same process, its steps timed
            env["BENCH_TRACE_OUT"] = str(trace)
            env["PYTHONPATH"] = str(ROOT)
            argv = [sys.executable, str(ROOT / "benchmarks" / "traced_run.py")]
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=log)
        deadline = time.monotonic() + 60
        while not leading(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"shared-svc run did not become ready; log: {log_name}")
            await asyncio.sleep(0.1)
        watcher, watch_task = await watch_services(kube)
        chain = Chain(api, await make_namespace(api, "bench-chain"))
        await chain.start(cp, cluster_policy)
        idle = memory(proc.pid)
        _, text = http_get(port, "/metrics")
        writes_before = counter(text, "shared_svc_writes_total")

        marks: list[tuple[float, float, float]] = []
        controller_ms, bare_ms, chain_ms, policy = await lone_changes(
            kube, watcher, chain, changes, pause, marks
        )
        await asyncio.sleep(pause)
        _, text = http_get(port, "/metrics")
        writes = counter(text, "shared_svc_writes_total") - writes_before

        # A burst: changes sent back to back, then the reconciles they caused.
        reconciles_before = counter(text, "controller_runtime_reconcile_total")
        for _ in range(burst):
            policy = "Local" if policy == "Cluster" else "Cluster"
            await patch_policy(kube.api, CLUSTER_POLICIES.item("cluster-policy"), policy)
        await asyncio.wait_for(watcher.wait_for(NAME, policy), 30)
        await asyncio.sleep(1.0)
        _, text = http_get(port, "/metrics")
        burst_reconciles = counter(text, "controller_runtime_reconcile_total") - reconciles_before
        end = memory(proc.pid)
        await chain.stop()
        watch_task.cancel()
        await asyncio.gather(watch_task, return_exceptions=True)
        await api.close()
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        cp.stop()

    print(
        f"shared-svc run (separate process, shipped defaults); started {started_at}, "
        f"commit {commit()}, load average {load_before} before, {load()} after"
    )
    print(f"n = {changes} changes each, interleaved with the bare write and the bare chain,")
    print(f"each after a {pause:g} s pause")
    print_changes(controller_ms, bare_ms, chain_ms)
    if trace is not None:
        print_breakdown(trace, marks, chain.steps)
    print(f"writes per change: {writes / changes:.2f} (the bare change needs 1)")
    print(f"burst: {burst} CR changes back to back -> {burst_reconciles:.0f} reconciles")
    print(
        f"memory: idle VmRSS {idle['VmRSS']:.1f} MiB, VmHWM {idle['VmHWM']:.1f} MiB; "
        f"at the end VmRSS {end['VmRSS']:.1f} MiB, VmHWM {end['VmHWM']:.1f} MiB"
    )


async def watch_services(kube: Kube) -> tuple[ServiceWatch, asyncio.Future[None]]:
    """A ``ServiceWatch`` started once shared-svc's first reconcile wrote the exporter
    Service, and the bare Service created (policy ``Cluster``, as the CR's)."""
    watcher = ServiceWatch(kube)
    watch_task = asyncio.ensure_future(watcher.run())
    while (await kube.service(NAME)) is None:  # noqa: ASYNC110 - the first reconcile
        await asyncio.sleep(0.1)
    await _apply(kube.api, kube.ns, "Cluster")
    await asyncio.sleep(2)
    return watcher, watch_task


async def lone_changes(
    kube: Kube,
    watcher: ServiceWatch,
    chain: Chain,
    changes: int,
    pause: float,
    marks: list[tuple[float, float, float]] | None = None,
) -> tuple[list[float], list[float], list[float], str]:
    """``changes`` lone CR changes interleaved with as many bare writes and bare chains,
    each after ``pause`` seconds: the milliseconds of each (controller, bare, chain) and
    the last policy. ``marks`` collects each CR change's (sent, answered, seen) times."""
    controller_ms: list[float] = []
    bare_ms: list[float] = []
    chain_ms: list[float] = []
    policy = "Cluster"
    for _ in range(changes):
        policy = "Local" if policy == "Cluster" else "Cluster"
        await asyncio.sleep(pause)
        start = time.perf_counter()
        await patch_policy(kube.api, CLUSTER_POLICIES.item("cluster-policy"), policy)
        answered = time.perf_counter()
        seen = await asyncio.wait_for(watcher.wait_for(NAME, policy), 30)
        controller_ms.append((seen - start) * 1000)
        if marks is not None:
            marks.append((start, answered, seen))
        await asyncio.sleep(pause)
        start = time.perf_counter()
        await _apply(kube.api, kube.ns, policy)
        seen = await asyncio.wait_for(watcher.wait_for(BARE, policy), 30)
        bare_ms.append((seen - start) * 1000)
        await asyncio.sleep(pause)
        chain_ms.append(await chain.once(policy))
    return controller_ms, bare_ms, chain_ms, policy


def ratios(controller_ms: list[float], floor_ms: list[float]) -> tuple[float, float]:
    """(median, p99) of the CR change over those of a floor."""
    return (
        statistics.median(controller_ms) / statistics.median(floor_ms),
        pct(controller_ms, 0.99) / pct(floor_ms, 0.99),
    )


def met(value: float, limit: float) -> str:
    return f"<= {limit:g}: {'met' if value <= limit else 'NOT met'}"


def print_changes(
    controller_ms: list[float], bare_ms: list[float], chain_ms: list[float]
) -> tuple[float, float]:
    """Prints median and p99 of the three and the ratios of the CR change to the chain
    (with the goals) and to the bare write; returns the ratios to the chain."""
    print(f"{'':34}{'median ms':>11}{'p99 ms':>11}")
    for title, values in (
        ("CR change -> Service converged", controller_ms),
        ("bare chain (CR, watch, apply)", chain_ms),
        ("bare Service apply -> seen", bare_ms),
    ):
        print(f"{title:34}{statistics.median(values):11.1f}{pct(values, 0.99):11.1f}")
    med, p99 = ratios(controller_ms, chain_ms)
    print(f"{'ratio (controller / chain)':34}{med:11.2f}{p99:11.2f}")
    print(f"  goal: median {met(med, CHAIN_MEDIAN_X)}; p99 {met(p99, CHAIN_P99_X)}")
    bmed, bp99 = ratios(controller_ms, bare_ms)
    print(f"{'ratio (controller / bare apply)':34}{bmed:11.2f}{bp99:11.2f}")
    cmed, cp99 = ratios(chain_ms, bare_ms)
    print(f"{'ratio (chain / bare apply)':34}{cmed:11.2f}{cp99:11.2f}")
    return med, p99


async def _apply(api: client.ApiClient, ns: str, policy: str, name: str = BARE) -> None:
    await send(
        api,
        "PATCH",
        SERVICES.item(name, ns),
        bare_body(ns, policy, name),
        APPLY,
        query=[("fieldManager", "bench"), ("force", "true")],
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--changes", type=int, default=60)
    parser.add_argument("--burst", type=int, default=50)
    parser.add_argument("--pause", type=float, default=0.5)
    parser.add_argument("--trace", type=Path, help="time shared-svc's steps into this file")
    args = parser.parse_args()
    asyncio.run(main(args.changes, args.burst, args.pause, args.trace))
