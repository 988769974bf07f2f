"""Rules of the Services controller's shell that need no API server, and one that does."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import pytest

from shared_svc.config import Config
from shared_svc.controller import ServicesController
from shared_svc.k8s.events import ObjectRef, Report
from shared_svc.k8s.managed_fields import managers_of_field
from shared_svc.metrics import Metrics
from shared_svc.reconcile.model import Plan
from testenv import ControlPlane
from tests.svc import Kube, running, service_config


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


def warning(key: str) -> Report:
    ref = ObjectRef(api_version="v1", kind="Service", name="nvidia-dcgm", namespace="ns")
    return Report(
        type="Warning",
        reason="SelectorMigrationPending",
        action="Reconcile",
        regarding=ref,
        note="n",
        key=key,
    )


async def test_an_event_that_could_not_be_written_is_retried_next_reconcile() -> None:
    recorder = FlakyRecorder()
    ctrl = ServicesController(
        None,  # type: ignore[arg-type]  # no API access in this test
        Config(),
        recorder=recorder,  # type: ignore[arg-type]
        writer=None,  # type: ignore[arg-type]
        metrics=Metrics(),
        is_leader=lambda: True,
    )
    plan = Plan(reports=(warning("a"),))
    await ctrl._emit_occurrences(plan)  # fails
    await ctrl._emit_occurrences(plan)  # retried, written
    await ctrl._emit_occurrences(plan)  # still active: not repeated
    assert recorder.calls == ["a", "a"]
    await ctrl._emit_occurrences(Plan())  # the occurrence goes away...
    await ctrl._emit_occurrences(plan)  # ...and comes back: emitted again (a series bump)
    assert recorder.calls == ["a", "a", "a"]


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


@pytest.mark.apiserver
async def test_a_crashed_controller_exits_non_zero_after_releasing_the_lease(
    control_plane: ControlPlane, kube: Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shared_svc.service import ControllerCrashed

    async def crash(self: ServicesController, stop: asyncio.Event) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(ServicesController, "run", crash)
    config = service_config(control_plane, kube.ns, leader_election=True, pod_name="crashy")
    with pytest.raises(ControllerCrashed, match="boom"):
        async with running(config) as svc:
            await asyncio.sleep(1.0)
            assert svc.elector is not None


@pytest.mark.apiserver
def test_run_exits_1_with_one_line_when_a_controller_crashes(control_plane: ControlPlane) -> None:
    code = (
        "import asyncio, sys\n"
        "from shared_svc.controller import ServicesController\n"
        "async def crash(self, stop): raise RuntimeError('boom')\n"
        "ServicesController.run = crash\n"
        "from shared_svc.cli import main\n"
        f"sys.exit(main(['run', '--kubeconfig', {str(control_plane.kubeconfig)!r}, '--port', '0',"
        " '--leader-election', 'false', '--namespace', 'crash']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert (
        proc.stderr.strip().splitlines()[-1]
        == "shared-svc: a controller ended unexpectedly: RuntimeError('boom')"
    )


class RecordingRecorder:
    def __init__(self) -> None:
        self.reasons: list[str] = []

    async def emit(self, report: Report) -> bool:
        self.reasons.append(f"{report.reason}/{report.regarding.name}")
        return True


class FailSecondWriter:
    """Applies succeed once, then fail (a 409 from a concurrent change, say)."""

    def __init__(self) -> None:
        self.applied: list[str] = []

    async def apply(self, obj: dict[str, Any]) -> None:
        if self.applied:
            raise RuntimeError("409 Conflict")
        self.applied.append(obj["metadata"]["name"])


async def test_a_write_is_announced_even_when_a_later_write_fails() -> None:
    from shared_svc.reconcile.model import Action

    def create(name: str) -> Action:
        body = {"kind": "Service", "metadata": {"name": name}}
        return Action(
            action="create",
            kind="Service",
            name=name,
            reason="ServiceCreated",
            apply=body,
            announces=(created(name),),
        )

    def created(name: str) -> Report:
        ref = ObjectRef(api_version="v1", kind="Service", name=name, namespace="ns")
        return Report(
            type="Normal",
            reason="ServiceCreated",
            action="Create",
            regarding=ref,
            note="n",
            key=f"c/{name}",
            after_write=("Service", name),
        )

    recorder = RecordingRecorder()
    ctrl = ServicesController(
        None,  # type: ignore[arg-type]
        Config(),
        recorder=recorder,  # type: ignore[arg-type]
        writer=FailSecondWriter(),  # type: ignore[arg-type]
        metrics=Metrics(),
        is_leader=lambda: True,
    )
    plan = Plan(actions=(create("a"), create("b")), reports=(created("a"), created("b")))
    with pytest.raises(RuntimeError, match="409"):
        await ctrl._execute(plan)
    assert recorder.reasons == ["ServiceCreated/a"]


def test_pending_gauge_drops_to_zero_when_a_reason_goes_away() -> None:
    from shared_svc.reconcile.model import Pending

    metrics = Metrics()
    ctrl = ServicesController(
        None,  # type: ignore[arg-type]
        Config(),
        recorder=None,  # type: ignore[arg-type]
        writer=None,  # type: ignore[arg-type]
        metrics=metrics,
        is_leader=lambda: True,
    )
    pending = Pending(object="Service/nvidia-dcgm", reason="SelectorMigrationPending", message="m")
    ctrl._record_plan_metrics(Plan(pending=(pending, pending)))
    sample = metrics.registry.get_sample_value
    assert sample("shared_svc_pending", {"reason": "SelectorMigrationPending"}) == 2
    ctrl._record_plan_metrics(Plan())
    assert sample("shared_svc_pending", {"reason": "SelectorMigrationPending"}) == 0


class SyncedCache:
    """Stands in for an informer whose cache is synced (all the loop asks of it)."""

    def __init__(self) -> None:
        self.synced = asyncio.Event()
        self.synced.set()


class LoopProbe:
    """The Services controller's loop (the runtime's queue and worker), with its reconciles
    and its coalescing waits (delayed adds of the one key) logged in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, coalesce_seconds: float) -> None:
        self.log: list[str] = []
        self.ctrl = ServicesController(
            None,  # type: ignore[arg-type]
            Config(coalesce_seconds=coalesce_seconds, resync_seconds=3600),
            recorder=None,  # type: ignore[arg-type]
            writer=None,  # type: ignore[arg-type]
            metrics=Metrics(),
            is_leader=lambda: True,
        )
        self.ctrl._informers = {"pods": SyncedCache()}  # type: ignore[dict-item]
        queue = self.ctrl._runtime.queue
        add_after = queue.add_after

        def delayed(key: str, delay: float) -> None:
            if delay > 0:
                self.log.append("sleep")  # a wait before the next reconcile
            add_after(key, delay)

        async def reconcile_once() -> bool:
            self.log.append("reconcile")
            await asyncio.sleep(0)  # changes may arrive while it runs
            return True

        monkeypatch.setattr(queue, "add_after", delayed)
        monkeypatch.setattr(self.ctrl, "reconcile_once", reconcile_once)
        self.stop = asyncio.Event()
        self.task = asyncio.ensure_future(self.ctrl._runtime.run(self.stop))

    def change(self) -> None:
        self.log.append("change")
        self.ctrl.trigger()

    async def idle(self, seconds: float) -> None:
        await asyncio.wait([self.task], timeout=seconds)
        assert not self.task.done()

    async def until(self, reconciles: int) -> None:
        for _ in range(500):
            if self.log.count("reconcile") >= reconciles:
                return
            await self.idle(0.01)
        raise AssertionError(f"{reconciles} reconcile(s) expected: {self.log}")

    async def close(self) -> None:
        self.stop.set()
        await self.task


async def test_a_lone_change_is_reconciled_without_a_coalescing_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A spacing of an hour: any coalescing wait before the first reconcile would hold it back.
    probe = LoopProbe(monkeypatch, coalesce_seconds=3600)
    await probe.idle(0.05)
    probe.change()
    await probe.until(1)
    assert probe.log == ["change", "reconcile"]
    await probe.close()


async def test_a_change_after_the_spacing_is_reconciled_without_a_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    probe = LoopProbe(monkeypatch, coalesce_seconds=0.05)
    probe.change()
    await probe.until(1)
    await probe.idle(0.2)  # idle for longer than the spacing
    probe.log.clear()
    probe.change()
    await probe.until(1)
    assert probe.log == ["change", "reconcile"]
    await probe.close()


async def test_a_burst_of_changes_becomes_few_reconciles(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = LoopProbe(monkeypatch, coalesce_seconds=0.05)
    await probe.idle(0.05)
    for _ in range(50):
        probe.change()
        await asyncio.sleep(0)  # the loop runs between two changes
    await probe.until(2)
    await probe.idle(0.2)  # whatever was still pending has run
    first = probe.log.index("reconcile")
    assert "sleep" not in probe.log[:first], probe.log  # the first one without a wait
    assert "sleep" in probe.log, probe.log  # the rest of the burst was gathered
    assert 2 <= probe.log.count("reconcile") <= 3, probe.log
    last_change = len(probe.log) - 1 - probe.log[::-1].index("change")
    assert "reconcile" in probe.log[last_change:], probe.log  # the last change is served
    await probe.close()


def test_a_write_meeting_changes_is_info_until_the_same_object_keeps_meeting_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    from kubernetes_asyncio.client.exceptions import ApiException

    from shared_svc.executor import ObjectChanged
    from shared_svc.kube.events import EventPublisher
    from shared_svc.outcomes import CHANGED_WARN_AFTER, Outcomes

    outcomes = Outcomes(Config(), events=EventPublisher(FlakyRecorder()), metrics=Metrics())
    caplog.set_level(logging.INFO, logger="shared_svc")
    conflict = ObjectChanged("Service", "nvidia-dcgm", ApiException(status=409, reason="Conflict"))
    for _ in range(CHANGED_WARN_AFTER):
        outcomes.changed(conflict)
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.INFO] * (CHANGED_WARN_AFTER - 1) + [logging.WARNING]
    assert caplog.records[0].getMessage() == (
        "Service/nvidia-dcgm changed meanwhile (409 Conflict): planning again from the cache"
    )


class HeldCache:
    """A cache that holds some objects (what a snapshot reads of it)."""

    def __init__(self, objects: list[dict[str, Any]]) -> None:
        self.objects = tuple(objects)

    def items(self) -> tuple[dict[str, Any], ...]:
        return self.objects


def test_run_and_plan_build_one_world_from_the_same_objects(tmp_path: Any) -> None:
    import json

    from shared_svc.commands.plan import load_world

    ns = "gpu-operator"

    def obj(kind: str, name: str, namespaced: bool = True) -> dict[str, Any]:
        meta = {"name": name, "namespace": ns} if namespaced else {"name": name}
        return {"apiVersion": "v1", "kind": kind, "metadata": meta}

    by_plural = {
        "clusterpolicies": [obj("ClusterPolicy", "cluster-policy", namespaced=False)],
        "gpuclusters": [obj("GPUCluster", "gpu-cluster", namespaced=False)],
        "daemonsets": [obj("DaemonSet", "nvidia-dcgm-exporter")],
        "pods": [{**obj("Pod", "p"), "spec": {"nodeName": "n"}, "status": {"conditions": []}}],
        "services": [obj("Service", "nvidia-dcgm"), obj("Service", "other")],
        "servicemonitors": [obj("ServiceMonitor", "nvidia-dcgm-exporter")],
    }
    ctrl = ServicesController(
        None,  # type: ignore[arg-type]
        Config(namespace=ns),
        recorder=None,  # type: ignore[arg-type]
        writer=None,  # type: ignore[arg-type]
        metrics=Metrics(),
        is_leader=lambda: True,
    )
    ctrl._informers = {  # type: ignore[assignment]
        plural: HeldCache(objects)
        for plural, objects in by_plural.items()
        if plural != "servicemonitors"
    }
    ctrl.discovery.served = True
    ctrl.discovery.informer = HeldCache(by_plural["servicemonitors"])  # type: ignore[assignment]
    path = tmp_path / "all.json"
    items = [o for objects in by_plural.values() for o in objects]
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
    world = ctrl.snapshot()
    assert world == load_world([str(path)], ns)
    assert [o["metadata"]["name"] for o in world.services] == ["nvidia-dcgm", "other"]
    assert len(world.service_monitors) == 1


def test_a_contested_object_shows_its_seconds_left_and_not_its_monotonic_deadline() -> None:
    from shared_svc.reconcile.fight import Contest
    from shared_svc.status import contest_status

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
