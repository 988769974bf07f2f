"""The running service's Prometheus registry and the metrics of no one controller:
controller-runtime's (``shared_svc.runtime.instrumentation``, one set for both
controllers), leader election, Events written (every sender), the Lease's errors and
each cache's sync (set by the cache registry for every cache). Each controller registers
its own metrics on the same registry (``controllers/services/metrics.py``,
``controllers/upgrade/metrics.py``).

One registry per running service (not the global default), so several replicas can run
in one process in tests and each /metrics shows only its own figures.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from shared_svc import __version__
from shared_svc.runtime.instrumentation import RuntimeMetrics

# The labels a target of prometheus-operator's ServiceMonitor carries (its own: namespace,
# service, pod, container, endpoint; Prometheus': job, instance). A metric's label of the
# same name arrives renamed exported_<name> (honorLabels is off, as it should be), so no
# metric of ours has one (tests/test_monitoring_metrics.py checks every registered one).
TARGET_LABELS = frozenset(
    {"namespace", "service", "pod", "container", "endpoint", "job", "instance"}
)
# shared_svc_admission_guard{mode}: admission.guard.guard_mode's values.
GUARD_MODES = ("policy", "webhook", "none", "unknown")
# shared_svc_admission_webhooks{served}: the guard's webhooks by what their probe found.
WEBHOOK_SERVED = ("true", "false", "unprobed")
# shared_svc_admission_guard_probe{guard, reason}: the guard probe through the API server
# (admission.verdicts' GUARDS and REASONS, spelled out: this layer imports no admission).
PROBE_GUARDS = ("delete", "update")
PROBE_REASONS = ("served", "fails_open", "answered_wrongly", "probe_failed", "not_probed")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # The reconcile loop's metrics: the runtime's, shared by both controllers
        # (controller="shared-services" / "upgrade").
        self.runtime = RuntimeMetrics.of(r)
        self.leader = Gauge(
            "leader_election_master_status", "1 if this replica leads.", ["name"], registry=r
        )
        self.events = Counter(
            "shared_svc_events_total",
            "Events emitted, by type and reason.",
            ["type", "reason"],
            registry=r,
        )
        self.lease_errors = Counter(
            "shared_svc_lease_errors_total",
            "Lease requests (acquire or renew) that failed or timed out.",
            registry=r,
        )
        self.cache_synced = Gauge(
            "shared_svc_cache_synced",
            "1 when the cache of a resource is synced (set by the cache registry whenever it "
            "changes).",
            ["resource"],
            registry=r,
        )
        # The process: what it is (build info), and the process and Python collectors
        # (memory, CPU, open files, start time; the interpreter; its garbage collector).
        self.build_info = Gauge(
            "shared_svc_build_info",
            "1, labelled with the version of shared-svc and of Python it runs on.",
            ["version", "python_version"],
            registry=r,
        )
        self.build_info.labels(__version__, platform.python_version()).set(1)
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        # client-go's rest_client_requests_total: every request of the API client, by
        # HTTP method and status code ("<error>": no answer), set by the client's trace
        # (kubeconfig.count_requests).
        self.api_requests = Counter(
            "rest_client_requests_total",
            "API server requests by HTTP method and status code.",
            ["method", "code"],
            registry=r,
        )
        self._admission(r)

    def _admission(self, r: CollectorRegistry) -> None:
        """The guard monitor's (``admission.guard``), set by :meth:`publish_guard`."""
        self.guard_mode = Gauge(
            "shared_svc_admission_guard",
            "1 for the admission guard found active: policy, webhook, none or unknown.",
            ["mode"],
            registry=r,
        )
        self.guard_webhooks = Gauge(
            "shared_svc_admission_webhooks",
            "The admission guard's webhooks by their probe: served true, false (configured "
            "but answering no AdmissionReview) or unprobed (behind the chart's Service).",
            ["served"],
            registry=r,
        )
        self.unguarded_writers = Gauge(
            "shared_svc_admission_unguarded_writers",
            "Objects of shared-svc that gpu-operator's field manager writes while no "
            "admission guard is active (the AdmissionGuardMissing Warning).",
            registry=r,
        )
        # controller-runtime's webhook metrics: the AdmissionReviews this replica's webhook
        # server answered, by path (webhook) and HTTP code, and how long each took.
        self.webhook_requests = Counter(
            "controller_runtime_webhook_requests_total",
            "AdmissionReview requests answered, by webhook path and HTTP code.",
            ["webhook", "code"],
            registry=r,
        )
        self.webhook_latency = Histogram(
            "controller_runtime_webhook_latency_seconds",
            "Time to answer an AdmissionReview, by webhook path.",
            ["webhook"],
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
        )
        self.webhook_certificate_expiry = Gauge(
            "shared_svc_admission_webhook_certificate_expiry_timestamp_seconds",
            "When the certificate the webhook server serves stops being valid (Unix time); "
            "only on a replica that serves the webhook.",
            registry=r,
        )
        self.guard_probe = Gauge(
            "shared_svc_admission_guard_probe",
            "1 for the last verdict of the guard probe through the API server, per guard "
            "(delete, update): served, fails_open (the API server let a dry run through that "
            "the guard refuses or changes), answered_wrongly, probe_failed or not_probed.",
            ["guard", "reason"],
            registry=r,
        )
        for guard in PROBE_GUARDS:
            for reason in PROBE_REASONS:
                self.guard_probe.labels(guard, reason).set(1 if reason == "not_probed" else 0)
        for mode in GUARD_MODES:
            self.guard_mode.labels(mode).set(0)
        for served in WEBHOOK_SERVED:
            self.guard_webhooks.labels(served).set(0)

    def publish_guard(
        self,
        mode: str,
        webhooks: list[dict[str, Any]],
        unguarded_writers: int,
        verdicts: Mapping[str, str] | None = None,
    ) -> None:
        """The guard monitor's findings after each check (``admission.guard.GuardMonitor``);
        ``verdicts``: the probe's reason per guard."""
        for guard, reason in (verdicts or {}).items():
            for r in PROBE_REASONS:
                self.guard_probe.labels(guard, r).set(1 if r == reason else 0)
        for m in GUARD_MODES:
            self.guard_mode.labels(m).set(1 if m == mode else 0)
        served = {True: "true", False: "false", None: "unprobed"}
        counts = {v: 0 for v in WEBHOOK_SERVED}
        for hook in webhooks:
            counts[served[hook.get("served")]] += 1
        for value, n in counts.items():
            self.guard_webhooks.labels(value).set(n)
        self.unguarded_writers.set(unguarded_writers)

    def cache_synced_changed(self, cache: str, synced: bool) -> None:
        """The cache registry's report (``kube.registry.CacheRegistry``: every cache)."""
        self.cache_synced.labels(cache).set(1 if synced else 0)

    def webhook_answered(self, path: str, code: int, seconds: float) -> None:
        """The webhook server's report of one request (``admission.server``)."""
        self.webhook_requests.labels(path, str(code)).inc()
        self.webhook_latency.labels(path).observe(seconds)

    def webhook_certificate_loaded(self, expiry: float | None) -> None:
        """The webhook server's certificate loaded (``admission.server.CertReloader``):
        when it stops being valid (0: unknown)."""
        self.webhook_certificate_expiry.set(expiry or 0)

    def api_request(self, method: str, code: str) -> None:
        """The API client's report of one request (``kubeconfig.count_requests``)."""
        self.api_requests.labels(method, code).inc()
