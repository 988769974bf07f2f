"""Harness for integration tests of the running service on the real test API server.

The CRs are cluster-scoped and the API server is shared by the whole session, so every
test that uses them starts from no ClusterPolicy/GPUCluster (``clean_crs``) and works
in a namespace of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import aiohttp
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from shared_svc.config import Config
from shared_svc.controllers.services.metrics import CONTROLLER
from shared_svc.controllers.services.reconciler import KEY
from shared_svc.k8s.events import Report
from shared_svc.runtime.controller import Controller
from shared_svc.service import Service
from testenv import ControlPlane
from testenv.gpu_operator import apiserver_requests
from testenv.service import running as running  # the tests' way to run the service
from testenv.workloads import DcgmWorkloads
from testenv.workloads import cp_body as cp_body  # the tests' CR bodies
from testenv.workloads import gc_body as gc_body

COMMON = {
    "dcgm": "nvidia.com/gpu-operator.dcgm",
    "exporter": "nvidia.com/gpu-operator.dcgm-exporter",
}


class Kube:
    """Thin admin helpers over one ApiClient."""

    def __init__(self, api: ApiClient, namespace: str) -> None:
        self.api = api
        self.ns = namespace
        self.core = client.CoreV1Api(api)
        self.apps = client.AppsV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.events = client.EventsV1Api(api)
        self.workloads = DcgmWorkloads(api, namespace, field_manager="test")

    # --- CRs ---
    async def create_cr(self, body: dict[str, Any]) -> dict[str, Any]:
        group, version = body["apiVersion"].split("/")
        plural = "clusterpolicies" if body["kind"] == "ClusterPolicy" else "gpuclusters"
        created: dict[str, Any] = await self.custom.create_cluster_custom_object(
            group, version, plural, body
        )
        return created

    async def patch_cr(self, kind: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        group, version, plural = _cr_gvp(kind)
        out: dict[str, Any] = await self.custom.patch_cluster_custom_object(
            group, version, plural, name, patch, _content_type="application/merge-patch+json"
        )
        return out

    async def delete_cr(self, kind: str, name: str) -> None:
        group, version, plural = _cr_gvp(kind)
        with contextlib.suppress(ApiException):
            await self.custom.delete_cluster_custom_object(group, version, plural, name)

    async def clean_crs(self) -> None:
        for kind in ("ClusterPolicy", "GPUCluster"):
            group, version, plural = _cr_gvp(kind)
            items = (await self.custom.list_cluster_custom_object(group, version, plural))["items"]
            for item in items:
                await self.delete_cr(kind, item["metadata"]["name"])

    # --- namespaced ---
    async def service(self, name: str) -> dict[str, Any] | None:
        try:
            svc = await self.core.read_namespaced_service(name, self.ns)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        out: dict[str, Any] = self.api.sanitize_for_serialization(svc)
        return out

    async def services(self) -> dict[str, dict[str, Any]]:
        items = (await self.core.list_namespaced_service(self.ns)).items
        return {s.metadata.name: self.api.sanitize_for_serialization(s) for s in items}

    async def service_monitor(self, name: str) -> dict[str, Any] | None:
        try:
            out: dict[str, Any] = await self.custom.get_namespaced_custom_object(
                "monitoring.coreos.com", "v1", self.ns, "servicemonitors", name
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return out

    async def events_for(self, reason: str, namespace: str | None = None) -> list[dict[str, Any]]:
        ns = namespace or self.ns
        # Read as JSON, not as the client's model: an Event another component wrote through
        # core/v1 (kube-controller-manager's, in ``default``) has no eventTime, which the
        # events.k8s.io/v1 model refuses.
        res = await self.events.list_namespaced_event(ns, _preload_content=False)
        items = json.loads(await res.read())["items"]
        return [
            e
            for e in items
            if e.get("reason") == reason and e.get("reportingController") == "nvidia.com/shared-svc"
        ]

    async def daemonset(self, app: str, *, common: bool, desired: int = 1, **status: Any) -> None:
        """A DaemonSet with the status its (absent) controller would report."""
        await self.workloads.daemonset(app, common=common, desired=desired, **status)

    async def pod(self, name: str, app: str, *, common: bool, ready: bool = True) -> None:
        await self.workloads.pod(name, app, common=common, ready=ready)

    async def delete_pod(self, name: str) -> None:
        await self.workloads.delete_pod(name)


def _cr_gvp(kind: str) -> tuple[str, str, str]:
    return (
        ("nvidia.com", "v1", "clusterpolicies")
        if kind == "ClusterPolicy"
        else ("nvidia.com", "v1alpha1", "gpuclusters")
    )


def service_config(control_plane: ControlPlane, namespace: str, **overrides: Any) -> Config:
    """Fast settings for tests: short coalescing, leader election off unless asked."""
    base: dict[str, Any] = {
        "namespace": namespace,
        "kubeconfig": str(control_plane.kubeconfig),
        "bind_address": "127.0.0.1",
        "port": 0,
        "pod_name": "shared-svc-test",
        "leader_election": False,
        "coalesce_seconds": 0.05,
        "resync_seconds": 30.0,
        "discovery_seconds": 1.0,
        # a ServiceMonitor without an interval, going away, is deleted 2 s after it selects
        # nothing (two scrape intervals)
        "scrape_interval_seconds": 1.0,
        "backoff_max_seconds": 2.0,
        "lease_duration_seconds": 3.0,
        "renew_deadline_seconds": 2.0,
        "retry_period_seconds": 0.5,
    }
    base.update(overrides)
    return Config(**base)


async def settle(service: Service, timeout: float = 30.0, quiet: float = 0.4) -> None:
    """Waits until the service has seen the latest changes and has nothing left to write.

    Watch events arrive within milliseconds here, so "converged, and still converged
    with no new write after a quiet period" is a reliable barrier.
    """
    ctrl, writer = service.controller, service.writer
    assert ctrl is not None and writer is not None
    runtime = services_runtime(service)
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        await asyncio.sleep(0.05)
        runtime.enqueue(KEY)
        before = sum(writer.writes.values())
        rid = ctrl.last_reconcile.get("id")
        await asyncio.sleep(quiet)
        if (
            await converged(service)
            and sum(writer.writes.values()) == before
            and ctrl.last_reconcile.get("id") != rid
        ):
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not converged within {timeout}s: {ctrl.last_reconcile}")


async def converged(service: Service) -> bool:
    """The last reconcile succeeded and planned no writes."""
    ctrl = service.controller
    if ctrl is None or ctrl.last_plan is None or ctrl.reconciling:
        return False
    return (
        ctrl.last_reconcile.get("result") == "success"
        and not ctrl.last_plan.writes
        and not services_runtime(service).pending(KEY)
    )


def services_runtime(service: Service) -> Controller[str]:
    """The runtime's Controller the service built from its Services reconciler."""
    return service.controllers[CONTROLLER]


WRITE_VERBS = ("POST", "PUT", "PATCH", "DELETE", "APPLY")


def apiserver_write_count(
    cp: ControlPlane, resources: tuple[str, ...] = ("services", "servicemonitors", "events")
) -> int:
    """Write requests the API server itself counted, for the given resources; dry runs
    (``dry_run="All"``: the guard probe's) change nothing and are not counted."""
    return sum(
        n
        for labels, n in apiserver_requests(cp)
        if labels.get("verb") in WRITE_VERBS
        and labels.get("resource") in resources
        and not labels.get("dry_run")
    )


def apiserver_dry_run_count(cp: ControlPlane, resource: str = "services") -> int:
    """Dry-run write requests (``dry_run="All"``) the API server counted for ``resource``."""
    return sum(
        n
        for labels, n in apiserver_requests(cp)
        if labels.get("dry_run") and labels.get("resource") == resource
    )


class FlakyRecorder:
    """Fails the first write of each key, then succeeds."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.failed: set[str] = set()

    async def emit(self, report: Report) -> bool:
        self.calls.append(report.key)
        if report.key not in self.failed:
            self.failed.add(report.key)
            return False
        return True


async def http_get(port: int, path: str) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            f"http://127.0.0.1:{port}{path}", timeout=aiohttp.ClientTimeout(total=5)
        ) as resp,
    ):
        return resp.status, await resp.text()


def successful_reconciles(service: Service) -> float:
    return metric(
        service,
        "controller_runtime_reconcile_total",
        controller="shared-services",
        result="success",
    )


def metric(service: Service, name: str, **labels: str) -> float:
    value = service.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


async def service_monitor_gone(kube: Kube, name: str, timeout: float = 30.0) -> None:
    """Waits until shared-svc has deleted ServiceMonitor ``name``: one going away first
    selects nothing for two scrape intervals (``reconcile.monitoring``), after the plan
    that let it go has settled."""
    from tests.kube import eventually

    async def gone() -> bool:
        return await kube.service_monitor(name) is None

    await eventually(gone, timeout=timeout, interval=0.2)
