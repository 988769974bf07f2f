"""Benchmark (not a test): memory, steady-state writes and CPU of ``shared-svc run`` at fleet scale.

Starts the embedded control plane (the real kube-apiserver, no controller-manager) and
builds the world of issue 12 on it: 1,000 Nodes, 8,000 gpu-operator pods in the operator
namespace (four DaemonSets' pods, ``tests/realistic.api_pod``: the spec as created, the
status written through the status subresource, so the server's managedFields too) and
2,000 consumer pods in another namespace; both CRs and the four DaemonSets.

Then ``shared-svc run`` is started as its own process with the shipped defaults and both
controllers on (``SHARED_SVC_UPGRADE_CONTROLLER=true``; only the namespace, kubeconfig, pod
name and HTTP port are set besides), and the script prints, from /proc of that process:

- VmRSS idle: in a small world (one ClusterPolicy, nothing else), measured first;
- VmRSS after sync (ready, then 10 s quiet) and VmHWM (the peak, start-up included);
- writes in steady state: the API server's own ``apiserver_request_total`` write
  verbs over ``--window`` seconds, by resource, Leases apart (``endpoints`` writes, one
  every 10 s, are the API server's own ``kubernetes`` Service: they come without
  shared-svc too);
- CPU: (utime + stime) from /proc/<pid>/stat over the same window, in % of one core.
  The default window is 300 s, one default ``resync_seconds``: the average takes in the
  controllers' periodic reconciles from their caches (the Services controller's every
  300 s, the upgrade controller's every 120 s). The caches no longer re-list on it: they
  re-list only when a watch cannot resume, which a healthy run does not see.

The Lease writes counted include the API server's own (its identity Lease in
``kube-system``, one write every 10 s); shared-svc's are one PUT per ``retry_period``.

``--profile FILE`` runs this tree's process under cProfile for the window only
(``benchmarks/profiled_run.py``: SIGUSR1 starts, SIGUSR2 stops and writes FILE) and prints
the top functions; the CPU figure of such a run includes the profiler's overhead.

``--before REF`` runs the same measurements on the code of git ``REF`` too (a temporary
worktree put first on PYTHONPATH), in the same world, and prints both side by side.

    .venv/bin/python benchmarks/bench_memory.py [--before REF] [--window 300] [--profile FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import pstats
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kubernetes_asyncio.client import ApiClient

import testenv
from shared_svc.kube.writer import MERGE_PATCH, raw_request
from tests.kube import api_client, make_namespace
from tests.realistic import api_node_labels, api_node_status, api_pod
from tests.svc import Kube, cp_body
from tests.worlds import APPS

NODES = 1000
OPERATOR_PODS = 8000
CONSUMER_PODS = 2000
TICKS = os.sysconf("SC_CLK_TCK")


def memory(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of ``pid`` in MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except OSError as exc:
        return getattr(exc, "code", 0) or 0, ""


def leading(port: int) -> bool:
    """Ready (polled as a kubelet polls), then leading: ``/status`` is asked only once
    the caches synced (it serializes every upgrading node's status)."""
    if http_get(port, "/readyz")[0] != 200:
        return False
    code, body = http_get(port, "/status")
    return code == 200 and json.loads(body).get("leader") is True


def request_counts(cp: testenv.ControlPlane) -> dict[tuple[str, str], int]:
    """The API server's own ``apiserver_request_total`` so far, by verb and resource
    (``pods/eviction`` for a subresource)."""
    status, text = cp.request("GET", "/metrics")
    assert status == 200, text
    out: dict[tuple[str, str], int] = {}
    for line in str(text).splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        what = labels.get("resource", "")
        if labels.get("subresource"):
            what += f"/{labels['subresource']}"
        key = (labels.get("verb", ""), what)
        out[key] = out.get(key, 0) + int(float(line.rsplit(" ", 1)[1]))
    return out


def writes_by_resource(cp: testenv.ControlPlane) -> dict[str, int]:
    """Write requests the API server counted, by resource."""
    out: dict[str, int] = {}
    for (verb, what), count in request_counts(cp).items():
        if verb in ("POST", "PUT", "PATCH", "DELETE", "APPLY"):
            res = what.split("/", 1)[0]
            out[res] = out.get(res, 0) + count
    return out


async def _many(coros: list[Any], width: int = 24) -> None:
    sem = asyncio.Semaphore(width)

    async def one(c: Any) -> None:
        async with sem:
            await c

    await asyncio.gather(*(one(c) for c in coros))


def _created(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` as a client sends it: no server-set metadata, no status."""
    body = copy.deepcopy(obj)
    for key in ("uid", "resourceVersion", "creationTimestamp", "managedFields", "generation"):
        body["metadata"].pop(key, None)
    body.pop("status", None)
    volumes = body["spec"].setdefault("volumes", [])
    if not any(v.get("name") == "kube-api-access" for v in volumes):
        volumes.append({"name": "kube-api-access", "emptyDir": {}})
    return body


async def _pod(api: ApiClient, pod: dict[str, Any]) -> None:
    ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
    await raw_request(api, "POST", f"/api/v1/namespaces/{ns}/pods", body=_created(pod))
    await raw_request(
        api,
        "PATCH",
        f"/api/v1/namespaces/{ns}/pods/{name}/status",
        body={"status": _status(pod["status"])},
        content_type="application/merge-patch+json",
    )


def _status(status: dict[str, Any]) -> dict[str, Any]:
    """The generator's status, made consistent as the API server validates it."""
    out = dict(status)
    for one, many in (("hostIP", "hostIPs"), ("podIP", "podIPs")):
        if one in out:
            out[many] = [{"ip": out[one]}]
        else:
            out.pop(many, None)
    return out


def _daemonset(app: str, ns: str) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": app, "namespace": ns, "labels": {"app": app}},
        "spec": {
            "selector": {"matchLabels": {"app": app}},
            "template": {
                "metadata": {"labels": {"app": app}},
                "spec": {"containers": [{"name": app, "image": f"nvcr.io/nvidia/{app}:1"}]},
            },
        },
    }


def gpu_node(name: str, **labels: str) -> dict[str, Any]:
    """A GPU Node as the benchmarks create it: the labels and annotations a GPU node
    carries (``tests/realistic.py``), plus ``labels``; its status comes after
    (``create_gpu_node``)."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {**api_node_labels(name), "nvidia.com/gpu.present": "true", **labels},
            "annotations": {
                "node.alpha.kubernetes.io/ttl": "0",
                "volumes.kubernetes.io/controller-managed-attach-detach": "true",
                "nfd.node.kubernetes.io/feature-labels": ",".join(
                    k.split("/", 1)[1] for k in api_node_labels(name) if k.startswith("feature.")
                ),
                "nfd.node.kubernetes.io/master.version": "v0.15.4",
            },
        },
    }


async def create_gpu_node(api: ApiClient, name: str, **labels: str) -> None:
    """Creates the Node of ``gpu_node``, then writes its status as a kubelet does
    (``tests/realistic.api_node_status``, through the status subresource): about 15 KiB."""
    await raw_request(api, "POST", "/api/v1/nodes", body=gpu_node(name, **labels))
    await raw_request(
        api,
        "PATCH",
        f"/api/v1/nodes/{name}/status",
        body={"status": api_node_status(name)},
        content_type=MERGE_PATCH,
    )


async def build_world(api: ApiClient, ns: str, consumers_ns: str) -> None:
    started = time.monotonic()
    await _many([create_gpu_node(api, f"node-{i:05d}") for i in range(NODES)])
    await raw_request(
        api,
        "POST",
        "/apis/node.k8s.io/v1/runtimeclasses",
        body={
            "apiVersion": "node.k8s.io/v1",
            "kind": "RuntimeClass",
            "metadata": {"name": "nvidia"},
            "handler": "nvidia",
        },
    )
    for app in APPS.values():
        await raw_request(
            api, "POST", f"/apis/apps/v1/namespaces/{ns}/daemonsets", body=_daemonset(app, ns)
        )
    per_app = OPERATOR_PODS // len(APPS)
    pods = []
    for app in APPS.values():
        for i in range(per_app):
            pod = api_pod(app, f"{app}-{i:05d}", f"node-{i % NODES:05d}")
            pod["metadata"]["namespace"] = ns
            pods.append(pod)
    for i in range(CONSUMER_PODS):
        pod = api_pod("gpu-job", f"gpu-job-{i:05d}", f"node-{i % NODES:05d}", common=False)
        pod["metadata"]["namespace"] = consumers_ns
        pod["metadata"]["labels"] = {
            "app": "gpu-job",
            "nvidia.com/gpu-driver-upgrade.consumer": "true",
        }
        pod["metadata"].pop("ownerReferences", None)
        pods.append(pod)
    await _many([_pod(api, p) for p in pods])
    print(
        f"world: {NODES} Nodes, {OPERATOR_PODS} operator-namespace pods, {CONSUMER_PODS} "
        f"consumer pods, built in {time.monotonic() - started:.0f} s",
        flush=True,
    )


class Run:
    """One ``shared-svc run`` process."""

    def __init__(
        self,
        cp: testenv.ControlPlane,
        ns: str,
        pythonpath: str | None,
        profile: str | None = None,
        trace: str | None = None,
        profile_startup: bool = False,
    ) -> None:
        self.port = testenv.free_port()
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("SHARED_SVC_")},
            "KUBECONFIG": str(cp.kubeconfig),
            "OPERATOR_NAMESPACE": ns,
            "POD_NAME": "shared-svc-bench",
            "SHARED_SVC_BIND_ADDRESS": "127.0.0.1",
            "SHARED_SVC_PORT": str(self.port),
            "SHARED_SVC_UPGRADE_CONTROLLER": "true",
        }
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        fd, self.log_name = tempfile.mkstemp(prefix="shared-svc-bench-mem-", suffix=".log")
        self._log = os.fdopen(fd, "wb")
        exe = Path(sys.executable).with_name("shared-svc")
        argv = [str(exe), "run"]
        if profile:  # cProfile of the measured window (benchmarks/profiled_run.py)
            env["BENCH_PROFILE_OUT"] = profile
            if profile_startup:
                env["BENCH_PROFILE_FROM_START"] = "1"
            env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, str(ROOT)) if p)
            argv = [sys.executable, str(ROOT / "benchmarks" / "profiled_run.py")]
        elif trace:  # a timestamp per reconcile step (benchmarks/traced_run.py)
            env["BENCH_TRACE_OUT"] = trace
            env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, str(ROOT)) if p)
            argv = [sys.executable, str(ROOT / "benchmarks" / "traced_run.py")]
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=self._log)

    async def ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"shared-svc run did not become ready; log: {self.log_name}")
            await asyncio.sleep(0.2)

    def _ready(self) -> bool:
        return leading(self.port)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


async def measure_small(cp: testenv.ControlPlane, ns: str, pythonpath: str | None) -> float:
    run = Run(cp, ns, pythonpath)
    try:
        await run.ready()
        await asyncio.sleep(10)
        return memory(run.proc.pid)["VmRSS"]
    finally:
        run.stop()


async def measure_big(
    cp: testenv.ControlPlane,
    ns: str,
    pythonpath: str | None,
    window: float,
    profile: str | None = None,
    then: Callable[[Run], Awaitable[dict[str, Any]]] | None = None,
    trace: str | None = None,
    profile_window: float = 0.0,
    profile_rest: bool = True,
    profile_startup: bool = False,
) -> dict[str, Any]:
    """Starts ``run``, measures as the module says; then, if given, ``then(run)`` in the
    same process (its figures join the result). ``profile_window`` > 0: the measured
    window runs unprofiled, and cProfile covers that many seconds after it instead (the
    result's ``cpu_profiled``: the CPU of that window, profiler included).
    ``profile_rest`` False: the process runs under ``profiled_run`` but nothing at rest is
    profiled (``then`` switches the profile on and off itself). ``profile_startup`` (with
    ``profile``): cProfile from the process's start until ready, printed, and nothing else
    profiled. The result's ``cpu_to_ready``: CPU seconds until ready of shared-svc and of
    each control-plane process."""
    profile_startup = profile_startup and profile is not None
    profile_rest = profile_rest and profile is not None and not profile_startup
    servers = {name: proc.pid for name, proc in cp.processes.items()}
    server_cpu0 = {name: cpu_seconds(pid) for name, pid in servers.items()}
    run = Run(cp, ns, pythonpath, profile, trace, profile_startup)
    try:
        started = time.monotonic()
        await run.ready()
        synced_in = time.monotonic() - started
        cpu_to_ready = {"shared-svc": cpu_seconds(run.proc.pid)} | {
            name: cpu_seconds(pid) - server_cpu0[name] for name, pid in servers.items()
        }
        if profile_startup:
            assert profile is not None
            await _profiled(run, profile, 0.0)
        await asyncio.sleep(10)
        after = memory(run.proc.pid)
        if profile_rest and not profile_window:
            run.proc.send_signal(signal.SIGUSR1)
        writes0, cpu0, t0 = writes_by_resource(cp), cpu_seconds(run.proc.pid), time.monotonic()
        await asyncio.sleep(window)
        writes1, cpu1, t1 = writes_by_resource(cp), cpu_seconds(run.proc.pid), time.monotonic()
        profiled: dict[str, Any] = {}
        if profile and profile_rest:
            profiled = await _profiled(run, profile, profile_window)
        end = memory(run.proc.pid)
        writes = {
            r: writes1.get(r, 0) - writes0.get(r, 0)
            for r in writes1
            if writes1.get(r, 0) != writes0.get(r, 0)
        }
        out = {
            "synced_in": synced_in,
            "cpu_to_ready": {k: round(v, 2) for k, v in cpu_to_ready.items()},
            "rss_after_sync": after["VmRSS"],
            "hwm": end["VmHWM"],
            "rss_end": end["VmRSS"],
            "lease_writes": writes.pop("leases", 0),
            "other_writes": writes,
            "cpu": 100 * (cpu1 - cpu0) / (t1 - t0),
            **profiled,
        }
        if then is not None:
            out.update(await then(run))
        return out
    finally:
        run.stop()


async def _profiled(run: Run, profile: str, seconds: float) -> dict[str, Any]:
    """Stop the profile started before the window (``seconds`` 0), or profile ``seconds``
    more now; print the top functions and what ``profiled_run`` wrote of garbage
    collection (FILE.gc)."""
    out: dict[str, Any] = {}
    if seconds:
        cpu0, t0 = cpu_seconds(run.proc.pid), time.monotonic()
        run.proc.send_signal(signal.SIGUSR1)
        await asyncio.sleep(seconds)
        out["cpu_profiled"] = 100 * (cpu_seconds(run.proc.pid) - cpu0) / (time.monotonic() - t0)
    run.proc.send_signal(signal.SIGUSR2)
    await asyncio.sleep(2)
    print_profile(profile)
    return out


def print_profile(profile: str) -> None:
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(40)
    gc_file = Path(f"{profile}.gc")
    if gc_file.exists():
        print(f"garbage collection in the profiled window: {gc_file.read_text().strip()}")


def worktree(ref: str) -> str:
    path = tempfile.mkdtemp(prefix="shared-svc-before-")
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", path, ref],
        check=True,
        capture_output=True,
    )
    return path


def remove_worktree(path: str) -> None:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", path], check=False)


async def main(before: str | None, window: float, profile: str | None = None) -> None:
    tree = worktree(before) if before else None
    variants: list[tuple[str, str | None]] = [*([(f"before ({before})", tree)] if tree else [])]
    variants.append(("after (this tree)", None))
    cp = await asyncio.get_running_loop().run_in_executor(None, testenv.start)
    results: dict[str, dict[str, Any]] = {}
    try:
        api = await api_client(cp)
        ns = await make_namespace(api, "bench-mem")
        consumers = await make_namespace(api, "bench-consumers")
        kube = Kube(api, ns)
        await kube.create_cr(cp_body())
        for label, path in variants:
            results[label] = {"rss_idle_small": await measure_small(cp, ns, path)}
        await build_world(api, ns, consumers)
        await api.close()
        for label, path in variants:
            prof = profile if path is None else None  # this tree only
            results[label].update(await measure_big(cp, ns, path, window, prof))
            print(f"{label}: {results[label]}", flush=True)
    finally:
        cp.stop()
        if tree:
            remove_worktree(tree)

    labels = [label for label, _ in variants]
    print()
    print(
        f"shared-svc run (own process, shipped defaults, both controllers on); "
        f"{NODES} Nodes, {OPERATOR_PODS} operator-namespace pods, {CONSUMER_PODS} consumer pods"
    )
    print(f"{'':40}" + "".join(f"{label:>22}" for label in labels))
    rows = [
        ("VmRSS idle, small world (MiB)", "rss_idle_small", "{:.1f}"),
        ("ready (caches synced) after (s)", "synced_in", "{:.1f}"),
        ("VmRSS after sync (MiB)", "rss_after_sync", "{:.1f}"),
        ("VmHWM (MiB)", "hwm", "{:.1f}"),
        (f"VmRSS after {window:g} s more (MiB)", "rss_end", "{:.1f}"),
        (f"Lease writes in {window:g} s", "lease_writes", "{}"),
        (f"other writes in {window:g} s, by resource", "other_writes", "{}"),
        (f"CPU over {window:g} s (% of a core)", "cpu", "{:.2f}"),
    ]
    for title, key, fmt in rows:
        cells = []
        for label in labels:
            value = results[label][key]
            if isinstance(value, dict):
                cells.append(" ".join(f"{r}:{n}" for r, n in sorted(value.items())) or "0")
            else:
                cells.append(fmt.format(value))
        print(f"{title:40}" + "".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before", help="git ref to measure too (e.g. HEAD)")
    parser.add_argument("--window", type=float, default=300.0)
    parser.add_argument(
        "--profile", help="cProfile the window of this tree's run into FILE; print the top"
    )
    parser.add_argument("--scale", type=float, default=1.0, help="world size factor (smoke runs)")
    args = parser.parse_args()
    NODES, OPERATOR_PODS, CONSUMER_PODS = (
        max(1, int(n * args.scale)) for n in (NODES, OPERATOR_PODS, CONSUMER_PODS)
    )
    asyncio.run(main(args.before, args.window, args.profile))
