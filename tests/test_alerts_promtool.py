"""The chart's alerts proven by ``promtool test rules`` (issue 32).

promtool is the one of the Prometheus the tests already build (testenv/prometheus/build.sh:
the same module, v0.305.0). The rules are the chart's PrometheusRule as a user renders it
(Helm's engine, testenv/helmrender), in four renderings: the defaults with both
controllers, without leader election (one replica), another release, namespace and
job with extra alert labels, and with alerts switched off. Every alert gets series under
which it fires (exactly one alert, with its labels and its annotations expanded) and
series under which it must not fire (the condition too short or gone, a standby's view,
the same series from another namespace or job). The series are named from the metrics a
``Metrics`` registry of the service declares, so an expression naming a metric the
service does not expose fails its firing case; tests/test_monitoring_prometheus.py checks
every selector against a live ``shared-svc run``.
"""

from __future__ import annotations

import functools
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from shared_svc.controllers.services.metrics import ServicesMetrics
from shared_svc.controllers.upgrade.metrics import GATE_STATES, UpgradeMetrics
from shared_svc.service_metrics import Metrics
from testenv import prometheus as prom_env
from tests.test_deploy_chart import one, render_docs

pytestmark = [pytest.mark.helm, pytest.mark.prometheus]

REPO = Path(__file__).resolve().parent.parent
ON = ("prometheusRule.enabled=true", "controllers.upgrade=true")
ALERTS = (
    "SharedSvcDown",
    "SharedSvcNoLeader",
    "SharedSvcConfigConflicts",
    "SharedSvcConflictingWriter",
    "SharedSvcReconcileStale",
    "SharedSvcInvalidSpec",
    "SharedSvcDuplicateScrapeTarget",
    "SharedSvcExporterScrapedTwice",
    "SharedSvcLeaseErrors",
    "SharedSvcUpgradeEvictionBlocked",
    "SharedSvcUpgradeConsumersNotLeaving",
    "SharedSvcUpgradeFailedNodes",
    "SharedSvcUpgradeReconcileErrors",
    "SharedSvcUpgradeGateMissing",
    "SharedSvcAdmissionGuardNotServed",
    "SharedSvcAdmissionGuardMissing",
    "SharedSvcWebhookCertificateExpiry",
    "SharedSvcAdmissionGuardFailsOpen",
)
# Lease alerts: rendered only with leader election.
LEASE_ALERTS = ("SharedSvcNoLeader", "SharedSvcLeaseErrors")
# The API server's fail-open count (prometheusRule.apiServerFailOpen.enabled): its metric.
FAIL_OPEN_COUNT = "apiserver_admission_webhook_fail_open_count"


@dataclass(frozen=True)
class Rendering:
    """A chart rendering and where its targets are: their namespace, job and the labels
    every alert adds; the lease, when leader election is on."""

    sets: tuple[str, ...]
    name: str = "shared-svc"
    namespace: str = "gpu-operator"
    job: str = "shared-svc-metrics"
    lease: str | None = "shared-svc"
    extra: dict[str, str] = field(default_factory=dict)
    alerts: tuple[str, ...] = ALERTS


RENDERINGS = {
    "defaults": Rendering(ON),
    "no-leader-election": Rendering(
        (*ON, "replicas=1", "leaderElection.enabled=false"),
        lease=None,
        alerts=tuple(a for a in ALERTS if a not in LEASE_ALERTS),
    ),
    "other-namespace-job-and-labels": Rendering(
        (
            *ON,
            "leaderElection.leaseName=gpu-lease",
            "prometheusRule.job=gpu-shared",
            "prometheusRule.alertLabels.team=gpu",
            "prometheusRule.alertLabels.severity=page",
        ),
        name="gpu",
        namespace="nvidia-gpu",
        job="gpu-shared",
        lease="gpu-lease",
        extra={"team": "gpu"},
    ),
    "alerts-switched-off": Rendering(
        (
            *ON,
            "prometheusRule.disabled.SharedSvcLeaseErrors=true",
            "prometheusRule.disabled.SharedSvcUpgradeGateMissing=true",
        ),
        alerts=tuple(
            a for a in ALERTS if a not in ("SharedSvcLeaseErrors", "SharedSvcUpgradeGateMissing")
        ),
    ),
    "api-server-fail-open": Rendering(
        (*ON, "prometheusRule.apiServerFailOpen.enabled=true"),
        alerts=(*ALERTS, "SharedSvcAdmissionWebhookCallsFailOpen"),
    ),
}


@functools.cache
def promtool() -> Path:
    binary = prom_env.build() / "promtool"
    assert binary.exists(), f"{binary} missing: testenv/prometheus/build.sh builds it"
    return binary


def rule_groups(r: Rendering) -> list[dict[str, Any]]:
    """The rendered PrometheusRule's groups: what prometheus-operator writes as the rule file."""
    rule = one(render_docs(*r.sets, name=r.name, namespace=r.namespace), "PrometheusRule")
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def exposed_metric_names() -> set[str]:
    """The sample names the service's registry declares (Metrics with both controllers'
    on the same registry, as ``Service`` builds them)."""
    metrics = Metrics()
    ServicesMetrics(metrics.registry)
    UpgradeMetrics(metrics.registry)
    return names_of(metrics.registry)


def names_of(registry: CollectorRegistry) -> set[str]:
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {
        family.name + suffix
        for family in registry.collect()
        for suffix in suffixes.get(family.type, ("",))
    }


# --- the series of each case -----------------------------------------------------------

Labels = dict[str, str]


@dataclass
class World:
    """Input series of one case, written as promtool's expanding notation."""

    r: Rendering
    series: list[dict[str, str]] = field(default_factory=list)

    def target(self, pod: str = "shared-svc-a", **over: str) -> Labels:
        """The labels of a replica's target, as a ServiceMonitor gives them."""
        ip = {"shared-svc-a": "10.0.0.1", "shared-svc-b": "10.0.0.2"}.get(pod, "10.0.0.9")
        return {
            "namespace": self.r.namespace,
            "job": self.r.job,
            "pod": pod,
            "instance": f"{ip}:8080",
            **over,
        }

    def add(self, metric: str, labels: Labels, values: str) -> None:
        body = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        self.series.append({"series": f"{metric}{{{body}}}", "values": values})

    def both(self, metric: str, values: str, **labels: str) -> None:
        """The same values from both replicas (a standby plans too)."""
        for pod in ("shared-svc-a", "shared-svc-b"):
            self.add(metric, {**self.target(pod), **labels}, values)

    def foreign(self, metric: str, values: str, **labels: str) -> None:
        """The same metric from another namespace and from another job: never an alert here."""
        self.add(metric, {**self.target(namespace="other-ns"), **labels}, values)
        self.add(metric, {**self.target(job="other-job"), **labels}, values)

    def leader(self, pod: str = "shared-svc-a") -> None:
        """``pod`` leads, the other replica stands by; gpu-operator's own leader election
        (controller-runtime, same metric name) in the same namespace."""
        if self.r.lease is None:
            return
        for p in ("shared-svc-a", "shared-svc-b"):
            self.add(
                "leader_election_master_status",
                {**self.target(p), "name": self.r.lease},
                "1x60" if p == pod else "0x60",
            )
        self.add(
            "leader_election_master_status",
            {**self.target("gpu-operator-0", job="gpu-operator"), "name": "53822513.nvidia.com"},
            "1x60",
        )


@dataclass(frozen=True)
class Case:
    """Series, an evaluation time, and the alert expected then (None: none)."""

    world: Callable[[World], None]
    at: str
    fires: Labels | None  # the alert's labels besides alertname, severity and alertLabels
    value: str = ""  # {{ $value }} in the annotations


def world_of(r: Rendering, build: Callable[[World], None]) -> World:
    w = World(r)
    build(w)
    return w


def _ns_job(r: Rendering) -> Labels:
    return {"namespace": r.namespace, "job": r.job}


# For each alert: (firing cases, cases that must not fire); ``r`` is the rendering.
def cases(alert: str, r: Rendering) -> tuple[list[Case], list[Case]]:
    nj = _ns_job(r)
    stale_pod = {**nj, "pod": "shared-svc-a", "instance": "10.0.0.1:8080"}
    nvd_a = {"kind": "NVIDIADriver", "name": "a"}  # the one source whose gate does not hold

    def conflicts(values: str) -> Callable[[World], None]:
        def build(w: World) -> None:
            w.both("shared_svc_config_conflicts", values)
            w.foreign("shared_svc_config_conflicts", "1x60")

        return build

    def writer(values: str) -> Callable[[World], None]:
        def build(w: World) -> None:
            w.add("shared_svc_conflicting_writer_total", w.target("shared-svc-a"), values)
            w.add("shared_svc_conflicting_writer_total", w.target("shared-svc-b"), "0x150")
            w.foreign("shared_svc_conflicting_writer_total", "0+1x150")

        return build

    def stale(leader_values: str, standby_values: str) -> Callable[[World], None]:
        # promtool's clock starts at 0: a timestamp series of value v says "v seconds".
        def build(w: World) -> None:
            w.leader("shared-svc-a")
            name = "shared_svc_last_successful_reconcile_timestamp_seconds"
            w.add(name, w.target("shared-svc-a"), leader_values)
            if r.lease is not None:
                w.add(name, w.target("shared-svc-b"), standby_values)
            w.foreign(name, "0x60")

        return build

    def lease(values: str) -> Callable[[World], None]:
        def build(w: World) -> None:
            w.add("shared_svc_lease_errors_total", w.target("shared-svc-a"), values)
            w.add("shared_svc_lease_errors_total", w.target("shared-svc-b"), values)
            w.foreign("shared_svc_lease_errors_total", "0+1x60")

        return build

    def gauge(metric: str, values: str, **labels: str) -> Callable[[World], None]:
        def build(w: World) -> None:
            w.both(metric, values, **labels)
            w.foreign(metric, "3x60", **labels)

        return build

    def gate(state: str, freeing: str) -> Callable[[World], None]:
        """Two policy sources (NVIDIADriver mode): ``a`` with ``state``, ``b`` whose gate holds."""

        def build(w: World) -> None:
            for s in GATE_STATES:
                for name, verdict in (("a", state), ("b", "ok")):
                    w.both(
                        "shared_svc_upgrade_gate",
                        "1x60" if s == verdict else "0x60",
                        kind="NVIDIADriver",
                        name=name,
                        state=s,
                    )
            w.both("shared_svc_upgrade_nodes", "5x60", phase="idle")
            w.both("shared_svc_upgrade_nodes", freeing, phase="freeing")
            w.foreign("shared_svc_upgrade_gate", "1x60", state="missing")
            w.foreign("shared_svc_upgrade_nodes", "3x60", phase="freeing")

        return build

    def up(a: str, b: str) -> Callable[[World], None]:
        """The replicas' ``up`` ("": no target at all); another job's is down."""

        def build(w: World) -> None:
            for pod, values in (("shared-svc-a", a), ("shared-svc-b", b)):
                if values:
                    w.add("up", w.target(pod), values)
            w.foreign("up", "0x60")

        return build

    def leaders(a: str, b: str) -> Callable[[World], None]:
        def build(w: World) -> None:
            for pod, values in (("shared-svc-a", a), ("shared-svc-b", b)):
                w.add(
                    "leader_election_master_status", {**w.target(pod), "name": lease_name}, values
                )
            w.add(  # gpu-operator's leader, in the same namespace
                "leader_election_master_status",
                {**w.target("gpu-operator-0", job="gpu-operator"), "name": "53822513.nvidia.com"},
                "1x60",
            )
            w.foreign("leader_election_master_status", "0x60", name=lease_name)

        return build

    def errors(controller: str, values: str, blocked: str = "0x60") -> Callable[[World], None]:
        def build(w: World) -> None:
            name = "controller_runtime_reconcile_errors_total"
            w.add(name, {**w.target("shared-svc-a"), "controller": controller}, values)
            w.add(name, {**w.target("shared-svc-b"), "controller": controller}, "0x60")
            w.foreign(name, "0+1x60", controller="upgrade")
            w.both("shared_svc_upgrade_blocked_pods", blocked)

        return build

    def exporter_jobs(n: int, values: str, namespace: str = r.namespace) -> Callable[[World], None]:
        """The DCGM exporter pod at ``pod_ip`` a target of ``n`` jobs, with ``values`` in
        the last; shared-svc's own target (port 8080) beside it."""

        def build(w: World) -> None:
            jobs = ("nvidia-dcgm-exporter", "kubernetes-service-endpoints", "dcgm")[:n]
            for k, job in enumerate(jobs):
                labels = {"namespace": namespace, "job": job, "instance": f"{pod_ip}:9400"}
                w.add("up", labels, values if k == n - 1 else "1x60")
            w.add("up", w.target("shared-svc-a"), "1x60")

        return build

    pod_ip = "10.244.0.7"
    lease_name = r.lease or "shared-svc"
    expiry = "shared_svc_admission_webhook_certificate_expiry_timestamp_seconds"
    failed = {**nj, "state": "upgrade-failed"}
    duplicate = {**nj, "reason": "DuplicateScrapeTarget"}

    def probe(leader: str, standby: str, reason: str = "fails_open") -> Callable[[World], None]:
        # Only the leader probes: the standby says not_probed (0 for every other reason).
        def build(w: World) -> None:
            metric = "shared_svc_admission_guard_probe"
            w.add(metric, {**w.target("shared-svc-a"), "guard": "delete", "reason": reason}, leader)
            w.add(
                metric, {**w.target("shared-svc-b"), "guard": "delete", "reason": reason}, standby
            )
            w.add(metric, {**w.target("shared-svc-a"), "guard": "update", "reason": reason}, "0x60")
            w.foreign(metric, "1x60", guard="delete", reason="fails_open")

        return build

    def fail_open_count(values: str, name: str) -> Callable[[World], None]:
        def build(w: World) -> None:
            api = {"job": "apiserver", "instance": "10.0.0.100:6443", "type": "validate"}
            w.add(FAIL_OPEN_COUNT, {**api, "name": name}, values)
            w.add(FAIL_OPEN_COUNT, {**api, "name": "other.example.com"}, "0+1x60")

        return build

    guard_fails = {**nj, "guard": "delete", "reason": "fails_open"}
    delete_hook = "delete-guard.shared-svc.nvidia.com"
    table: dict[str, tuple[list[Case], list[Case]]] = {
        "SharedSvcDown": (
            # both replicas down; no target at all (the ServiceMonitor not selected)
            [Case(up("0x60", "0x60"), "10m", nj), Case(up("", ""), "10m", nj)],
            # one replica up; both down, but not for 5m yet
            [Case(up("1x60", "0x60"), "10m", None), Case(up("1x5 0x55", "1x5 0x55"), "8m", None)],
        ),
        "SharedSvcNoLeader": (
            [Case(leaders("0x60", "0x60"), "10m", {**nj, "name": lease_name}, "0")],
            # one leads; a handover (none leads for two minutes)
            [
                Case(leaders("1x60", "0x60"), "10m", None),
                Case(leaders("1x5 0x60", "0x7 1x60"), "10m", None),
            ],
        ),
        "SharedSvcInvalidSpec": (
            [Case(gauge("shared_svc_spec_errors", "1x60"), "15m", nj, "1")],
            [Case(gauge("shared_svc_spec_errors", "1x3 0x57"), "15m", None)],
        ),
        "SharedSvcDuplicateScrapeTarget": (
            [
                Case(
                    gauge("shared_svc_pending", "1x60", reason="DuplicateScrapeTarget"),
                    "35m",
                    duplicate,
                    "1",
                )
            ],
            # not for 30m yet; another reason
            [
                Case(
                    gauge("shared_svc_pending", "1x60", reason="DuplicateScrapeTarget"), "25m", None
                ),
                Case(gauge("shared_svc_pending", "1x60", reason="ServiceNotAdopted"), "35m", None),
            ],
        ),
        "SharedSvcExporterScrapedTwice": (
            # the exporter pod at 10.244.0.7 in two jobs (a ServiceMonitor's, an annotation job)
            [
                Case(
                    exporter_jobs(2, "1x60"),
                    "20m",
                    {"namespace": r.namespace, "instance": f"{pod_ip}:9400"},
                    "2",
                )
            ],
            # in one job; in two, but only for 5 minutes; another namespace's in two
            [
                Case(exporter_jobs(1, "1x60"), "20m", None),
                Case(exporter_jobs(2, "1x5"), "20m", None),
                Case(exporter_jobs(2, "1x60", namespace="other-ns"), "20m", None),
            ],
        ),
        "SharedSvcUpgradeFailedNodes": (
            [
                Case(
                    gauge("shared_svc_upgrade_nodes_by_state", "2x60", state="upgrade-failed"),
                    "15m",
                    failed,
                    "2",
                )
            ],
            [
                Case(
                    gauge("shared_svc_upgrade_nodes_by_state", "2x3 0x57", state="upgrade-failed"),
                    "15m",
                    None,
                ),
                Case(
                    gauge("shared_svc_upgrade_nodes_by_state", "2x60", state="upgrade-done"),
                    "15m",
                    None,
                ),
            ],
        ),
        "SharedSvcUpgradeReconcileErrors": (
            [Case(errors("upgrade", "0+1x60"), "25m", {**nj, "controller": "upgrade"})],
            # one failure long ago; the Services controller's failures (SharedSvcReconcileStale's);
            # refused evictions (SharedSvcUpgradeEvictionBlocked's)
            [
                Case(errors("upgrade", "0 1x59"), "25m", None),
                Case(errors("shared-services", "0+1x60"), "25m", None),
                Case(errors("upgrade", "0+1x60", blocked="1x60"), "25m", None),
            ],
        ),
        "SharedSvcWebhookCertificateExpiry": (
            # 1,000,000 s (11.6 days) at 0; at 2h: 992,800 s left
            [Case(gauge(expiry, "1000000x200"), "2h", nj, "992800")],
            # 58 days left; a replica that serves no webhook (0)
            [
                Case(gauge(expiry, "5000000x200"), "2h", None),
                Case(gauge(expiry, "0x200"), "2h", None),
            ],
        ),
        "SharedSvcConfigConflicts": (
            [Case(conflicts("1x60"), "35m", nj)],
            [Case(conflicts("1x20 0x40"), "35m", None), Case(conflicts("1x60"), "25m", None)],
        ),
        "SharedSvcConflictingWriter": (
            [Case(writer("0x10 3x140"), "17m", nj), Case(writer("0+1x150"), "60m", nj)],
            # the fight over at 11m: quiet 10 minutes later; no fight at all
            [Case(writer("0x10 3x140"), "22m", None), Case(writer("5x150"), "20m", None)],
        ),
        "SharedSvcReconcileStale": (
            # the leader's last success at 60 s; the standby keeps succeeding
            [Case(stale("60x60", "0+60x60"), "30m", stale_pod)],
            [
                Case(
                    stale("0+60x60", "60x60"), "30m", None
                ),  # the standby is stale, not the leader
                Case(stale("60x60", "0+60x60"), "18m", None),  # 900 s, but not yet for 5m
            ],
        ),
        "SharedSvcLeaseErrors": (
            [Case(lease("0+1x60"), "25m", nj)],
            # one failed renewal, long ago; and while it is recent, only pending
            [Case(lease("0 1x59"), "25m", None), Case(lease("0 1x59"), "8m", None)],
        ),
        "SharedSvcUpgradeEvictionBlocked": (
            [Case(gauge("shared_svc_upgrade_blocked_pods", "2x60"), "15m", nj, "2")],
            [Case(gauge("shared_svc_upgrade_blocked_pods", "2x3 0x57"), "15m", None)],
        ),
        "SharedSvcUpgradeConsumersNotLeaving": (
            [Case(gauge("shared_svc_upgrade_stalled_nodes", "1x60"), "15m", nj, "1")],
            [Case(gauge("shared_svc_upgrade_stalled_nodes", "1x3 0x57"), "15m", None)],
        ),
        "SharedSvcUpgradeGateMissing": (
            [
                Case(gate("missing", "3x60"), "15m", {**nj, **nvd_a, "state": "missing"}),
                Case(gate("mismatch", "3x60"), "15m", {**nj, **nvd_a, "state": "mismatch"}),
            ],
            # no node in an upgrade; a gate that holds
            [Case(gate("missing", "0x60"), "15m", None), Case(gate("ok", "3x60"), "15m", None)],
        ),
        "SharedSvcAdmissionGuardNotServed": (
            [
                Case(
                    gauge("shared_svc_admission_webhooks", "1x60", served="false"),
                    "15m",
                    {**nj, "served": "false"},
                    "1",
                )
            ],
            [
                Case(
                    gauge("shared_svc_admission_webhooks", "1x5 0x55", served="false"), "15m", None
                ),
                Case(gauge("shared_svc_admission_webhooks", "2x60", served="true"), "15m", None),
            ],
        ),
        "SharedSvcAdmissionGuardMissing": (
            [Case(gauge("shared_svc_admission_unguarded_writers", "2x60"), "15m", nj, "2")],
            [Case(gauge("shared_svc_admission_unguarded_writers", "2x5 0x55"), "15m", None)],
        ),
        "SharedSvcAdmissionGuardFailsOpen": (
            [
                Case(probe("1x60", "0x60"), "15m", guard_fails, "1"),
                Case(
                    probe("1x60", "0x60", "answered_wrongly"),
                    "15m",
                    {**guard_fails, "reason": "answered_wrongly"},
                    "1",
                ),
            ],
            # served again; failing for less than 5m; a served guard
            [
                Case(probe("1x5 0x55", "0x60"), "15m", None),
                Case(probe("0x10 1x50", "0x60"), "13m", None),
                Case(probe("1x60", "0x60", "served"), "15m", None),
            ],
        ),
        "SharedSvcAdmissionWebhookCallsFailOpen": (
            [
                Case(
                    fail_open_count("0+1x60", delete_hook),
                    "15m",
                    {"name": delete_hook, "type": "validate"},
                    "10",
                )
            ],
            # no failed call for the last 10 minutes; only another webhook's
            [
                Case(fail_open_count("0+1x5 5x55", delete_hook), "30m", None),
                Case(fail_open_count("0x60", delete_hook), "15m", None),
            ],
        ),
    }
    return table[alert]


# --- promtool ----------------------------------------------------------------------------

TEMPLATE = re.compile(r"\{\{\s*(\$labels\.(\w+)|\$value)\s*\}\}")


def expand(text: str, labels: Labels, value: str) -> str:
    """The annotation as Prometheus expands it: only ``{{ $labels.x }}`` and
    ``{{ $value }}`` are used (anything else is refused here)."""
    out = TEMPLATE.sub(lambda m: value if m.group(1) == "$value" else labels[m.group(2)], text)
    assert "{{" not in out, f"a template this test does not expand: {text}"
    return out


def promtool_tests(r: Rendering, rules: dict[str, dict[str, Any]]) -> dict[str, Any]:
    tests = []
    for alert, rule in rules.items():
        firing, quiet = cases(alert, r)
        for case in [*firing, *quiet]:
            w = world_of(r, case.world)
            expected = []
            if case.fires is not None:
                labels = {**case.fires, **r.extra, "severity": rule["labels"]["severity"]}
                expected.append(
                    {
                        "exp_labels": labels,
                        "exp_annotations": {
                            k: expand(v, labels, case.value) for k, v in rule["annotations"].items()
                        },
                    }
                )
            tests.append(
                {
                    "interval": "1m",
                    "input_series": w.series,
                    "alert_rule_test": [
                        {"eval_time": case.at, "alertname": alert, "exp_alerts": expected}
                    ],
                }
            )
    return {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}


def run_promtool(tmp_path: Path, groups: list[dict[str, Any]], tests: dict[str, Any]) -> str:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    check = subprocess.run(
        [str(promtool()), "check", "rules", "--lint-fatal", str(tmp_path / "rules.yaml")],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    proc = subprocess.run(
        [str(promtool()), "test", "rules", str(tmp_path / "tests.yaml")],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    return proc.stdout + proc.stderr if proc.returncode else ""


@pytest.mark.parametrize("rendering", sorted(RENDERINGS))
def test_every_alert_fires_when_it_should_and_only_then(rendering: str, tmp_path: Path) -> None:
    r = RENDERINGS[rendering]
    groups = rule_groups(r)
    rules = {rule["alert"]: rule for g in groups for rule in g["rules"]}
    assert tuple(rules) == r.alerts
    tests = promtool_tests(r, rules)
    names = {s["series"].split("{", 1)[0] for t in tests["tests"] for s in t["input_series"]}
    # every metric of the service's registry, Prometheus' own ``up`` and the API server's
    # fail-open count
    exposed = exposed_metric_names() | {"up", FAIL_OPEN_COUNT}
    assert names <= exposed, names - exposed
    failures = run_promtool(tmp_path, groups, tests)
    assert not failures, failures


def test_promtool_sees_an_alert_that_does_not_fire(tmp_path: Path) -> None:
    """The check can fail: an expression naming a metric the service does not expose (a
    typo) makes its firing case fail, and a firing case expected quiet fails too."""
    r = RENDERINGS["defaults"]
    groups = rule_groups(r)
    rules = {rule["alert"]: rule for g in groups for rule in g["rules"]}
    blocked = rules["SharedSvcUpgradeEvictionBlocked"]
    blocked["expr"] = blocked["expr"].replace("blocked_pods", "blocked_pod")
    failures = run_promtool(
        tmp_path, groups, promtool_tests(r, {"SharedSvcUpgradeEvictionBlocked": blocked})
    )
    assert "SharedSvcUpgradeEvictionBlocked" in failures and "exp:" in failures
    assert "shared_svc_upgrade_blocked_pod" not in exposed_metric_names()


def test_each_runbook_url_is_a_section_of_the_operations_doc() -> None:
    """By default an absolute link: docs/operations.md of the chart's own version at
    Chart.yaml's home, at the alert's section."""
    from tests.markdown import anchors

    operations = (REPO / "docs" / "operations.md").read_text()
    chart = yaml.safe_load((REPO / "deploy" / "chart" / "shared-svc" / "Chart.yaml").read_text())
    base = f"{chart['home']}/blob/v{chart['version']}/docs/operations.md"
    assert base.startswith("https://"), base
    for rendering in RENDERINGS.values():
        for g in rule_groups(rendering):
            for rule in g["rules"]:
                url = rule["annotations"]["runbook_url"]
                path, _, anchor = url.partition("#")
                assert path == base and anchor in anchors(operations), url
                assert rule["labels"]["severity"] in ("warning", "critical")
                assert rule["for"], rule["alert"]
