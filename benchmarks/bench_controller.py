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
  same way (from sending it until the watch shows it).

Each write starts after a pause (``--pause``, 0.5 s by default) longer than the
coalescing spacing, so every measured change is a lone change, as a user makes them.
Then a burst: ``--burst`` CR changes sent back to back, and the reconciles they caused
(from the process's /metrics). Prints median and p99 with n, their ratios, writes per
change, and the process's VmRSS/VmHWM from /proc (idle after start, and at the end).

    .venv/bin/python benchmarks/bench_controller.py [--changes 60] [--burst 50]
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_memory import http_get, leading, memory
from kubernetes_asyncio import client, watch

import testenv
from tests.kube import api_client, make_namespace
from tests.svc import Kube, cp_body

NAME = "nvidia-dcgm-exporter"
BARE = "bench-bare-exporter"


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
    """Records when each version of the two Services showed which policy."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.seen: asyncio.Queue[tuple[float, str, str]] = asyncio.Queue()

    async def run(self) -> None:
        while True:
            w = watch.Watch()
            async for ev in w.stream(
                self.kube.core.list_namespaced_service, self.kube.ns, timeout_seconds=300
            ):
                obj = ev["object"]
                self.seen.put_nowait(
                    (time.perf_counter(), obj.metadata.name, obj.spec.internal_traffic_policy)
                )

    async def wait_for(self, name: str, value: str) -> float:
        while True:
            at, got_name, got = await self.seen.get()
            if (got_name, got) == (name, value):
                return at


def bare_body(ns: str, policy: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": BARE, "namespace": ns, "labels": {"app": BARE}},
        "spec": {
            "selector": {"app": "nvidia-dcgm-exporter"},
            "ports": [{"name": "gpu-metrics", "port": 9400, "targetPort": 9400}],
            "internalTrafficPolicy": policy,
        },
    }


async def main(changes: int, burst: int, pause: float) -> None:
    cp = await asyncio.get_running_loop().run_in_executor(None, testenv.start)
    proc: subprocess.Popen[bytes] | None = None
    fd, log_name = tempfile.mkstemp(prefix="shared-svc-bench-", suffix=".log")
    log = os.fdopen(fd, "wb")
    try:
        api = await api_client(cp)
        kube = Kube(api, await make_namespace(api, "bench"))
        core = client.CoreV1Api(api)
        await kube.create_cr(
            cp_body(dcgmExporter={"service": {"internalTrafficPolicy": "Cluster"}})
        )
        port = testenv.free_port()
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("SHARED_SVC_")},
            "KUBECONFIG": str(cp.kubeconfig),
            "OPERATOR_NAMESPACE": kube.ns,
            "POD_NAME": "shared-svc-bench",
            "SHARED_SVC_BIND_ADDRESS": "127.0.0.1",
            "SHARED_SVC_PORT": str(port),
        }
        exe = Path(sys.executable).with_name("shared-svc")
        proc = subprocess.Popen([str(exe), "run"], env=env, stdout=log, stderr=log)
        deadline = time.monotonic() + 60
        while not leading(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"shared-svc run did not become ready; log: {log_name}")
            await asyncio.sleep(0.1)
        watcher, watch_task = await watch_services(kube, core)
        idle = memory(proc.pid)
        _, text = http_get(port, "/metrics")
        writes_before = counter(text, "shared_svc_writes_total")

        controller_ms, bare_ms, policy = await lone_changes(kube, core, watcher, changes, pause)
        await asyncio.sleep(pause)
        _, text = http_get(port, "/metrics")
        writes = counter(text, "shared_svc_writes_total") - writes_before

        # A burst: changes sent back to back, then the reconciles they caused.
        reconciles_before = counter(text, "controller_runtime_reconcile_total")
        for _ in range(burst):
            policy = "Local" if policy == "Cluster" else "Cluster"
            await kube.patch_cr(
                "ClusterPolicy",
                "cluster-policy",
                {"spec": {"dcgmExporter": {"service": {"internalTrafficPolicy": policy}}}},
            )
        await asyncio.wait_for(watcher.wait_for(NAME, policy), 30)
        await asyncio.sleep(1.0)
        _, text = http_get(port, "/metrics")
        burst_reconciles = counter(text, "controller_runtime_reconcile_total") - reconciles_before
        end = memory(proc.pid)
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

    print(f"shared-svc run (separate process, shipped defaults); n = {changes} changes each,")
    print(f"interleaved with the bare write, each after a {pause:g} s pause")
    print_changes(controller_ms, bare_ms)
    print(f"writes per change: {writes / changes:.2f} (the bare change needs 1)")
    print(f"burst: {burst} CR changes back to back -> {burst_reconciles:.0f} reconciles")
    print(
        f"memory: idle VmRSS {idle['VmRSS']:.1f} MiB, VmHWM {idle['VmHWM']:.1f} MiB; "
        f"at the end VmRSS {end['VmRSS']:.1f} MiB, VmHWM {end['VmHWM']:.1f} MiB"
    )


async def watch_services(
    kube: Kube, core: client.CoreV1Api
) -> tuple[ServiceWatch, asyncio.Future[None]]:
    """A ``ServiceWatch`` started once shared-svc's first reconcile wrote the exporter
    Service, and the bare Service created (policy ``Cluster``, as the CR's)."""
    watcher = ServiceWatch(kube)
    watch_task = asyncio.ensure_future(watcher.run())
    while (await kube.service(NAME)) is None:  # noqa: ASYNC110 - the first reconcile
        await asyncio.sleep(0.1)
    await _apply(core, kube.ns, "Cluster")
    await asyncio.sleep(2)
    return watcher, watch_task


async def lone_changes(
    kube: Kube, core: client.CoreV1Api, watcher: ServiceWatch, changes: int, pause: float
) -> tuple[list[float], list[float], str]:
    """``changes`` lone CR changes interleaved with as many bare writes, each after
    ``pause`` seconds: the milliseconds of each (controller, bare) and the last policy."""
    controller_ms: list[float] = []
    bare_ms: list[float] = []
    policy = "Cluster"
    for _ in range(changes):
        policy = "Local" if policy == "Cluster" else "Cluster"
        await asyncio.sleep(pause)
        start = time.perf_counter()
        await kube.patch_cr(
            "ClusterPolicy",
            "cluster-policy",
            {"spec": {"dcgmExporter": {"service": {"internalTrafficPolicy": policy}}}},
        )
        seen = await asyncio.wait_for(watcher.wait_for(NAME, policy), 30)
        controller_ms.append((seen - start) * 1000)
        await asyncio.sleep(pause)
        start = time.perf_counter()
        await _apply(core, kube.ns, policy)
        seen = await asyncio.wait_for(watcher.wait_for(BARE, policy), 30)
        bare_ms.append((seen - start) * 1000)
    return controller_ms, bare_ms, policy


def print_changes(controller_ms: list[float], bare_ms: list[float]) -> tuple[float, float]:
    """Prints median and p99 of both and their ratios; returns the ratios (median, p99)."""
    med_c, p99_c = statistics.median(controller_ms), pct(controller_ms, 0.99)
    med_b, p99_b = statistics.median(bare_ms), pct(bare_ms, 0.99)
    print(f"{'':34}{'median ms':>11}{'p99 ms':>11}")
    print(f"{'CR change -> Service converged':34}{med_c:11.1f}{p99_c:11.1f}")
    print(f"{'bare Service apply -> seen':34}{med_b:11.1f}{p99_b:11.1f}")
    print(f"{'ratio (controller / bare)':34}{med_c / med_b:11.2f}{p99_c / p99_b:11.2f}")
    return med_c / med_b, p99_c / p99_b


async def _apply(core: client.CoreV1Api, ns: str, policy: str) -> None:
    await core.patch_namespaced_service(
        BARE,
        ns,
        bare_body(ns, policy),
        field_manager="bench",
        force=True,
        _content_type="application/apply-patch+yaml",
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--changes", type=int, default=60)
    parser.add_argument("--burst", type=int, default=50)
    parser.add_argument("--pause", type=float, default=0.5)
    args = parser.parse_args()
    asyncio.run(main(args.changes, args.burst, args.pause))
