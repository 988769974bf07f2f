"""Every ready exporter pod scraped exactly once, counted by a real Prometheus (issue 20).

Prometheus 3.5.0 (testenv/prometheus.py) runs the prometheus-community chart's
``kubernetes-service-endpoints`` job twice, with role ``endpoints`` and ``endpointslice``,
against a control plane of this module's own with kube-controller-manager (the Endpoints and
EndpointSlice controllers), next to shared-svc's controller. Tests play the kubelet
(tests/kubelet.py); each exporter pod has a stand-in that serves ``/metrics`` and counts its
scrapes, reached through each job's ``proxy_url``.

Through the rollout of the common labels, its rollback, ClusterPolicy -> GPUCluster and
GPUCluster -> ClusterPolicy (with and without the common label on the returning pods), a
sampler reads Prometheus' ``/api/v1/targets`` all along: every ready exporter pod of a stack
whose CR exists is one target of each job, missing or doubled for no longer than one
discovery refresh; after every step exactly one target and one ``up`` series per job.

Not here: the ServiceMonitor rendered by prometheus-operator. It needs a build of its own
(prometheus-operator lifts client-go past what Prometheus' discovery compiles against, so it
cannot share the wrapper module) and a running operator writing Prometheus' configuration;
the ServiceMonitor selects exactly the scrape-"true" Services (tests/test_reconcile_monitoring.py),
so the annotation jobs here count the same Services.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

import testenv
from shared_svc.service import Service
from testenv import prometheus as prom_env
from tests.conftest import serving_stand_ins, started
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
SAMPLE_SECONDS = 0.5
# Samples in one discovery refresh plus a scrape interval: the longest a ready pod may be
# missing from (or doubled in) a job's targets.
REFRESH_SAMPLES = math.ceil((prom_env.REFRESH_SECONDS + 1.0) / SAMPLE_SECONDS)
JOBS = tuple(prom_env.JOBS)


@pytest.fixture(scope="module")
def stand_ins() -> Iterator[prom_env.StandIns]:
    yield from serving_stand_ins()


@pytest.fixture(scope="module")
def prometheus(
    kcm_plane: testenv.ControlPlane, stand_ins: prom_env.StandIns
) -> Iterator[prom_env.Prometheus]:
    yield from started("Prometheus", lambda: prom_env.start(kcm_plane, stand_ins))


@dataclass
class Scrapes:
    """The exporter pods of one test, what Prometheus makes of them, sampled all along."""

    kk: Kube
    kapi: ApiClient
    svc: Service
    prom: prom_env.Prometheus
    stand_ins: prom_env.StandIns
    kubelet: Kubelet = field(init=False)
    crs: set[str] = field(default_factory=set)
    pods: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (stack, pod IP)
    samples: int = 0
    last: dict[str, Counter[str]] = field(default_factory=dict)
    # (pod, job) -> samples in a row missing / doubled, and the longest such runs
    missing: Counter[tuple[str, str]] = field(default_factory=Counter)
    doubled: Counter[tuple[str, str]] = field(default_factory=Counter)
    longest_missing: Counter[tuple[str, str]] = field(default_factory=Counter)
    longest_doubled: Counter[tuple[str, str]] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.kubelet = Kubelet(self.kapi, self.kk.ns)

    def expected(self) -> dict[str, str]:
        """Ready exporter pods of the stacks whose CR exists: name -> pod IP."""
        return {name: ip for name, (stack, ip) in self.pods.items() if stack in self.crs}

    def targets(self) -> dict[str, Counter[str]]:
        """This namespace's active targets: pod IP -> job -> count."""
        out: dict[str, Counter[str]] = {}
        for t in self.prom.active_targets():
            if t["labels"].get("namespace") != self.kk.ns:
                continue
            ip = str(t["discoveredLabels"]["__address__"]).rsplit(":", 1)[0]
            out.setdefault(ip, Counter())[t["labels"]["job"]] += 1
        return out

    async def sample(self) -> None:
        expected = self.expected()
        targets = await asyncio.to_thread(self.targets)
        self.samples += 1
        self.last = targets
        for name, ip in expected.items():
            for job in JOBS:
                key = (name, job)
                n = targets.get(ip, Counter())[job]
                self.missing[key] = self.missing[key] + 1 if n == 0 else 0
                self.doubled[key] = self.doubled[key] + 1 if n > 1 else 0
                self.longest_missing[key] = max(self.longest_missing[key], self.missing[key])
                self.longest_doubled[key] = max(self.longest_doubled[key], self.doubled[key])

    async def sampler(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(SAMPLE_SECONDS)

    # --- the world ---
    async def create_cr(self, kind: str) -> None:
        await self.kk.create_cr(cp_body() if kind == "ClusterPolicy" else gc_body())
        self.crs.add(kind)

    async def delete_cr(self, kind: str) -> None:
        self.crs.discard(kind)
        await self.kk.delete_cr(
            kind, "cluster-policy" if kind == "ClusterPolicy" else "gpu-cluster"
        )

    async def run_stack(self, kind: str, *, common: bool, suffix: str = "") -> None:
        """The stack's exporter DaemonSet (rolled out) and one ready pod per node."""
        app = EXPORTER_APP[kind]
        await self.kk.daemonset(app, common=common, desired=len(NODES))
        for node in NODES:
            await self.run_pod(kind, f"{app}-{node}{suffix}", node, common=common)

    async def run_pod(self, kind: str, name: str, node: str, *, common: bool) -> None:
        await self.kubelet.run(name, EXPORTER_APP[kind], node, common=common)
        pod = await client.CoreV1Api(self.kapi).read_namespaced_pod(name, self.kk.ns)
        ip = pod.status.pod_ip
        self.stand_ins.add(ip)
        self.pods[name] = (kind, ip)

    async def stop_pod(self, name: str) -> None:
        self.pods.pop(name, None)
        await self.kubelet.gone(name)

    async def stop_stack(self, kind: str, suffix: str = "") -> None:
        for node in NODES:
            await self.stop_pod(f"{EXPORTER_APP[kind]}-{node}{suffix}")

    # --- the checks ---
    async def step(self) -> None:
        """The controller settles; then every expected pod is exactly one target of each job,
        and one ``up`` series of each job with value 1."""
        await settle(self.svc)

        async def exactly_once() -> bool:
            targets = self.last  # the sampler's latest
            up = await asyncio.to_thread(self.prom.up_series)
            series = Counter(
                (x["metric"]["job"], x["metric"]["instance"].rsplit(":", 1)[0])
                for x in up
                if x["metric"].get("namespace") == self.kk.ns and x["value"][1] == "1"
            )
            return all(
                targets.get(ip, Counter())[job] == 1 and series[(job, ip)] == 1
                for ip in self.expected().values()
                for job in JOBS
            )

        await eventually(exactly_once, timeout=4 * prom_env.REFRESH_SECONDS, interval=0.5)
        for ip in self.expected().values():
            for job in JOBS:
                assert self.stand_ins.count(ip)[job] > 0, (job, ip)

    def check_no_gap(self) -> None:
        too_long = {k: v for k, v in self.longest_missing.items() if v > REFRESH_SAMPLES}
        assert not too_long, f"missing for more than {REFRESH_SAMPLES} samples: {too_long}"
        doubled = {k: v for k, v in self.longest_doubled.items() if v > REFRESH_SAMPLES}
        assert not doubled, f"doubled for more than {REFRESH_SAMPLES} samples: {doubled}"


@pytest.fixture
async def scrapes(
    kk: Kube,
    kapi: ApiClient,
    svc: Service,
    prometheus: prom_env.Prometheus,
    stand_ins: prom_env.StandIns,
) -> AsyncIterator[Scrapes]:
    s = Scrapes(kk, kapi, svc, prometheus, stand_ins)
    task = asyncio.create_task(s.sampler())
    try:
        yield s
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_the_rollout_of_the_common_labels_and_its_rollback_scrape_every_exporter_once(
    scrapes: Scrapes,
) -> None:
    await scrapes.create_cr("ClusterPolicy")
    await scrapes.run_stack("ClusterPolicy", common=False)
    await scrapes.step()
    # The operator rolls the common label out, node by node; then rolls it back.
    for common, old, new in ((True, "", "-v2"), (False, "-v2", "-v3")):
        await scrapes.kk.daemonset(EXPORTER_APP["ClusterPolicy"], common=common, desired=2)
        for node in NODES:
            name = f"{EXPORTER_APP['ClusterPolicy']}-{node}"
            await scrapes.stop_pod(name + old)
            await scrapes.run_pod("ClusterPolicy", name + new, node, common=common)
            await scrapes.step()
    scrapes.check_no_gap()


async def test_cluster_policy_to_gpu_cluster_scrapes_every_exporter_once(
    scrapes: Scrapes,
) -> None:
    await scrapes.create_cr("ClusterPolicy")
    await scrapes.run_stack("ClusterPolicy", common=False)
    await scrapes.step()
    await scrapes.create_cr("GPUCluster")
    await scrapes.run_stack("GPUCluster", common=False)
    await scrapes.step()
    await scrapes.delete_cr("ClusterPolicy")
    await scrapes.step()
    await scrapes.stop_stack("ClusterPolicy")
    await scrapes.step()
    scrapes.check_no_gap()


@pytest.mark.parametrize("common", [True, False], ids=["labelled", "unlabelled"])
async def test_gpu_cluster_to_cluster_policy_scrapes_the_new_pods_as_soon_as_they_are_ready(
    scrapes: Scrapes, common: bool
) -> None:
    await scrapes.create_cr("GPUCluster")
    await scrapes.run_stack("GPUCluster", common=True)
    await scrapes.step()
    await scrapes.create_cr("ClusterPolicy")
    await scrapes.step()
    # The returning ClusterPolicy pods, one node at a time, while the DRA pods still run:
    # each is a target within one refresh of being ready (unlabelled, a hold of the exporter
    # name would leave them on no scrape-"true" Service).
    app = EXPORTER_APP["ClusterPolicy"]
    await scrapes.kk.daemonset(app, common=common, desired=len(NODES))
    for node in NODES:
        await scrapes.run_pod("ClusterPolicy", f"{app}-{node}", node, common=common)
        await scrapes.step()
    await scrapes.delete_cr("GPUCluster")
    await scrapes.stop_stack("GPUCluster")
    await scrapes.step()
    scrapes.check_no_gap()
