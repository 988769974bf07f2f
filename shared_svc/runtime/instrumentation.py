"""controller-runtime's metric names, one set per registry, shared by every controller
(each labels its samples with ``controller`` / ``name``)."""

from __future__ import annotations

import weakref

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_BY_REGISTRY: weakref.WeakKeyDictionary[CollectorRegistry, RuntimeMetrics] = (
    weakref.WeakKeyDictionary()
)


class RuntimeMetrics:
    """Use :meth:`of`: a registry refuses the same name twice."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = self.registry = registry
        self.reconcile_total = Counter(
            "controller_runtime_reconcile_total",
            "Reconciles by controller and result.",
            ["controller", "result"],
            registry=r,
        )
        self.reconcile_errors = Counter(
            "controller_runtime_reconcile_errors_total",
            "Reconciles that failed.",
            ["controller"],
            registry=r,
        )
        self.reconcile_time = Histogram(
            "controller_runtime_reconcile_time_seconds",
            "Time per reconcile.",
            ["controller"],
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.workqueue_depth = Gauge(
            "workqueue_depth", "Keys waiting in the work queue.", ["name"], registry=r
        )
        self.workqueue_adds = Counter(
            "workqueue_adds_total", "Keys added to the work queue.", ["name"], registry=r
        )
        self.workqueue_retries = Counter(
            "workqueue_retries_total",
            "Keys re-added after a failure (rate-limited).",
            ["name"],
            registry=r,
        )
        # client-go's work queue latencies (its buckets: 1 us to 10 s, times ten).
        latency = tuple(10.0**e for e in range(-6, 2))
        self.workqueue_queue_duration = Histogram(
            "workqueue_queue_duration_seconds",
            "Time a key waits in the work queue before it is handed out.",
            ["name"],
            registry=r,
            buckets=latency,
        )
        self.workqueue_work_duration = Histogram(
            "workqueue_work_duration_seconds",
            "Time from handing a key out to its being done.",
            ["name"],
            registry=r,
            buckets=latency,
        )

    def declare(self, controller: str) -> None:
        """A controller's series, there at 0 from its start (as controller-runtime and
        client-go's work queue create theirs), so a dashboard or an alert on retries or
        errors never meets a missing series; its queue has the controller's name."""
        self.reconcile_errors.labels(controller)
        for result in ("success", "error"):
            self.reconcile_total.labels(controller, result)
        self.workqueue_depth.labels(controller).set(0)
        self.workqueue_adds.labels(controller)
        self.workqueue_retries.labels(controller)
        self.workqueue_queue_duration.labels(controller)
        self.workqueue_work_duration.labels(controller)

    def reconciled(self, controller: str, result: str | None, seconds: float) -> None:
        """One reconcile of ``controller`` that ended with ``result`` (None: nothing was
        reconciled, not counted) after ``seconds``."""
        if result is not None:
            self.reconcile_total.labels(controller, result).inc()
            if result == "error":
                self.reconcile_errors.labels(controller).inc()
            self.reconcile_time.labels(controller).observe(seconds)

    @classmethod
    def of(cls, registry: CollectorRegistry) -> RuntimeMetrics:
        metrics = _BY_REGISTRY.get(registry)
        if metrics is None:
            metrics = _BY_REGISTRY[registry] = cls(registry)
        return metrics
