"""The metrics the alerts and the dashboard read (issue 32), from the values the shells set
them from: the upgrade controller's node statuses and gate, the guard monitor's findings,
the Services plan. A live ``shared-svc run`` exposes them: tests/test_monitoring_prometheus.py."""

from __future__ import annotations

import contextlib
from typing import Any

from prometheus_client import CollectorRegistry

from shared_svc.config import Config
from shared_svc.controllers.services.metrics import PENDING_REASONS, ServicesMetrics
from shared_svc.controllers.services.outcomes import Outcomes
from shared_svc.controllers.upgrade.metrics import GATE_STATES, NODE_STATES, PHASES, UpgradeMetrics
from shared_svc.kube.recorder import EventPublisher
from shared_svc.reconcile.model import ObjectStatus, Plan
from shared_svc.runtime.controller import Controller, Options, Result
from shared_svc.runtime.instrumentation import RuntimeMetrics
from shared_svc.service_metrics import TARGET_LABELS, Metrics
from shared_svc.upgrade.gate import GateCheck, GateVerdicts
from shared_svc.upgrade.node_plan import NodeStatus
from shared_svc.upgrade.record import format_time
from shared_svc.wait.ratelimit import ItemExponentialFailureRateLimiter

NOW = 1_800_000_000.0
TIMEOUT = 300.0


def value(registry: CollectorRegistry, metric: str, **labels: str) -> float | None:
    return registry.get_sample_value(metric, labels)


CP = {"kind": "ClusterPolicy", "name": "cluster-policy"}


def verdicts(state: str, *sources: tuple[str, str]) -> GateVerdicts:
    """A review with one verdict ``state`` per source (kind, name): the ClusterPolicy by default."""
    checks = tuple(
        GateCheck(state, f"{kind}/{name}", "", 0, "", "")  # type: ignore[arg-type]
        for kind, name in (sources or (("ClusterPolicy", "cluster-policy"),))
    )
    return GateVerdicts("cluster-policy", "", checks)


def status(
    name: str, state: str | None, phase: Any, since: float | None = None, **kw: Any
) -> NodeStatus:
    return NodeStatus(
        node=name,
        state=state,
        mode="free",
        phase=phase,
        parked_label=phase != "idle",
        parked_by_us=phase != "idle",
        since=None if since is None else format_time(since),
        freed_at=None,
        **kw,
    )


def test_stalled_nodes_are_freeing_past_the_timeout_with_no_eviction_refused() -> None:
    m = UpgradeMetrics()
    statuses = [
        status(
            "stuck",
            "pod-restart-required",
            "freeing",
            NOW - 400,
            pending=("ml/a",),
            stuck=("ml/a",),
        ),
        status("ds-stays", "drain-required", "freeing", NOW - 301, daemonset_pods=("mon/x",)),
        status(
            "blocked", "cordon-required", "freeing", NOW - 900, pending=("ml/b",), blocked=("ml/b",)
        ),
        status("young", "cordon-required", "freeing", NOW - 100, pending=("ml/c", "ml/d")),
        status("freed-long-ago", "pod-restart-required", "freed", NOW - 4000),
        status("parked", "validation-required", "parked", NOW - 4000),
        status("waiting", "upgrade-required", "idle"),
        status("libs-unknown", "", "idle"),
        status("newer-state", "a-future-state-required", "parked", NOW - 10),
        status("label-gone", None, "aborting", NOW - 10),
    ]
    for shown in statuses:
        m.changed(None, shown)
    m.publish(gate=verdicts("missing"), now=NOW, eviction_timeout=TIMEOUT)
    r = m.registry
    assert value(r, "shared_svc_upgrade_stalled_nodes") == 2
    assert value(r, "shared_svc_upgrade_blocked_pods") == 1
    assert value(r, "shared_svc_upgrade_stuck_pods") == 1
    assert value(r, "shared_svc_upgrade_pending_pods") == 4
    assert value(r, "shared_svc_upgrade_nodes", phase="freeing") == 4
    assert value(r, "shared_svc_upgrade_nodes", phase="restoring") == 0
    by_state = {s: value(r, "shared_svc_upgrade_nodes_by_state", state=s) for s in NODE_STATES}
    assert by_state["cordon-required"] == 2 and by_state["pod-restart-required"] == 2
    assert by_state["unknown"] == 1 and by_state["other"] == 1 and by_state["none"] == 1
    assert by_state["upgrade-done"] == 0 and sum(v or 0 for v in by_state.values()) == 10
    assert {s: value(r, "shared_svc_upgrade_gate", **CP, state=s) for s in GATE_STATES} == {
        s: 1.0 if s == "missing" else 0.0 for s in GATE_STATES
    }
    # once the consumers leave; the policy source changed (NVIDIADriver mode: two of them)
    for shown in statuses:
        m.changed(shown, None)
    nvd = (("NVIDIADriver", "a"), ("NVIDIADriver", "b"))
    m.publish(gate=verdicts("ok", *nvd), now=NOW, eviction_timeout=TIMEOUT)
    assert value(r, "shared_svc_upgrade_pending_pods") == 0
    assert all(value(r, "shared_svc_upgrade_nodes", phase=p) == 0 for p in PHASES)
    assert all(value(r, "shared_svc_upgrade_nodes_by_state", state=s) == 0 for s in NODE_STATES)
    assert value(r, "shared_svc_upgrade_stalled_nodes") == 0
    # The ClusterPolicy's series went with it; one verdict per NVIDIADriver.
    assert all(value(r, "shared_svc_upgrade_gate", **CP, state=s) is None for s in GATE_STATES)
    for _, name in nvd:
        assert value(r, "shared_svc_upgrade_gate", kind="NVIDIADriver", name=name, state="ok") == 1
        assert (
            value(r, "shared_svc_upgrade_gate", kind="NVIDIADriver", name=name, state="missing")
            == 0
        )
    m.publish(gate=None, now=NOW, eviction_timeout=TIMEOUT)  # not reviewed: what was, stays
    assert value(r, "shared_svc_upgrade_gate", kind="NVIDIADriver", name="a", state="ok") == 1


def test_the_counts_follow_each_change_and_a_beat_walks_only_the_nodes_being_freed() -> None:
    """Issues 33 and the wave: a status change updates the counts (no walk over the 5,000
    statuses shown); a beat sets the gauges from them and looks only at the nodes being
    freed, whose stalled count time moves."""
    m = UpgradeMetrics()
    r = m.registry
    young = status("young", "cordon-required", "freeing", NOW - 100, pending=("ml/c",))
    idle = [status(f"n{i}", "upgrade-done", "idle") for i in range(3)]
    for shown in (young, *idle):
        m.changed(None, shown)
    m.publish(gate=verdicts("ok"), now=NOW, eviction_timeout=TIMEOUT)
    assert value(r, "shared_svc_upgrade_stalled_nodes") == 0
    assert value(r, "shared_svc_upgrade_nodes_by_state", state="upgrade-done") == 3
    assert value(r, "shared_svc_upgrade_pending_pods") == 1
    m.publish(gate=verdicts("missing"), now=NOW + 300, eviction_timeout=TIMEOUT)
    assert value(r, "shared_svc_upgrade_stalled_nodes") == 1  # past the timeout now
    assert value(r, "shared_svc_upgrade_gate", **CP, state="missing") == 1
    freed = status("young", "cordon-required", "freed", NOW - 100)
    m.changed(young, freed)  # its consumer left
    m.publish(gate=verdicts("ok"), now=NOW + 300, eviction_timeout=TIMEOUT)
    assert value(r, "shared_svc_upgrade_stalled_nodes") == 0
    assert value(r, "shared_svc_upgrade_nodes", phase="freeing") == 0
    assert value(r, "shared_svc_upgrade_nodes", phase="freed") == 1
    assert value(r, "shared_svc_upgrade_pending_pods") == 0
    assert value(r, "shared_svc_upgrade_nodes_by_state", state="cordon-required") == 1
    m.changed(idle[0], None)  # the node left the caches
    m.publish(gate=verdicts("ok"), now=NOW + 300, eviction_timeout=TIMEOUT)
    assert value(r, "shared_svc_upgrade_nodes_by_state", state="upgrade-done") == 2
    assert value(r, "shared_svc_upgrade_nodes", phase="idle") == 2


def test_every_known_series_is_there_at_zero_from_the_start() -> None:
    m = Metrics()
    ServicesMetrics(m.registry)
    UpgradeMetrics(m.registry)
    r = m.registry
    assert all(value(r, "shared_svc_pending", reason=x) == 0 for x in PENDING_REASONS)
    assert value(r, "shared_svc_service_selector", dcgm_service="nvidia-dcgm", mode="common") == 0
    assert value(r, "shared_svc_admission_guard", mode="none") == 0
    assert value(r, "shared_svc_admission_webhooks", served="false") == 0
    assert value(r, "shared_svc_admission_unguarded_writers") == 0
    # The gate's series are per policy source: none before the first review.
    assert not [s for s in r.collect() for x in s.samples if x.name == "shared_svc_upgrade_gate"]
    assert all(value(r, "shared_svc_upgrade_nodes_by_state", state=s) == 0 for s in NODE_STATES)

    async def reconcile(key: str) -> Result:
        return Result()

    Controller(
        "upgrade",
        reconcile,
        Options(
            metrics=RuntimeMetrics.of(r),
            rate_limiter=ItemExponentialFailureRateLimiter(0.01, 1.0),
        ),
    )
    assert value(r, "workqueue_retries_total", name="upgrade") == 0
    assert value(r, "workqueue_depth", name="upgrade") == 0
    assert value(r, "controller_runtime_reconcile_errors_total", controller="upgrade") == 0
    assert value(r, "controller_runtime_reconcile_total", controller="upgrade", result="error") == 0


def test_the_guard_monitors_findings() -> None:
    m = Metrics()
    webhooks = [{"served": False}, {"served": True}, {"served": None}, {"served": False}]
    m.publish_guard("none", webhooks, 3)
    r = m.registry
    assert value(r, "shared_svc_admission_guard", mode="none") == 1
    assert value(r, "shared_svc_admission_guard", mode="policy") == 0
    assert value(r, "shared_svc_admission_webhooks", served="false") == 2
    assert value(r, "shared_svc_admission_webhooks", served="true") == 1
    assert value(r, "shared_svc_admission_webhooks", served="unprobed") == 1
    assert value(r, "shared_svc_admission_unguarded_writers") == 3
    m.publish_guard("policy", [], 0)
    assert value(r, "shared_svc_admission_guard", mode="none") == 0
    assert value(r, "shared_svc_admission_webhooks", served="false") == 0


def test_the_guard_probes_verdict_per_guard_one_reason_at_a_time() -> None:
    from shared_svc.admission.verdicts import GUARDS, REASONS
    from shared_svc.service_metrics import PROBE_GUARDS, PROBE_REASONS

    assert (PROBE_GUARDS, PROBE_REASONS) == (GUARDS, REASONS)  # spelled out in both layers
    m = Metrics()
    r = m.registry
    name = "shared_svc_admission_guard_probe"
    # from the start: every series, not_probed
    for guard in GUARDS:
        assert [value(r, name, guard=guard, reason=x) for x in REASONS] == [0, 0, 0, 0, 1]
    m.publish_guard("webhook", [], 0, {"delete": "fails_open", "update": "served"})
    assert value(r, name, guard="delete", reason="fails_open") == 1
    assert value(r, name, guard="delete", reason="not_probed") == 0
    assert value(r, name, guard="update", reason="served") == 1
    m.publish_guard("webhook", [], 0, {"delete": "served", "update": "served"})
    assert value(r, name, guard="delete", reason="fails_open") == 0
    assert value(r, name, guard="delete", reason="served") == 1


class _Quiet:
    async def emit(self, report: Any) -> None:  # pragma: no cover - never called here
        raise AssertionError(report)


def test_each_services_selector_mode() -> None:
    m = ServicesMetrics()
    outcomes = Outcomes(
        Config(namespace="gpu-operator"), events=EventPublisher(_Quiet()), metrics=m
    )
    plan = Plan(
        status=(
            ObjectStatus(
                "Service",
                "nvidia-dcgm",
                ("ClusterPolicy/cp",),
                {"nvidia.com/gpu-operator.dcgm": "true"},
            ),
            ObjectStatus(
                "Service",
                "nvidia-dcgm-exporter",
                ("ClusterPolicy/cp",),
                {"app": "nvidia-dcgm-exporter"},
            ),
            ObjectStatus("ServiceMonitor", "nvidia-dcgm-exporter", ("ClusterPolicy/cp",)),
        )
    )
    outcomes.record_plan_metrics(plan)
    r = m.registry

    def modes(service: str) -> tuple[float | None, float | None]:
        return (
            value(r, "shared_svc_service_selector", dcgm_service=service, mode="common"),
            value(r, "shared_svc_service_selector", dcgm_service=service, mode="app"),
        )

    assert modes("nvidia-dcgm") == (1, 0)
    assert modes("nvidia-dcgm-exporter") == (0, 1)
    assert modes("nvidia-dcgm-dra") == (0, 0), "not managed"
    assert value(r, "shared_svc_pending", reason="SelectorMigrationPending") == 0
    outcomes.record_plan_metrics(Plan())
    assert modes("nvidia-dcgm") == (0, 0)


def test_no_metric_of_ours_has_a_label_a_service_monitor_target_sets() -> None:
    """prometheus-operator's targets carry namespace, service, pod, container, endpoint,
    job and instance: a metric's own label of one of those names would arrive renamed
    ``exported_<name>`` (issue 46). Every metric the running service registers, both
    controllers on."""
    m = Metrics()
    ServicesMetrics(m.registry)
    UpgradeMetrics(m.registry)
    # The label names of every collector, declared or not yet used (prometheus_client keeps
    # them on the metric; the exposition shows only labels with a child).
    labels = {
        name: set(getattr(collector, "_labelnames", ()))
        for collector, names in m.registry._collector_to_names.items()
        for name in names
    }
    assert labels, "the registry's metrics"
    clashes = {n: sorted(ls & TARGET_LABELS) for n, ls in labels.items() if ls & TARGET_LABELS}
    assert not clashes, clashes


def test_a_replica_that_never_led_reports_itself_as_no_leader() -> None:
    """``leader_election_master_status`` is there, 0, before the replica ever leads (as
    docs/operations.md promises); without leader election the one replica leads."""
    from shared_svc.service import Service

    for election, status in ((True, 0), (False, 1)):
        svc = Service(Config(namespace="ns", leader_election=election, pod_name="p"))
        registry = svc.metrics.registry
        assert value(registry, "leader_election_master_status", name="shared-svc") == status


def test_build_info_and_the_process_and_python_collectors_are_exposed() -> None:
    """What kube-prometheus-stack's users read of every process (issue 46)."""
    import platform

    from shared_svc import __version__

    r = Metrics().registry
    info = {"version": __version__, "python_version": platform.python_version()}
    assert value(r, "shared_svc_build_info", **info) == 1
    assert (value(r, "process_resident_memory_bytes") or 0) > 0
    assert (value(r, "process_start_time_seconds") or 0) > 0
    assert value(r, "process_cpu_seconds_total") is not None
    assert value(r, "python_info", **_python_info()) == 1
    assert value(r, "python_gc_collections_total", generation="0") is not None


def _python_info() -> dict[str, str]:
    import platform

    major, minor, patch = platform.python_version_tuple()
    return {
        "implementation": platform.python_implementation(),
        "major": major,
        "minor": minor,
        "patchlevel": patch,
        "version": platform.python_version(),
    }


async def test_the_work_queue_reports_how_long_a_key_waited_and_was_worked_on() -> None:
    from shared_svc.runtime.workqueue import WorkQueue

    runtime = RuntimeMetrics.of(CollectorRegistry())
    runtime.declare("q")
    queue: WorkQueue[str] = WorkQueue("q", metrics=runtime)
    r = runtime.registry
    assert value(r, "workqueue_queue_duration_seconds_count", name="q") == 0
    queue.add("k")
    key = await queue.get()
    assert value(r, "workqueue_queue_duration_seconds_count", name="q") == 1
    assert value(r, "workqueue_work_duration_seconds_count", name="q") == 0
    queue.done(key)
    assert value(r, "workqueue_work_duration_seconds_count", name="q") == 1
    assert (value(r, "workqueue_work_duration_seconds_sum", name="q") or 0) >= 0


async def test_webhook_requests_are_counted_by_path_and_code_with_their_latency() -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from shared_svc.admission.server import make_webhook_app

    m = Metrics()
    app = make_webhook_app(
        namespace="ns", operator_users=[], needed_by=lambda: None, on_answered=m.webhook_answered
    )
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u1",
            "operation": "DELETE",
            "namespace": "ns",
            "name": "nvidia-dcgm",
            "resource": {"group": "", "version": "v1", "resource": "services"},
            "userInfo": {"username": "alice"},
        },
    }
    async with TestClient(TestServer(app)) as http:
        assert (await http.post("/validate-delete", json=review)).status == 200
        assert (await http.post("/mutate", data=b"{")).status == 400
    r = m.registry
    ok = {"webhook": "/validate-delete", "code": "200"}
    assert value(r, "controller_runtime_webhook_requests_total", **ok) == 1
    bad = {"webhook": "/mutate", "code": "400"}
    assert value(r, "controller_runtime_webhook_requests_total", **bad) == 1
    for path in ("/validate-delete", "/mutate"):
        assert value(r, "controller_runtime_webhook_latency_seconds_count", webhook=path) == 1


def test_the_served_certificate_s_expiry_is_a_metric(tmp_path: Any) -> None:
    import datetime as dt

    from cryptography import x509

    from shared_svc.admission.server import CertReloader
    from tests.admission import make_tls

    tls = make_tls(tmp_path)
    m = Metrics()
    assert (
        value(m.registry, "shared_svc_admission_webhook_certificate_expiry_timestamp_seconds") == 0
    )
    CertReloader(str(tls.cert_file), str(tls.key_file), on_loaded=m.webhook_certificate_loaded)
    with open(tls.cert_file, "rb") as fh:
        cert = x509.load_pem_x509_certificate(fh.read())
    expiry = value(m.registry, "shared_svc_admission_webhook_certificate_expiry_timestamp_seconds")
    assert expiry == cert.not_valid_after_utc.timestamp()
    assert expiry > dt.datetime.now(dt.UTC).timestamp()


async def test_api_client_requests_are_counted_by_method_and_code() -> None:
    """rest_client_requests_total, as client-go counts: a 200, a 404, and a request no
    server answered (``<error>``)."""
    from aiohttp import web
    from kubernetes_asyncio import client

    from shared_svc.kube.writer import raw_request
    from shared_svc.kubeconfig import count_requests
    from testenv import free_port

    async def handler(request: web.Request) -> web.Response:
        if request.path == "/api":
            return web.json_response({"kind": "APIVersions", "versions": ["v1"]})
        return web.json_response({"kind": "Status", "code": 404}, status=404)

    app = web.Application()
    app.router.add_get("/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    m = Metrics()
    try:
        for host in (f"http://127.0.0.1:{port}", f"http://127.0.0.1:{free_port()}"):
            config = client.Configuration(host=host)
            async with client.ApiClient(configuration=config) as api:
                count_requests(api, m.api_request)
                for path in ("/api", "/api/v1/namespaces/none"):
                    with contextlib.suppress(Exception):
                        await raw_request(api, "GET", path)
    finally:
        await runner.cleanup()
    r = m.registry
    assert value(r, "rest_client_requests_total", method="GET", code="200") == 1
    assert value(r, "rest_client_requests_total", method="GET", code="404") == 1
    assert value(r, "rest_client_requests_total", method="GET", code="<error>") == 2
