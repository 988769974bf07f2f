"""Every query of the dashboard and every expression of the alerts, against a live
``shared-svc run`` scraped by the real Prometheus (issue 32).

``shared-svc run`` runs as its own process with both controllers on the session's control
plane, leader election on (the shipped default); Prometheus 3.5.0 (testenv/prometheus.py)
scrapes its ``/metrics`` every second with the labels a ServiceMonitor's target carries
(``job``: the metrics Service's name, ``namespace``, ``pod``, ``instance``), and one DCGM
exporter pod's stand-in (its pod IP at port 9400, in a job of its own), and loads the
chart's PrometheusRule, rendered for that namespace. The world has nodes in an upgrade: one
whose evicted consumer stays terminating past the eviction timeout (no kubelet finishes
it: stuck, the node stalled), one whose consumer a PodDisruptionBudget keeps (blocked),
one driven through freeing and the consumer's leaving to ``upgrade-done`` (restored), and
a ClusterPolicy with auto-upgrade on and no gate.

Then, for each query (the dashboard's variables filled in as Grafana would), Prometheus
parses it (``/api/v1/parse_query``), each vector selector in it returns series
(``/api/v1/series``), and each label it groups or matches by is a label of them; each
dashboard query returns series itself; every rule evaluates without error, and the
upgrade alerts whose condition the world holds are active (pending: their ``for:`` has
not run out).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

import testenv
from shared_svc.kube.writer import raw_request
from testenv import prometheus as prom_env
from testenv import upgrade_examples as ex
from tests.kube import eventually, make_namespace, unique
from tests.svc import Kube, cp_body, http_get
from tests.test_deploy_chart import CHART, one, render_docs
from tests.test_upgrade_freeing import _blocked_pod, create, set_state

pytestmark = [pytest.mark.apiserver, pytest.mark.helm, pytest.mark.prometheus]

POD = "shared-svc-live-0"
JOB = "shared-svc-metrics"  # the release shared-svc's metrics Service
DASHBOARD = CHART / "dashboards" / "shared-svc.json"
RATE_INTERVAL = "1m"  # Grafana's $__rate_interval: 4 scrapes at least
# The upgrade alerts the world below holds true.
ACTIVE = {
    "SharedSvcUpgradeEvictionBlocked",
    "SharedSvcUpgradeConsumersNotLeaving",
    "SharedSvcUpgradeGateMissing",
}


# --- the queries ---------------------------------------------------------------------


GPU_OPERATOR_SERIES = "gpu_operator_"  # gpu-operator's own metrics (its upgrade gauges)


def dashboard_queries(namespace: str, *, gpu_operator: bool = False) -> list[tuple[str, str]]:
    """(panel title, query) of every target, the variables filled in: of shared-svc's
    series, or (``gpu_operator``) of gpu-operator's own, which only the real gpu-operator
    exposes (tests/test_upgrade_gpu_operator_flow.py evaluates those)."""
    dashboard = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            if (GPU_OPERATOR_SERIES in target["expr"]) != gpu_operator:
                continue
            expr = (
                target["expr"]
                .replace("$cluster", ".*")  # All: the targets here carry no cluster label
                .replace("$namespace", namespace)
                .replace("$job", JOB)
                .replace("$__rate_interval", RATE_INTERVAL)
            )
            assert "$" not in expr, f"{panel['title']}: a variable this test does not fill: {expr}"
            out.append((panel["title"], expr))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query" and not gpu_operator:
            query = (
                variable["query"]["query"]
                .replace("$cluster", ".*")
                .replace("$namespace", namespace)
            )
            inner = query.removeprefix("label_values(").rsplit(",", 1)[0]
            out.append((f"variable {variable['name']}", inner))
    return out


def rule_groups(namespace: str) -> list[dict[str, Any]]:
    rule = one(
        render_docs("prometheusRule.enabled=true", "controllers.upgrade=true", namespace=namespace),
        "PrometheusRule",
    )
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def selectors_and_labels(ast: Any) -> tuple[list[dict[str, Any]], set[str]]:
    """The vector (and matrix) selectors of a parsed query, and the labels it groups by
    (``by``/``without``) or matches on (``on``/``ignoring``, ``group_left`` labels)."""
    selectors: list[dict[str, Any]] = []
    labels: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for n in node:
                walk(n)
            return
        if not isinstance(node, dict):
            return
        kind = node.get("type")
        if kind in ("vectorSelector", "matrixSelector"):
            selectors.append(node)
        if kind == "aggregation":
            labels.update(node.get("grouping") or ())
        if kind == "binaryExpr" and node.get("matching"):
            labels.update(node["matching"].get("labels") or ())
            labels.update(node["matching"].get("include") or ())
        for key in ("expr", "param", "lhs", "rhs", "args"):
            walk(node.get(key))

    walk(ast)
    return selectors, labels


def selector_text(node: dict[str, Any]) -> str:
    matchers = ", ".join(
        f"{m['name']}{m['type']}{json.dumps(m['value'])}" for m in node["matchers"]
    )
    return "{" + matchers + "}"


def problems(prom: prom_env.Prometheus, what: str, query: str, *, returns: bool) -> list[str]:
    """What is wrong with ``query`` against the live data (empty: nothing)."""
    try:
        ast = prom.get("/api/v1/parse_query", query=query)
    except Exception as exc:
        return [f"{what}: does not parse: {exc}"]
    selectors, labels = selectors_and_labels(ast)
    out = []
    seen: set[str] = set()
    for node in selectors:
        series = prom.get("/api/v1/series", **{"match[]": selector_text(node)})
        if not series:
            out.append(f"{what}: {selector_text(node)} returns no series")
        for s in series:
            seen |= set(s)
    if missing := labels - seen:
        out.append(f"{what}: labels {sorted(missing)} are on none of its series ({query})")
    if returns and not prom.get("/api/v1/query", query=query)["result"]:
        out.append(f"{what}: returns no series ({query})")
    return out


# --- the live world --------------------------------------------------------------------


@pytest.fixture
async def consumers(api: ApiClient) -> str:
    return await make_namespace(api, unique("consumers"))


@pytest.fixture
async def nodes(api: ApiClient) -> AsyncIterator[list[str]]:
    made: list[str] = []
    yield made
    for name in made:
        with contextlib.suppress(ApiException):
            await raw_request(api, "DELETE", f"/api/v1/nodes/{name}")


async def node(api: ApiClient, made: list[str]) -> str:
    name = unique("gpu-node")
    body = ex.node(name)
    for key in ("uid", "resourceVersion"):
        del body["metadata"][key]
    await raw_request(api, "POST", "/api/v1/nodes", body=body)
    made.append(name)
    return name


@contextlib.contextmanager
def shared_svc_run(cp: testenv.ControlPlane, namespace: str, log: Path) -> Iterator[int]:
    """``shared-svc run`` as its own process, both controllers, shipped defaults but a
    short eviction timeout and poll; yields its HTTP port."""
    port = testenv.free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SHARED_SVC_")},
        "KUBECONFIG": str(cp.kubeconfig),
        "OPERATOR_NAMESPACE": namespace,
        "POD_NAME": POD,
        "SHARED_SVC_BIND_ADDRESS": "127.0.0.1",
        "SHARED_SVC_PORT": str(port),
        "SHARED_SVC_UPGRADE_CONTROLLER": "true",
        "SHARED_SVC_UPGRADE_EVICTION_TIMEOUT_SECONDS": "2",
        "SHARED_SVC_UPGRADE_POLL_SECONDS": "0.5",
    }
    exe = Path(sys.executable).with_name("shared-svc")
    with log.open("wb") as out:
        proc = subprocess.Popen([str(exe), "run"], env=env, stdout=out, stderr=out)
    try:
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


EXPORTER_IP = "10.244.250.1"  # a DCGM exporter pod's address (never contacted: a stand-in)


@contextlib.contextmanager
def prometheus_of(port: int, namespace: str) -> Iterator[prom_env.Prometheus]:
    """Prometheus scraping ``port`` as a ServiceMonitor's target of ``namespace``, and one
    DCGM exporter pod of ``namespace`` (a stand-in, at port 9400 of its pod IP, through
    the stand-ins' proxy) in one job, with the chart's rules."""
    stand_ins = prom_env.StandIns().start(jobs=("exporters",))
    stand_ins.add(EXPORTER_IP)
    exporter_job = {
        "job_name": "nvidia-dcgm-exporter",
        "scrape_interval": "1s",
        "scrape_timeout": "1s",
        "proxy_url": f"http://127.0.0.1:{stand_ins.proxies['exporters']}",
        "static_configs": [
            {
                "targets": [f"{EXPORTER_IP}:{prom_env.EXPORTER_PORT}"],
                "labels": {"namespace": namespace},
            }
        ],
    }
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rules.yaml"],
        "scrape_configs": [
            {
                "job_name": JOB,
                "scrape_interval": "1s",
                "scrape_timeout": "1s",
                "static_configs": [
                    {
                        "targets": [f"127.0.0.1:{port}"],
                        "labels": {"namespace": namespace, "pod": POD},
                    }
                ],
            },
            exporter_job,
        ],
    }
    rules = yaml.safe_dump({"groups": rule_groups(namespace)}, sort_keys=False)
    try:
        prom = prom_env.start_with(config, {"rules.yaml": rules})
    except testenv.ControlPlaneError as exc:
        stand_ins.close()
        pytest.fail(f"Prometheus did not start: {exc}")
    try:
        yield prom
    finally:
        prom.stop()
        stand_ins.close()


async def status_of(port: int) -> dict[str, Any]:
    code, body = await http_get(port, "/status")
    assert code == 200, body
    status: dict[str, Any] = json.loads(body)
    return status


async def test_every_dashboard_query_and_alert_expression_runs_on_live_series(
    api: ApiClient,
    control_plane: testenv.ControlPlane,
    kube: Kube,
    consumers: str,
    nodes: list[str],
    tmp_path: Path,
) -> None:
    await kube.create_cr(cp_body(driver={"upgradePolicy": {"autoUpgrade": True}}))
    stuck, blocked, done = [await node(api, nodes) for _ in range(3)]
    await create(api, ex.declared_pod("slow", namespace=consumers, node_name=stuck))
    await _blocked_pod(api, consumers, blocked, "guarded")  # a PodDisruptionBudget keeps it
    await create(api, ex.declared_pod("quick", namespace=consumers, node_name=done))
    log = tmp_path / "shared-svc.log"
    with shared_svc_run(control_plane, kube.ns, log) as port:

        async def leading() -> bool:
            with contextlib.suppress(OSError, AssertionError, ValueError):
                return bool((await status_of(port))["leader"])
            return False

        await eventually(leading, timeout=60, interval=0.2)
        for n in (stuck, blocked, done):
            await set_state(api, n, "cordon-required")

        async def upgrade(name: str) -> dict[str, Any]:
            nodes_: dict[str, Any] = (await status_of(port))["upgrade"]["nodes"]
            return dict(nodes_.get(name) or {})

        # the quick consumer leaves (the test plays its kubelet), its node is freed, done
        async def evicted(name: str) -> bool:
            return f"{consumers}/quick" in (await upgrade(name)).get("evicted", ())

        await eventually(lambda: evicted(done), timeout=30)
        await raw_request(
            api,
            "DELETE",
            f"/api/v1/namespaces/{consumers}/pods/quick",
            body={"gracePeriodSeconds": 0},
        )

        async def phase_is(name: str, phase: str) -> bool:
            return (await upgrade(name)).get("phase") == phase

        await eventually(lambda: phase_is(done, "freed"), timeout=30)
        await set_state(api, done, "upgrade-done")

        async def restored() -> bool:
            _, text = await http_get(port, "/metrics")
            return 'shared_svc_upgrade_restores_total{cause="done"} 1.0' in text

        await eventually(restored, timeout=30)

        async def held() -> bool:
            return bool((await upgrade(stuck)).get("stuck")) and bool(
                (await upgrade(blocked)).get("blocked")
            )

        await eventually(held, timeout=30)
        with prometheus_of(port, kube.ns) as prom:
            sel = f'namespace="{kube.ns}", job="{JOB}"'

            async def scraped() -> bool:
                """The world is in Prometheus, with enough scrapes for every rate."""
                queries = (
                    f"shared_svc_upgrade_stalled_nodes{{{sel}}} > 0",
                    f"shared_svc_upgrade_blocked_pods{{{sel}}} > 0",
                    f"count_over_time(up{{{sel}}}[{RATE_INTERVAL}]) >= 5",
                )
                for query in queries:
                    data = await asyncio.to_thread(prom.get, "/api/v1/query", query=query)
                    if not data["result"]:
                        return False
                return True

            await eventually(scraped, timeout=60, interval=0.5)

            found: list[str] = []
            for title, query in dashboard_queries(kube.ns):
                found += await asyncio.to_thread(problems, prom, title, query, returns=True)
            groups = rule_groups(kube.ns)
            for rule in (r for g in groups for r in g["rules"]):
                found += await asyncio.to_thread(
                    problems, prom, rule["alert"], rule["expr"], returns=False
                )
            assert not found, "\n".join(found)

            async def alerts_evaluated() -> dict[str, dict[str, Any]]:
                data = await asyncio.to_thread(prom.get, "/api/v1/rules")
                return {r["name"]: r for g in data["groups"] for r in g["rules"]}

            async def active() -> bool:
                rules = await alerts_evaluated()
                return all(rules[name]["state"] in ("pending", "firing") for name in ACTIVE)

            await eventually(active, timeout=30, interval=0.5)
            rules = await alerts_evaluated()
            assert set(rules) == {r["alert"] for g in groups for r in g["rules"]}
            assert {n: r["health"] for n, r in rules.items()} == dict.fromkeys(rules, "ok"), rules
            quiet = {n: r["state"] for n, r in rules.items() if n not in ACTIVE}
            assert quiet == dict.fromkeys(quiet, "inactive"), (quiet, log.read_text()[-3000:])
