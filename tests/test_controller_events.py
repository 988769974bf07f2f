"""The one Event publisher (issue 19 item 3, issue 21): a repeat of a known Event is one
write on the real API server; dedup by key and scope; one meaning of dry-run."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from shared_svc.k8s.events import ObjectRef, Report
from shared_svc.kube.recorder import EventPublisher, EventRecorder, event_name
from shared_svc.reconcile.model import Plan
from testenv import ControlPlane
from tests.parts import executor, outcomes
from tests.svc import FlakyRecorder, Kube, apiserver_write_count


def report(namespace: str, key: str = "k", reason: str = "SelectorMigrationPending") -> Report:
    ref = ObjectRef(api_version="v1", kind="Service", name="nvidia-dcgm", namespace=namespace)
    return Report(
        type="Warning", reason=reason, action="Reconcile", regarding=ref, note="n", key=key
    )


async def series_count(kube: Kube, r: Report) -> int | None:
    event = await client.EventsV1Api(kube.api).read_namespaced_event(event_name(r), kube.ns)
    return event.series.count if event.series else None


@pytest.mark.apiserver
async def test_a_repeat_of_a_known_event_is_one_write(
    control_plane: ControlPlane, api: ApiClient, kube: Kube
) -> None:
    recorder = EventRecorder(api, reporting_instance="test")
    r = report(kube.ns)
    assert await recorder.emit(r)
    for repeat in (2, 3):
        before = apiserver_write_count(control_plane, ("events",))
        assert await recorder.emit(r)
        assert apiserver_write_count(control_plane, ("events",)) - before == 1, (
            "the known series is patched, no POST answered 409 first"
        )
        assert await series_count(kube, r) == repeat
    assert recorder.requests == {"POST": 1, "PATCH": 2}


@pytest.mark.apiserver
async def test_a_repeat_of_an_event_gone_from_the_api_creates_it_again(
    api: ApiClient, kube: Kube
) -> None:
    recorder = EventRecorder(api, reporting_instance="test")
    r = report(kube.ns)
    assert await recorder.emit(r)
    await client.EventsV1Api(api).delete_namespaced_event(event_name(r), kube.ns)
    assert await recorder.emit(r), "the PATCH answered 404: created again"
    assert await series_count(kube, r) is None
    assert recorder.failures == 0


@pytest.mark.apiserver
async def test_an_event_a_previous_run_wrote_gets_its_series_bumped(
    api: ApiClient, kube: Kube
) -> None:
    r = report(kube.ns)
    assert await EventRecorder(api, reporting_instance="before").emit(r)
    again = EventRecorder(api, reporting_instance="after")  # a restart: nothing known
    assert await again.emit(r)
    assert await series_count(kube, r) == 2


class Recording:
    def __init__(self, failing: set[str] | None = None) -> None:
        self.keys: list[str] = []
        self.failing = failing or set()

    async def emit(self, r: Report) -> bool:
        self.keys.append(r.key)
        return r.key not in self.failing


async def test_a_level_scope_sends_each_report_once_while_it_lasts_and_again_when_it_returns() -> (
    None
):
    recorder = Recording(failing={"b"})
    counted: list[str] = []
    events = EventPublisher(recorder, on_written=lambda r: counted.append(r.key))
    a, b = report("ns", "a"), report("ns", "b")
    assert await events.level("s", [a, b]) == {"a"}
    assert await events.level("s", [a, b]) == {"a"}  # b failed: retried; a not repeated
    assert await events.level("other", [a]) == {"a"}  # scopes are apart
    await events.level("s", [])  # gone ...
    await events.level("s", [a])  # ... and back: sent again
    assert recorder.keys == ["a", "b", "b", "a", "a"]
    assert counted == ["a", "a", "a"], "only written Events are counted"


async def test_once_sends_a_key_once_per_scope() -> None:
    recorder = Recording()
    events = EventPublisher(recorder)
    for _ in range(3):
        assert await events.once("s", report("ns", "a"))
    assert recorder.keys == ["a"]


async def test_dry_run_writes_no_event_and_logs_each_once(caplog: pytest.LogCaptureFixture) -> None:
    recorder = Recording()
    events = EventPublisher(recorder, dry_run=True)
    caplog.set_level(logging.INFO)
    for _ in range(3):
        await events.level("s", [report("ns", "a")])
    assert recorder.keys == []
    assert [r.getMessage() for r in caplog.records].count("dry-run: would emit event") == 1


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
    said = outcomes(recorder=recorder)
    plan = Plan(reports=(warning("a"),))
    await said.occurrences(plan)  # fails
    await said.occurrences(plan)  # retried, written
    await said.occurrences(plan)  # still active: not repeated
    assert recorder.calls == ["a", "a"]
    await said.occurrences(Plan())  # the occurrence goes away...
    await said.occurrences(plan)  # ...and comes back: emitted again (a series bump)
    assert recorder.calls == ["a", "a", "a"]


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
    writes = executor(writer=FailSecondWriter(), recorder=recorder)
    plan = Plan(actions=(create("a"), create("b")), reports=(created("a"), created("b")))
    with pytest.raises(RuntimeError, match="409"):
        await writes.execute(plan)
    assert recorder.reasons == ["ServiceCreated/a"]


def test_an_event_cannot_regard_an_object_without_a_name() -> None:
    """The API server would keep it and drop the empty name: an Event about nothing a user
    can find (a real-node run met one in ``default``, another party's)."""
    with pytest.raises(ValueError, match="a named object"):
        ObjectRef(api_version="v1", kind="Node", name="")
    assert ObjectRef(api_version="v1", kind="Node", name="n").as_event_ref()["name"] == "n"
