"""Conflicts and fights in the Services controller: one Warning Event per conflict and its
status entry, a fighting writer reported and not fought, who ConflictingWriter names, and a
write meeting changes logged at info until the same object keeps meeting them."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from shared_svc.config import Config
from shared_svc.controllers.services.metrics import ServicesMetrics
from shared_svc.k8s.managed_fields import managers_of_field
from testenv import ControlPlane
from tests.kube import eventually
from tests.svc import (
    FlakyRecorder,
    Kube,
    cp_body,
    gc_body,
    http_get,
    metric,
    running,
    service_config,
    settle,
    successful_reconciles,
)


def test_managers_of_field_names_the_other_writer() -> None:
    live: dict[str, Any] = {
        "metadata": {
            "managedFields": [
                {
                    "manager": "shared-svc",
                    "operation": "Apply",
                    "time": "2026-01-01T00:00:02Z",
                    "fieldsV1": {"f:spec": {"f:selector": {}}},
                },
                {
                    "manager": "gpu-operator",
                    "operation": "Update",
                    "time": "2026-01-01T00:00:03Z",
                    "fieldsV1": {"f:spec": {"f:selector": {}, "f:ports": {}}},
                },
                {
                    "manager": "kubectl",
                    "operation": "Update",
                    "time": "2026-01-01T00:00:04Z",
                    "fieldsV1": {"f:metadata": {"f:annotations": {"f:prometheus.io/scrape": {}}}},
                },
            ]
        }
    }
    assert managers_of_field(live, "spec.selector") == ["gpu-operator"]
    assert managers_of_field(live, 'metadata.annotations["prometheus.io/scrape"]') == ["kubectl"]
    assert managers_of_field(live, "spec.type") == []
    monitor: dict[str, Any] = {
        "metadata": {
            "managedFields": [
                {
                    "manager": "prometheus-config",
                    "operation": "Update",
                    "time": "2026-01-01T00:00:05Z",
                    "fieldsV1": {
                        "f:spec": {"f:endpoints": {'k:{"port":"gpu-metrics"}': {"f:interval": {}}}}
                    },
                },
            ]
        }
    }
    assert managers_of_field(monitor, "spec.endpoints[0].interval") == ["prometheus-config"]
    assert managers_of_field(monitor, "spec.endpoints[0].scrapeTimeout") == []


def test_a_write_meeting_changes_is_info_until_the_same_object_keeps_meeting_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    from kubernetes_asyncio.client.exceptions import ApiException

    from shared_svc.controllers.services.executor import ObjectChanged
    from shared_svc.controllers.services.outcomes import CHANGED_WARN_AFTER, Outcomes
    from shared_svc.kube.recorder import EventPublisher

    outcomes = Outcomes(Config(), events=EventPublisher(FlakyRecorder()), metrics=ServicesMetrics())
    caplog.set_level(logging.INFO, logger="shared_svc")
    conflict = ObjectChanged("Service", "nvidia-dcgm", ApiException(status=409, reason="Conflict"))
    for _ in range(CHANGED_WARN_AFTER):
        outcomes.changed(conflict)
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.INFO] * (CHANGED_WARN_AFTER - 1) + [logging.WARNING]
    assert caplog.records[0].getMessage() == (
        "Service/nvidia-dcgm changed meanwhile (409 Conflict): planning again from the cache"
    )


@pytest.mark.apiserver
async def test_each_conflict_is_one_warning_event_and_in_status(
    control_plane: ControlPlane, kube: Kube
) -> None:
    # The ClusterPolicy is older, so it wins; the GPUCluster loses both fields.
    await kube.create_cr(
        cp_body(dcgmExporter={"service": {"type": "NodePort", "internalTrafficPolicy": "Local"}})
    )
    await asyncio.sleep(1.1)  # creationTimestamp has second resolution
    await kube.create_cr(
        gc_body(
            dcgmExporter={
                "enabled": True,
                "service": {"type": "ClusterIP", "internalTrafficPolicy": "Cluster"},
            }
        )
    )
    config = service_config(control_plane, kube.ns, resync_seconds=0.3)
    async with running(config) as svc:
        await settle(svc)
        exporter = await kube.service("nvidia-dcgm-exporter")
        assert exporter is not None
        assert (
            exporter["spec"]["type"] == "NodePort"
            and exporter["spec"]["internalTrafficPolicy"] == "Local"
        )
        assert exporter["spec"]["ports"][0]["nodePort"], (
            "the API server assigned a nodePort; we keep it"
        )
        # Many reconciles later (resync every 0.3 s) there is still one Event per conflict.
        reconciles = successful_reconciles(svc)
        await asyncio.sleep(2.5)
        assert successful_reconciles(svc) >= reconciles + 5
        events = await kube.events_for("ServiceConfigConflict", namespace="default")
        fields = sorted(e["note"].split(":")[0] for e in events)
        assert len(events) == 2, [e["note"] for e in events]
        assert all(
            e["regarding"]["kind"] == "GPUCluster" and e["type"] == "Warning" for e in events
        )
        assert all(not e.get("series") for e in events), "not re-emitted on every reconcile"
        assert any(
            "spec.type" in e["note"] and "NodePort" in e["note"] and "ClusterIP" in e["note"]
            for e in events
        ), fields
        status, body = await http_get(svc.port or 0, "/status")
        assert status == 200
        conflicts = json.loads(body)["conflicts"]
        assert {c["field"] for c in conflicts if c["object"] == "Service/nvidia-dcgm-exporter"} == {
            "spec.type",
            "spec.internalTrafficPolicy",
        }
        assert all(c["winner"]["kind"] == "ClusterPolicy" for c in conflicts)
    await kube.events.delete_collection_namespaced_event("default")


@pytest.mark.apiserver
async def test_fighting_writer_is_reported_and_not_fought(
    control_plane: ControlPlane, kube: Kube
) -> None:
    await kube.create_cr(cp_body(dcgmExporter={"enabled": False}))
    config = service_config(
        control_plane,
        kube.ns,
        conflicting_writer_threshold=3,
        conflicting_writer_backoff_seconds=600,
    )
    async with running(config) as svc:
        await settle(svc)
        assert svc.writer is not None
        ours_before = sum(svc.writer.writes.values())
        fights = 0

        async def fight() -> None:
            # What gpu-operator's built-in step does: a whole-object Update of the selector.
            nonlocal fights
            while True:
                s = await kube.core.read_namespaced_service("nvidia-dcgm", kube.ns)
                if s.spec.selector != {"app": "legacy"}:
                    s.spec.selector = {"app": "legacy"}
                    try:
                        await kube.core.replace_namespaced_service(
                            "nvidia-dcgm", kube.ns, s, field_manager="gpu-operator"
                        )
                        fights += 1
                    except Exception:
                        pass
                await asyncio.sleep(0.1)

        fighter = asyncio.ensure_future(fight())
        try:
            await eventually(lambda: kube.events_for("ConflictingWriter"), timeout=30)
            ours_at_report = sum(svc.writer.writes.values()) - ours_before
            await asyncio.sleep(3)  # the fight goes on; we stay out of it
        finally:
            fighter.cancel()
            await asyncio.gather(fighter, return_exceptions=True)
        ours_total = sum(svc.writer.writes.values()) - ours_before
        assert ours_at_report <= config.conflicting_writer_threshold + 1, ours_at_report
        assert ours_total == ours_at_report, "no writes to a contested object during the backoff"
        assert fights >= 3
        events = await kube.events_for("ConflictingWriter")
        assert len(events) == 1
        assert "gpu-operator" in events[0]["note"] and "spec.selector" in events[0]["note"]
        contested = svc.status()["contested"]
        assert contested and contested[0]["managers"][0] == "gpu-operator"
        assert metric(svc, "shared_svc_conflicting_writer_total") == 1
