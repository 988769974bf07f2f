"""Every ready exporter pod one target, with the real prometheus-operator's ServiceMonitor
semantics and the real Prometheus (issue 28).

prometheus-operator v0.85.0 (testenv/prometheus_operator.py) renders the scrape configuration
from the ServiceMonitors of the test's namespace: shared-svc's ``nvidia-dcgm-exporter`` and, once
adopted, the GPUCluster's own ``nvidia-dcgm-exporter-dra``, which the GPUCluster controller
(tests/admission.py ``SimulatedGpuCluster``) writes as v26.7.0 does: create, and on 409 a whole
PUT, with its controller reference, the state label and ``selector.matchLabels: {app:
nvidia-dcgm-exporter-dra}``; the chart's admission guard (the MutatingAdmissionPolicy) makes
those PUTs no-ops. Prometheus 3.5.0 loads each configuration the operator writes and discovers
the Endpoints that kube-controller-manager keeps; tests play the kubelet (tests/kubelet.py) and
each exporter pod has a stand-in that counts its scrapes.

Through ClusterPolicy -> GPUCluster -> ClusterPolicy, with both CRs' ServiceMonitors on, the
GPUCluster controller reconciling at every step and a sampler reading Prometheus' targets all
along: after every step every ready exporter pod of a stack whose CR exists is exactly one active
target, with the ``job`` of the Service that selects it, and no pod is a target twice for longer
than one discovery refresh and a configuration reload. Without the adopted ``-dra``
ServiceMonitor the GPUCluster's own one scrapes every DRA pod a second time.

And no series outlives its pod (issue 46): one scrape interval after the target of a pod
that no longer runs has left Prometheus, an instant query returns none of its series. The
GPUCluster carries gpu-operator's finalizer (its deletion waits while its pods go);
shared-svc drains its ``-dra`` ServiceMonitor (selects nothing) before deleting it, so
Prometheus marks the DRA pods' series stale instead of dropping the scrape job unmarked.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

import testenv
from shared_svc.service import Service
from testenv import prometheus as prom_env
from testenv import prometheus_operator as operator_env
from tests.admission import SimulatedGpuCluster, guard_docs, install, policy_sets, uninstall
from tests.conftest import OPERATOR_PROXY
from tests.kube import eventually
from tests.kubelet import Kubelet
from tests.svc import Kube, cp_body, gc_body, settle

pytestmark = [
    pytest.mark.apiserver,
    pytest.mark.controller_manager,
    pytest.mark.prometheus,
]

NODES = ("node-a", "node-b")
EXPORTER_APP = {"ClusterPolicy": "nvidia-dcgm-exporter", "GPUCluster": "nvidia-dcgm-exporter-dra"}
JOB = OPERATOR_PROXY  # the stand-ins' proxy for the operator's scrape jobs
MONITOR = {"enabled": True, "interval": "1s", "scrapeTimeout": "1s"}
SCRAPE_SECONDS = 1.0  # MONITOR's interval
GC_FINALIZER = "gpucluster.nvidia.com/dra-resourceclaim"
SAMPLE_SECONDS = 0.5
# One discovery refresh, a scrape interval, and the operator's render plus a reload (a
# ServiceMonitor created, adopted or deleted): the longest a ready pod may be doubled.
REFRESH_SAMPLES = math.ceil((prom_env.REFRESH_SECONDS + 4.0) / SAMPLE_SECONDS)


@dataclass
class Targets:
    """The exporter pods of the test, the targets Prometheus has for them, sampled all along."""

    kk: Kube
    kapi: ApiClient
    svc: Service
    prom: prom_env.Prometheus
    stand_ins: prom_env.StandIns
    gpu_cluster: SimulatedGpuCluster
    operator: operator_env.Operator
    reloader: operator_env.ConfigReloader
    kubelet: Kubelet = field(init=False)
    crs: set[str] = field(default_factory=set)
    pods: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (stack, pod IP)
    stopped: set[str] = field(default_factory=set)  # pod IPs of the pods that no longer run
    last: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # pod IP -> targets
    samples: int = 0
    doubled: Counter[str] = field(default_factory=Counter)
    longest_doubled: Counter[str] = field(default_factory=Counter)
    gone: dict[str, float] = field(default_factory=dict)  # pod IP -> when its target went

    def __post_init__(self) -> None:
        self.kubelet = Kubelet(self.kapi, self.kk.ns)

    def expected(self) -> dict[str, str]:
        """Ready exporter pods of the stacks whose CR exists: name -> pod IP."""
        return {name: ip for name, (stack, ip) in self.pods.items() if stack in self.crs}

    def targets(self) -> dict[str, list[dict[str, Any]]]:
        """This namespace's active targets by pod IP (every scrape pool)."""
        out: dict[str, list[dict[str, Any]]] = {}
        for t in self.prom.active_targets():
            if t["labels"].get("namespace") != self.kk.ns:
                continue
            ip = str(t["discoveredLabels"]["__address__"]).rsplit(":", 1)[0]
            out.setdefault(ip, []).append(t)
        return out

    async def sample(self) -> None:
        targets = await asyncio.to_thread(self.targets)
        now = time.time()
        self.samples += 1
        self.last = targets
        for ip in self.stopped - set(targets) - set(self.gone):
            self.gone[ip] = now
        for name, ip in self.pods.items():
            n = len(targets.get(ip, []))
            self.doubled[name] = self.doubled[name] + 1 if n > 1 else 0
            self.longest_doubled[name] = max(self.longest_doubled[name], self.doubled[name])

    async def sampler(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(SAMPLE_SECONDS)

    # --- the world ---
    async def create_cr(self, kind: str) -> None:
        spec = {"dcgm": {"enabled": False}, "dcgmExporter": {"serviceMonitor": MONITOR}}
        if kind == "GPUCluster":
            spec["dcgmExporter"] = {"enabled": True, "serviceMonitor": MONITOR}
            body = gc_body(**spec)
            # gpu-operator's finalizer: its deletion waits for its DaemonSets' pods to go
            body["metadata"]["finalizers"] = [GC_FINALIZER]
        else:
            body = cp_body(**spec)
        await self.kk.create_cr(body)
        self.crs.add(kind)

    async def delete_cr(self, kind: str) -> None:
        self.crs.discard(kind)
        await self.kk.delete_cr(
            kind, "cluster-policy" if kind == "ClusterPolicy" else "gpu-cluster"
        )

    async def release_gpu_cluster(self) -> None:
        """gpu-operator's finalizer comes off once the GPUCluster's pods are gone."""
        await self.kk.patch_cr("GPUCluster", "gpu-cluster", {"metadata": {"finalizers": None}})

    async def run_stack(self, kind: str, *, common: bool) -> None:
        app = EXPORTER_APP[kind]
        await self.kk.daemonset(app, common=common, desired=len(NODES))
        for node in NODES:
            name = f"{app}-{node}"
            await self.kubelet.run(name, app, node, common=common)
            pod = await client.CoreV1Api(self.kapi).read_namespaced_pod(name, self.kk.ns)
            self.stand_ins.add(pod.status.pod_ip)
            self.pods[name] = (kind, pod.status.pod_ip)

    async def stop_stack(self, kind: str) -> None:
        for node in NODES:
            name = f"{EXPORTER_APP[kind]}-{node}"
            _, ip = self.pods.pop(name)
            await self.kubelet.gone(name)
            self.stopped.add(ip)

    async def check_no_series_of_gone_pods(self) -> None:
        """One scrape interval after the target of a pod that no longer runs left
        Prometheus, an instant query returns none of its series (Prometheus marked them
        stale; a scrape job dropped whole, with a deleted ServiceMonitor, marks nothing and
        its series stay for the 5-minute lookback)."""

        async def all_gone() -> bool:
            return self.stopped <= set(self.gone)

        await eventually(all_gone, timeout=6 * prom_env.REFRESH_SECONDS, interval=0.5)
        at = max(self.gone[ip] for ip in self.stopped) + SCRAPE_SECONDS

        # A stopped scrape loop writes its markers a little over two intervals later,
        # stamped with when its next scrape would have been (at the latest ``at``).
        async def past() -> bool:
            return time.time() > at + 2 * SCRAPE_SECONDS + 1.0

        await eventually(past, timeout=10, interval=0.2)
        series = await asyncio.to_thread(
            self.prom.get, "/api/v1/query", query="dcgm_stand_in_up", time=f"{at:.3f}"
        )
        left = sorted(
            s["metric"].get("pod_ip", "?")
            for s in series["result"]
            if s["metric"].get("pod_ip") in self.stopped
        )
        assert not left, f"series of pods that no longer run: {left}"

    # --- the checks ---
    async def step(self) -> None:
        """The GPUCluster controller reconciles (its PUTs are no-ops), shared-svc settles;
        then every expected pod is exactly one target, of the job of the Service that
        selects it, and scraped."""
        if "GPUCluster" in self.crs:
            await self.gpu_cluster.reconcile()
        await settle(self.svc)
        services = await self.kk.services()

        def job_of(ip: str) -> set[str]:
            stack = next(s for n, (s, i) in self.pods.items() if i == ip)
            # A DRA pod is scraped through the alias (job nvidia-dcgm-exporter-dra) while the
            # canonical Service does not select it, else through the canonical one.
            canonical = services["nvidia-dcgm-exporter"]["spec"]["selector"]
            app = EXPORTER_APP[stack]
            covered = all(
                {"app": app, "nvidia.com/gpu-operator.dcgm-exporter": "true"}.get(k) == v
                for k, v in canonical.items()
            )
            return {"nvidia-dcgm-exporter"} if covered else {"nvidia-dcgm-exporter-dra"}

        async def exactly_once() -> bool:
            assert self.operator.alive(), self.operator.tail()
            assert self.reloader.error is None, self.reloader.error
            targets = self.last
            return all(
                len(targets.get(ip, [])) == 1
                and {t["labels"]["job"] for t in targets[ip]} == job_of(ip)
                and targets[ip][0]["health"] == "up"
                for ip in self.expected().values()
            )

        try:
            await eventually(exactly_once, timeout=6 * prom_env.REFRESH_SECONDS, interval=0.5)
        except AssertionError as exc:
            seen = {
                ip: [(x["labels"]["job"], x["scrapePool"], x["health"]) for x in self.last.get(ip, [])]
                for ip in self.expected().values()
            }  # fmt: skip
            raise AssertionError(
                f"{exc}: targets {seen}; jobs {self.reloader.jobs} after {self.reloader.reloads} "
                f"reloads\n{self.prom.tail(15)}"
            ) from None
        for ip in self.expected().values():
            assert self.stand_ins.count(ip)[JOB] > 0, ip

    def check_no_long_double(self) -> None:
        too_long = {k: v for k, v in self.longest_doubled.items() if v > REFRESH_SAMPLES}
        assert not too_long, f"a target twice for more than {REFRESH_SAMPLES} samples: {too_long}"


@pytest.fixture
async def targets(
    kk: Kube,
    kapi: ApiClient,
    svc: Service,
    operator_crds: testenv.ControlPlane,
    prometheus_operator: operator_env.Operator,
    operator_prometheus: prom_env.Prometheus,
    operator_stand_ins: prom_env.StandIns,
    tmp_path: Path,
) -> AsyncIterator[Targets]:
    cp, operator = operator_crds, prometheus_operator
    prometheus, stand_ins = operator_prometheus, operator_stand_ins
    cp.apply_manifests([operator_env.prometheus_resource(cp, kk.ns, tmp_path)])
    reloader = operator_env.ConfigReloader(cp, kk.ns, prometheus, stand_ins.proxies[JOB]).start()
    docs = guard_docs(kk.ns, *policy_sets())
    install(cp, docs)
    gpu_cluster = await SimulatedGpuCluster.start(cp, tmp_path, kk.ns)
    t = Targets(kk, kapi, svc, prometheus, stand_ins, gpu_cluster, operator, reloader)
    task = asyncio.create_task(t.sampler())
    try:
        yield t
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await gpu_cluster.close()
        uninstall(cp, docs)
        reloader.stop()


async def test_cp_to_gc_to_cp_with_both_service_monitors_scrapes_every_exporter_pod_once(
    targets: Targets,
) -> None:
    t = targets
    await t.create_cr("ClusterPolicy")
    await t.run_stack("ClusterPolicy", common=False)
    await t.step()
    # ClusterPolicy -> GPUCluster: the new CR first (the GPUCluster waits for the
    # ClusterPolicy's deletion), its pods, then the ClusterPolicy goes.
    await t.create_cr("GPUCluster")
    await t.step()
    await t.run_stack("GPUCluster", common=False)
    await t.step()
    monitors = {m["metadata"]["name"]: m for m in await list_monitors(t)}
    assert set(monitors) == {"nvidia-dcgm-exporter", "nvidia-dcgm-exporter-dra"}
    dra = monitors["nvidia-dcgm-exporter-dra"]["metadata"]
    assert dra["labels"]["app.kubernetes.io/managed-by"] == "shared-svc"
    assert "nvidia.com/gpu-operator.state" not in dra["labels"]
    await t.delete_cr("ClusterPolicy")
    await t.stop_stack("ClusterPolicy")
    await t.step()
    await t.check_no_series_of_gone_pods()
    # GPUCluster -> ClusterPolicy: the GPUCluster is deleted, waits on its finalizer while
    # its pods go (shared-svc drains its ServiceMonitor meanwhile), then goes.
    await t.create_cr("ClusterPolicy")
    await t.run_stack("ClusterPolicy", common=False)
    await t.step()
    await t.delete_cr("GPUCluster")
    await settle(t.svc)
    await t.stop_stack("GPUCluster")
    await t.release_gpu_cluster()
    await t.step()
    await t.check_no_series_of_gone_pods()

    async def only_canonical() -> bool:
        return {m["metadata"]["name"] for m in await list_monitors(t)} == {"nvidia-dcgm-exporter"}

    await eventually(only_canonical, timeout=30, interval=0.5)
    assert t.reloader.reloads >= 2, "the operator rendered the ServiceMonitors' changes"
    t.check_no_long_double()


async def list_monitors(t: Targets) -> list[dict[str, Any]]:
    out = await t.kk.custom.list_namespaced_custom_object(
        "monitoring.coreos.com", "v1", t.kk.ns, "servicemonitors"
    )
    items: list[dict[str, Any]] = out["items"]
    return items
