"""The running service: API client, leader election, controllers and HTTP endpoints.

Every long-running part is a Runnable of one ``Manager`` (``shared_svc.runtime``),
started in order and stopped in the reverse order on SIGTERM: the controllers stop taking
new work and finish the reconcile in flight, then the upgrade gate's review, the
ServiceMonitor cache and discovery, the guard monitor and the webhook server stop, then
the caches, then the Lease is released (a standby takes over at once), then the HTTP
server closes; last the API client is closed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from kubernetes_asyncio.client import ApiClient

from shared_svc.admission.guard import AdmissionGuard
from shared_svc.config import Config
from shared_svc.controllers import shared_caches
from shared_svc.controllers.services.reconciler import ServicesReconciler
from shared_svc.http import HttpServer, make_app
from shared_svc.kube.lease import LeaseElector
from shared_svc.kube.recorder import EventPublisher, EventRecorder
from shared_svc.kube.writer import Writer
from shared_svc.kubeconfig import api_client, count_requests, small_tls_reads, without_compression
from shared_svc.runtime import heap
from shared_svc.runtime.controller import Controller, controller_for
from shared_svc.runtime.manager import Manager, Runnable
from shared_svc.service_metrics import Metrics

if TYPE_CHECKING:
    from shared_svc.controllers.upgrade.reconciler import UpgradeReconciler
    from shared_svc.kube.registry import CacheRegistry

log = logging.getLogger(__name__)


class ControllerCrashed(RuntimeError):
    """A controller loop ended without being asked to; the process should exit non-zero."""


class Service:
    def __init__(self, config: Config, *, freeze_heap: bool = True) -> None:
        """``freeze_heap``: once every cache has synced, freeze what they hold out of the
        garbage collector's scans (``runtime.heap``): the process's own heap, as
        ``shared-svc run`` is; off for a service run inside another program (the tests,
        the demo), whose heap is not the service's to freeze."""
        self.config = config
        self._freeze_heap = freeze_heap
        self.metrics = Metrics()
        # 0 until it leads (a replica that never led is there too, as a standby); without
        # leader election the one replica leads.
        self.metrics.leader.labels(config.lease_name).set(0 if config.leader_election else 1)
        self.api: ApiClient | None = None
        self.elector: LeaseElector | None = None
        self.controller: ServicesReconciler | None = None
        self.upgrade: UpgradeReconciler | None = None
        # The runtime's Controllers, by name, built from the reconcilers (controller_for).
        self.controllers: dict[str, Controller[Any]] = {}
        self.manager: Manager | None = None  # runs every part (shared_svc.runtime)
        self.writer: Writer | None = None
        self.recorder: EventRecorder | None = None
        self.events: EventPublisher | None = None  # the one publisher, for every sender
        self.admission: AdmissionGuard | None = None  # the webhook server and guard monitor
        self.http: HttpServer | None = None  # /livez /readyz /status /metrics
        self.port: int | None = None
        self.started = asyncio.Event()

    def is_leader(self) -> bool:
        return self.elector.is_leader if self.elector else True

    def runnables(self) -> list[Runnable]:
        """Every long-running part, in start order (empty before ``run``)."""
        return self.manager.runnables if self.manager is not None else []

    def alive(self) -> bool:
        """No part wedged (shared_svc.runtime.manager.STALL_SECONDS)."""
        return all(r.alive() for r in self.runnables())

    def ready(self) -> bool:
        """Caches synced, for every controller that runs (a standby is ready too)."""
        return all(r.ready() for r in self.runnables())

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "identity": self.config.pod_name,
            "leader": self.is_leader(),
            "leaderElection": self.config.leader_election,
            "leaseHolder": self.elector.holder if self.elector else self.config.pod_name,
            "leaseError": self.elector.last_error if self.elector else None,
            "dryRun": self.config.dry_run,
            "namespace": self.config.namespace,
            "selectorMode": self.config.selector_mode,
        }
        if self.controller:
            out.update(self.controller.status())
        if self.upgrade is not None:
            out["upgrade"] = self.upgrade.status()
        if self.admission is not None:
            out["admissionGuard"] = self.admission.status()
        return out

    async def run(self, stop: asyncio.Event) -> None:
        cfg = self.config
        small_tls_reads()  # a wave opens 100 connections (kubeconfig.small_tls_reads)
        self.api = api = await api_client(cfg.kubeconfig)
        count_requests(api, self.metrics.api_request)
        if not cfg.api_compression:
            without_compression(api)
        try:
            self.manager = Manager(self._build(api), self.is_leader)
            # Until SIGTERM or a part ending unexpectedly; then every part stops, in the
            # reverse order of starting (the controllers finish the reconcile in flight,
            # the Lease is released, the servers close).
            task = await self.manager.start(stop)
            if self.manager.started.is_set():
                self.port = self.http.port if self.http else None
                log.info("serving", extra={"port": self.port, "identity": cfg.pod_name})
                self.started.set()
            crashed = await task
            log.info("stopped in order", extra={"parts": self.manager.stopped})
            if crashed:
                # After a clean shutdown (Lease released): exit non-zero so Kubernetes restarts us.
                raise ControllerCrashed(f"a controller ended unexpectedly: {crashed[0]!r}")
        finally:
            await api.close()
            log.info("stopped")

    def _build(self, api: ApiClient) -> list[Runnable]:
        """Every long-running part, as a Runnable of the Manager, in start order: the HTTP
        server (probes answer from the start), the Lease, the caches of the shared
        registry (declared by the controllers built here), the admission guard (webhook
        server, certificate reload, monitor), then the controllers (ServiceMonitor
        discovery and the ServiceMonitor cache it switches, the Services controller, the
        upgrade gate's review, the upgrade controller)."""
        cfg = self.config
        self.events, self.writer = self._writes(api)
        if cfg.leader_election:
            self.elector = self._lease_elector(api)
        # One cache per resource, shared by both controllers (DaemonSets, ClusterPolicies);
        # the registry reports each one's sync (shared_svc_cache_synced) and, once all
        # have synced, what they hold is frozen out of the garbage collector's scans.
        caches = shared_caches.registry(
            api,
            cfg,
            on_synced=self.metrics.cache_synced_changed,
            on_all_synced=heap.freeze if self._freeze_heap else None,
        )
        if cfg.services_controller:
            self.controller = ServicesReconciler(
                api,
                cfg,
                caches=caches,
                recorder=self.events,
                writer=self.writer,
                metrics=self.metrics.registry,
                is_leader=self.is_leader,
            )
        if cfg.upgrade_controller:
            self.upgrade = self._upgrade_controller(api, caches, self.events)
        app = make_app(
            alive=self.alive, ready=self.ready, status=self.status, registry=self.metrics.registry
        )
        self.http = HttpServer("http", app, cfg.bind_address, cfg.port)
        parts: list[Runnable] = [self.http]
        if self.elector is not None:
            parts.append(self.elector)
        # Every cache the controllers asked for, once: all listing at once, before the
        # controllers that wait for them to sync, stopped after them.
        parts += caches.runnables()
        if self.controller is not None:
            self.admission = self._admission_guard(api, self.controller, self.events)
            parts += self.admission.runnables()
        for reconciler in (self.controller, self.upgrade):
            if reconciler is not None:
                controller = self.controllers[reconciler.name] = controller_for(reconciler)
                parts += controller.runnables()
        return parts

    def _writes(self, api: ApiClient) -> tuple[EventPublisher, Writer]:
        """The one Event publisher of the service (in dry-run it logs instead of sending)
        and the Services controller's Writer (it sends the leader's writes only, none in
        dry-run)."""
        cfg = self.config
        self.recorder = EventRecorder(api, reporting_instance=cfg.pod_name)
        events = EventPublisher(
            self.recorder,
            dry_run=cfg.dry_run,
            on_written=lambda r: self.metrics.events.labels(r.type, r.reason).inc(),
        )
        writer = Writer(
            api,
            rate=cfg.writes_per_second,
            burst=cfg.writes_burst,
            dry_run=cfg.dry_run,
            is_leader=self.is_leader,
        )
        return events, writer

    def _lease_elector(self, api: ApiClient) -> LeaseElector:
        """Leader election on the configured Lease; each change is told to the Manager."""
        cfg = self.config
        return LeaseElector(
            api,
            namespace=cfg.namespace,
            name=cfg.lease_name,
            identity=cfg.pod_name,
            lease_duration=cfg.lease_duration_seconds,
            renew_deadline=cfg.renew_deadline_seconds,
            retry_period=cfg.retry_period_seconds,
            on_change=lambda lead: self._on_leadership(lead),
            on_error=lambda _: self.metrics.lease_errors.inc(),
        )

    def _admission_guard(
        self, api: ApiClient, services: ServicesReconciler, events: EventPublisher
    ) -> AdmissionGuard:
        """The admission guard: it reads what the Services reconciler caches and plans."""
        return AdmissionGuard(
            api,
            self.config,
            recorder=events,
            objects=services.cached_objects,
            needed_by=services.needed_by,
            is_leader=self.is_leader,
            on_checked=lambda m: self.metrics.publish_guard(
                m.mode,
                m.webhooks,
                len(m.writers),
                {g: v.reason for g, v in m.verdicts.items()},
            ),
            on_answered=self.metrics.webhook_answered,
            on_certificate=self.metrics.webhook_certificate_loaded,
        )

    def _upgrade_controller(
        self, api: ApiClient, caches: CacheRegistry, events: EventPublisher
    ) -> UpgradeReconciler:
        """The upgrade controller, on the shared caches, calling the API through
        ``KubeUpgradeIO`` (imported only when it is switched on)."""
        from shared_svc.controllers.upgrade.io import KubeUpgradeIO, upgrade_write_limiter
        from shared_svc.controllers.upgrade.reconciler import UpgradeReconciler

        cfg = self.config
        return UpgradeReconciler(
            cfg,
            events,
            caches=caches,
            io=KubeUpgradeIO(
                api,
                cfg.upgrade_driver_name,
                write_limiter=upgrade_write_limiter(cfg),
                dry_run=cfg.dry_run,
                is_leader=self.is_leader,
            ),
            is_leader=self.is_leader,
            metrics=self.metrics.registry,
        )

    def _on_leadership(self, lead: bool) -> None:
        self.metrics.leader.labels(self.config.lease_name).set(1 if lead else 0)
        if self.manager is not None:
            self.manager.leadership_changed(lead)
