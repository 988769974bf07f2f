"""What the user's Prometheus sees (issue 46): shared-svc scraped through the chart's own
ServiceMonitor by the real prometheus-operator, its PrometheusRule loaded the same way.

prometheus-operator v0.85.0 (testenv/prometheus_operator.py) renders the scrape job of the
chart's ServiceMonitor (and the rule file of its PrometheusRule) for a ``Prometheus`` of the
test's namespace; Prometheus 3.5.0 loads them as the config-reloader would and discovers the
Endpoints that kube-controller-manager keeps for the chart's metrics Service. Two replicas
run with leader election, both controllers on; each has a pod with the labels of the chart's
Deployment and its ``http`` port (the test plays the kubelet, tests/kubelet.py), whose
``podIP:8080`` the scrape proxy forwards to that replica's /metrics. The targets therefore
carry what a ServiceMonitor's targets carry (``namespace``, ``service``, ``pod``,
``container``, ``endpoint``, ``job``, ``instance``).

- "Selector of each Service" shows one series per DCGM Service with its mode, as the leader
  reports it, and no series of ours has an ``exported_*`` label (before issue 46 the
  metric's ``service`` label arrived as ``exported_service`` and the panel showed the
  metrics Service twice).
- With the leader stuck (a ValidatingAdmissionPolicy refuses its Service writes; it keeps
  its Lease), the age panel shows the leader's age, the reconcile panels show the leader's
  results only (the standby's plans and its upgrade controller's reconciles not among
  them), and ``SharedSvcReconcileStale`` fires for the leader's pod.
- With the Lease held by someone else, both replicas up: ``SharedSvcNoLeader`` fires; with
  both replicas gone, ``SharedSvcDown`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient

import testenv
from shared_svc.controllers.services.outcomes import COMMON_LABELS
from shared_svc.reconcile.names import SERVICE_NAMES
from shared_svc.service import Service
from testenv import prometheus as prom_env
from testenv import prometheus_operator as operator_env
from tests.conftest import OPERATOR_PROXY
from tests.kube import eventually
from tests.kubelet import Kubelet
from tests.refusals import ServiceWritesRefused
from tests.svc import Kube, cp_body, gc_body, running, service_config, settle
from tests.test_deploy_chart import CHART, one, render_docs

pytestmark = [
    pytest.mark.apiserver,
    pytest.mark.controller_manager,
    pytest.mark.helm,
    pytest.mark.prometheus,
]

JOB = "shared-svc-metrics"  # the chart's metrics Service: the job of its ServiceMonitor
PORT = 8080  # the chart's http port (values.port)
NODE = "node-a"
REPLICAS = ("shared-svc-a", "shared-svc-b")
RESYNC = 2.0  # tuning.resyncSeconds: SharedSvcReconcileStale after three (6 s)
RATE_INTERVAL = "6s"  # $__rate_interval: six scrapes
SETS = (
    "serviceMonitor.enabled=true",
    "serviceMonitor.interval=1s",
    "prometheusRule.enabled=true",
    "controllers.upgrade=true",
    f"tuning.resyncSeconds={RESYNC:g}",
    "prometheusRule.for.SharedSvcReconcileStale=1s",
    "prometheusRule.for.SharedSvcNoLeader=1s",
    "prometheusRule.for.SharedSvcDown=1s",
)
DASHBOARD = CHART / "dashboards" / "shared-svc.json"


def panel(title: str, namespace: str) -> list[str]:
    """The queries of the dashboard's panel ``title``, the variables filled in."""
    dashboard = json.loads(DASHBOARD.read_text())
    found = [p for p in dashboard["panels"] if p["title"] == title]
    assert len(found) == 1, title
    return [
        t["expr"]
        .replace("$cluster", ".*")
        .replace("$namespace", namespace)
        .replace("$job", JOB)
        .replace("$__rate_interval", RATE_INTERVAL)
        for t in found[0]["targets"]
    ]


@dataclass
class Stack:
    """The chart's monitoring in the test's namespace, and the two replicas it scrapes."""

    kk: Kube
    prom: prom_env.Prometheus
    reloader: operator_env.ConfigReloader
    replicas: dict[str, Service]  # pod name -> replica
    running: contextlib.AsyncExitStack  # closing it stops the replicas

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        result: list[dict[str, Any]] = self.prom.get("/api/v1/query", **params)["result"]
        return result

    async def aquery(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.query, expr, at)

    def leader(self) -> tuple[str, Service]:
        leaders = [(pod, s) for pod, s in self.replicas.items() if s.is_leader()]
        assert len(leaders) == 1, [pod for pod, _ in leaders]
        return leaders[0]

    def sel(self) -> str:
        return f'namespace="{self.kk.ns}", job="{JOB}"'


@contextlib.asynccontextmanager
async def monitoring_stack(
    kk: Kube,
    kapi: ApiClient,
    cp: testenv.ControlPlane,
    prometheus: prom_env.Prometheus,
    stand_ins: prom_env.StandIns,
    tmp_path: Path,
    *,
    lead: bool = True,
) -> AsyncIterator[Stack]:
    """The chart's Service, ServiceMonitor and PrometheusRule in ``kk``'s namespace, the
    operator's configuration reloaded into ``prometheus``, two replicas scraped through
    them; the first leads before the second starts (``lead``; else the Lease is held by
    someone else for an hour, and neither leads)."""
    docs = render_docs(*SETS, namespace=kk.ns)
    template = one(docs, "Deployment")["spec"]["template"]
    cp.apply_manifests(
        [
            operator_env.prometheus_resource(cp, kk.ns, tmp_path),
            one(docs, "Service", JOB),
            one(docs, "ServiceMonitor"),
            one(docs, "PrometheusRule"),
        ]
    )
    if not lead:
        cp.apply_manifests([held_lease(kk.ns)])
    reloader = operator_env.ConfigReloader(
        cp, kk.ns, prometheus, stand_ins.proxies[OPERATOR_PROXY]
    ).start()
    kubelet = Kubelet(kapi, kk.ns)
    timing = {
        "leader_election": True,
        "upgrade_controller": True,
        "resync_seconds": RESYNC,
        "upgrade_resync_seconds": RESYNC,
    }
    try:
        async with contextlib.AsyncExitStack() as replicas:
            services: dict[str, Service] = {}
            for pod in REPLICAS:
                cfg = service_config(cp, kk.ns, pod_name=pod, **timing)
                services[pod] = s = await replicas.enter_async_context(running(cfg))
                if lead and not services.keys() - {pod}:  # the first leads before the second

                    async def leads(s: Service = s) -> bool:
                        return s.is_leader()

                    await eventually(leads, timeout=30)
                ip = await kubelet.run(
                    pod,
                    "shared-svc",
                    NODE,
                    common=False,
                    labels=template["metadata"]["labels"],
                    ports=[{"name": "http", "containerPort": PORT}],
                )
                assert s.port is not None
                stand_ins.route(ip, PORT, s.port)
            yield Stack(kk, prometheus, reloader, services, replicas)
    finally:
        reloader.stop()


def held_lease(namespace: str) -> dict[str, Any]:
    """shared-svc's Lease, held by another identity for an hour (renewed just now)."""
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "shared-svc", "namespace": namespace},
        "spec": {
            "holderIdentity": "someone-else",
            "leaseDurationSeconds": 3600,
            "acquireTime": now,
            "renewTime": now,
        },
    }


@pytest.fixture
async def stack(
    request: pytest.FixtureRequest,
    kk: Kube,
    kapi: ApiClient,
    operator_crds: testenv.ControlPlane,
    prometheus_operator: operator_env.Operator,
    operator_prometheus: prom_env.Prometheus,
    operator_stand_ins: prom_env.StandIns,
    tmp_path: Path,
) -> AsyncIterator[Stack]:
    """:func:`monitoring_stack`; ``lead=False`` by indirect parametrization."""
    lead = getattr(request, "param", {}).get("lead", True)
    async with monitoring_stack(
        kk, kapi, operator_crds, operator_prometheus, operator_stand_ins, tmp_path, lead=lead
    ) as stack:
        yield stack


async def both_scraped(t: Stack) -> None:
    async def up() -> bool:
        assert t.reloader.error is None, t.reloader.error
        series = await t.aquery(f"up{{{t.sel()}}} == 1")
        return {s["metric"].get("pod") for s in series} == set(REPLICAS)

    try:
        await eventually(up, timeout=60, interval=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: jobs {t.reloader.jobs}\n{t.prom.tail(15)}") from None


async def test_the_selector_of_each_service_arrives_with_its_own_labels(stack: Stack) -> None:
    t = stack
    await t.kk.create_cr(cp_body())
    await t.kk.create_cr(gc_body())
    await both_scraped(t)
    _, leader = t.leader()
    await settle(leader)
    # what the leader decided (/status: each Service's selector), not what it exports
    assert leader.controller is not None and leader.controller.last_plan is not None
    want = {
        (s.name, "common" if set(s.selector or ()) & COMMON_LABELS else "app")
        for s in leader.controller.last_plan.status
        if s.kind == "Service"
    }
    assert len(want) == len(SERVICE_NAMES), want
    (query,) = panel("Selector of each Service", t.kk.ns)
    seen: set[tuple[str, str]] = set()

    async def shown() -> bool:
        nonlocal seen
        series = await t.aquery(query)
        seen = {
            (s["metric"].get("dcgm_service", "?"), s["metric"].get("mode", "?")) for s in series
        }
        return seen == want and len(series) == len(want)

    try:
        await eventually(shown, timeout=30, interval=0.5)
    except AssertionError:
        raise AssertionError(f"the panel shows {sorted(seen)}, the leader {sorted(want)}") from None
    ours = await asyncio.to_thread(t.prom.get, "/api/v1/series", **{"match[]": f"{{{t.sel()}}}"})
    assert ours
    renamed = sorted({k for s in ours for k in s if k.startswith("exported_")})
    assert not renamed, f"labels of ours renamed by the scrape: {renamed}"
    # the chart's rules, as the operator's rule file loads them: every alert, health ok
    rendered = one(render_docs(*SETS, namespace=t.kk.ns), "PrometheusRule")
    names = {r["alert"] for g in rendered["spec"]["groups"] for r in g["rules"]}

    async def evaluated() -> bool:
        data = await asyncio.to_thread(t.prom.get, "/api/v1/rules")
        rules = {r["name"]: r for g in data["groups"] for r in g["rules"]}
        return set(rules) == names and all(r["health"] == "ok" for r in rules.values())

    await eventually(evaluated, timeout=30, interval=0.5)


async def test_the_leader_stuck_holding_its_lease_is_what_the_panels_and_the_alert_show(
    stack: Stack, kapi: ApiClient
) -> None:
    t = stack
    await t.kk.create_cr(cp_body())
    await both_scraped(t)
    pod, leader = t.leader()
    standby = next(s for p, s in t.replicas.items() if p != pod)
    await settle(leader)
    async with ServiceWritesRefused(kapi, t.kk.ns):
        # a Service the CR needs is gone: the leader's every reconcile fails to create it
        await t.kk.core.delete_namespaced_service("nvidia-dcgm-exporter", t.kk.ns)
        stuck_since = time.time()
        plans = standby.metrics.registry.get_sample_value(
            "controller_runtime_reconcile_total",
            {"controller": "shared-services", "result": "success"},
        )
        (age_query,) = panel("Since the last successful reconcile", t.kk.ns)
        (by_result,) = panel("Reconciles, by result", t.kk.ns)

        async def stale_fires() -> bool:
            stale = await firing(t, "SharedSvcReconcileStale")
            return any(labels.get("pod") == pod for labels in stale)

        await eventually(stale_fires, timeout=60, interval=0.5)
        assert leader.is_leader(), "the leader kept its Lease"
        assert leader.controller is not None
        assert leader.controller.last_reconcile["result"] == "error"
        # The standby went on planning meanwhile (what made the dashboard look fresh).
        assert (
            standby.metrics.registry.get_sample_value(
                "controller_runtime_reconcile_total",
                {"controller": "shared-services", "result": "success"},
            )
            or 0
        ) > (plans or 0)
        at = time.time()
        leader_success = leader.metrics.registry.get_sample_value(
            "shared_svc_last_successful_reconcile_timestamp_seconds"
        )
        assert leader_success is not None and leader_success < stuck_since
        (age,) = await t.aquery(age_query, at)
        # the leader's age, as of the last scrape (one interval) before ``at``
        assert abs(float(age["value"][1]) - (at - leader_success)) <= 2.0, (age, at, leader_success)
        shown = {
            (s["metric"]["controller"], s["metric"]["result"]): float(s["value"][1])
            for s in await t.aquery(by_result, at)
        }
        # the same, of the leader's pod alone
        leader_only = (
            "sum by (controller, result) (rate(controller_runtime_reconcile_total"
            f'{{{t.sel()}, pod="{pod}"}}[{RATE_INTERVAL}]))'
        )
        theirs = {
            (s["metric"]["controller"], s["metric"]["result"]): float(s["value"][1])
            for s in await t.aquery(leader_only, at)
        }
        assert shown == theirs, (shown, theirs)
        assert shown.get(("shared-services", "success"), 0) == 0, shown
        assert shown.get(("shared-services", "error"), 0) > 0, shown


async def firing(t: Stack, alert: str) -> list[dict[str, str]]:
    """The labels of ``alert``'s firing alerts."""
    data = await asyncio.to_thread(t.prom.get, "/api/v1/alerts")
    return [
        a["labels"]
        for a in data["alerts"]
        if a["labels"]["alertname"] == alert and a["state"] == "firing"
    ]


@pytest.mark.parametrize("stack", [{"lead": False}], indirect=True, ids=["lease-held"])
async def test_no_leader_and_then_down_fire_as_the_replicas_go(stack: Stack) -> None:
    """Both replicas up and the Lease held by another: SharedSvcNoLeader fires (and
    SharedSvcDown does not); both replicas gone: SharedSvcDown fires."""
    t = stack
    await both_scraped(t)
    assert not any(s.is_leader() for s in t.replicas.values())

    async def no_leader() -> bool:
        return bool(await firing(t, "SharedSvcNoLeader"))

    await eventually(no_leader, timeout=60, interval=0.5)
    (labels,) = await firing(t, "SharedSvcNoLeader")
    assert (labels["namespace"], labels["job"], labels["name"]) == (t.kk.ns, JOB, "shared-svc")
    assert not await firing(t, "SharedSvcDown")
    await t.running.aclose()  # both replicas stop: their targets are down

    async def down() -> bool:
        return bool(await firing(t, "SharedSvcDown"))

    await eventually(down, timeout=60, interval=0.5)
    (labels,) = await firing(t, "SharedSvcDown")
    assert (labels["namespace"], labels["job"]) == (t.kk.ns, JOB)
