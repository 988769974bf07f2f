"""What the Services controller reports: the pending gauge, a contested object's seconds
left in /status, and dry-run computing and reporting while writing nothing."""

from __future__ import annotations

import pytest

from shared_svc.controllers.services.metrics import ServicesMetrics
from shared_svc.reconcile.model import Plan
from testenv import ControlPlane
from tests.kube import eventually
from tests.parts import outcomes
from tests.svc import Kube, apiserver_write_count, cp_body, running, service_config


def test_pending_gauge_drops_to_zero_when_a_reason_goes_away() -> None:
    from shared_svc.reconcile.model import Pending

    metrics = ServicesMetrics()
    said = outcomes(metrics=metrics)
    pending = Pending(object="Service/nvidia-dcgm", reason="SelectorMigrationPending", message="m")
    said.record_plan_metrics(Plan(pending=(pending, pending)))
    sample = metrics.registry.get_sample_value
    assert sample("shared_svc_pending", {"reason": "SelectorMigrationPending"}) == 2
    said.record_plan_metrics(Plan())
    assert sample("shared_svc_pending", {"reason": "SelectorMigrationPending"}) == 0


def test_a_contested_object_shows_its_seconds_left_and_not_its_monotonic_deadline() -> None:
    from shared_svc.controllers.services.status import contest_status
    from shared_svc.reconcile.fight import Contest

    contest = Contest(
        "Service/nvidia-dcgm",
        "spec.selector",
        ("gpu-operator",),
        ("gpu-operator / Update",),
        until=1_000.0,
        since="2026-12-01T10:00:00+00:00",
    )
    assert contest_status(contest, 700.4) == {
        "object": "Service/nvidia-dcgm",
        "field": "spec.selector",
        "managers": ["gpu-operator"],
        "writers": ["gpu-operator / Update"],
        "since": "2026-12-01T10:00:00+00:00",
        "secondsLeft": 300,
    }
    assert contest_status(contest, 2_000.0)["secondsLeft"] == 0


async def _true(value: bool) -> bool:
    return value


@pytest.mark.apiserver
async def test_dry_run_computes_and_reports_but_writes_nothing(
    control_plane: ControlPlane, kube: Kube
) -> None:
    await kube.create_cr(cp_body())
    before = apiserver_write_count(control_plane)
    async with running(service_config(control_plane, kube.ns, dry_run=True)) as svc:
        await eventually(
            lambda: _true(svc.status()["lastReconcile"].get("result") == "dry-run"), timeout=30
        )
        status = svc.status()
        assert {o["name"]: o["lastAction"]["action"] for o in status["objects"]} == {
            "nvidia-dcgm": "create",
            "nvidia-dcgm-exporter": "create",
        }
    assert await kube.services() == {}
    assert apiserver_write_count(control_plane) == before, (
        "no Service, ServiceMonitor or Event written"
    )
