"""The admission guard on the real API server, next to shared-svc running, with writers
that play gpu-operator exactly as measured (tests/admission.py: whole-object PUTs with a
controller owner reference under field manager ``gpu-operator``, deletes by name under
its own ServiceAccount; the GPUCluster controller's create-then-PUT of its objects, its
ServiceMonitor ``nvidia-dcgm-exporter-dra`` included). Issue 9 items 1, 2 and 4; issue 28.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from shared_svc.reconcile.names import COMMON_LABEL as COMMON
from shared_svc.reconcile.names import COMPONENT_OF
from shared_svc.service import Service
from testenv import ControlPlane
from tests.admission import (
    STATE_LABEL,
    SimulatedGpuCluster,
    SimulatedOperator,
    Tls,
    guard_docs,
    guard_effective,
    install,
    make_tls,
    policy_sets,
    shape,
    uninstall,
    webhook_sets,
)
from tests.kube import eventually
from tests.svc import (
    Kube,
    cp_body,
    gc_body,
    running,
    service_config,
    service_monitor_gone,
    settle,
)

pytestmark = pytest.mark.apiserver

NAMES = ("nvidia-dcgm", "nvidia-dcgm-exporter")


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Tls:
    return make_tls(tmp_path_factory.mktemp("webhook-tls"))


def webhook_config(cp: ControlPlane, namespace: str, tls: Tls, port: int, **overrides: Any) -> Any:
    """shared-svc serving the webhook on ``port`` with the test certificate."""
    return service_config(
        cp,
        namespace,
        webhook_cert_file=tls.cert_file,
        webhook_key_file=tls.key_file,
        webhook_port=port,
        **overrides,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def operator(
    cp: ControlPlane, kube: Kube, tmp_path: Path, owner: dict[str, Any]
) -> AsyncIterator[SimulatedOperator]:
    writer = await SimulatedOperator.start(cp, tmp_path, kube.ns, owner)
    try:
        yield writer
    finally:
        await writer.close()


@contextlib.asynccontextmanager
async def gpu_cluster_controller(
    cp: ControlPlane, kube: Kube, tmp_path: Path
) -> AsyncIterator[SimulatedGpuCluster]:
    writer = await SimulatedGpuCluster.start(cp, tmp_path, kube.ns)
    try:
        yield writer
    finally:
        await writer.close()


@contextlib.asynccontextmanager
async def guard(cp: ControlPlane, docs: list[dict[str, Any]]) -> AsyncIterator[None]:
    install(cp, docs)
    try:
        yield
    finally:
        uninstall(cp, docs)


async def rolled_out(kube: Kube, svc: Service) -> None:
    """The labelled DCGM pods rolled out: shared-svc moves the stable names to the common
    labels (a selector gpu-operator's PUT would reset to ``app=<name>``)."""
    for app in NAMES:
        await kube.daemonset(app, common=True, desired=1)
        await kube.pod(f"{app}-a", app, common=True)
    await settle(svc)


def writes(svc: Service) -> int:
    assert svc.writer is not None
    return sum(svc.writer.writes.values())


async def conflicting_writers(kube: Kube) -> list[dict[str, Any]]:
    return await kube.events_for("ConflictingWriter")


async def neutralised(kube: Kube, svc: Service, writer: SimulatedOperator, mode: str) -> None:
    """gpu-operator's PUTs succeed and change nothing; shared-svc has nothing to do."""
    await rolled_out(kube, svc)
    await guard_effective(lambda: writer.put(NAMES[0], dry_run=True))
    before = {n: shape(await kube.service(n) or {}) for n in NAMES}
    ours = writes(svc)
    for _ in range(4):  # several reconciles' worth of PUTs
        for name in NAMES:
            answered = await writer.put(name)
            assert answered["metadata"]["resourceVersion"] == before[name]["resourceVersion"]
        await asyncio.sleep(0.3)
    await settle(svc)
    after = {n: shape(await kube.service(n) or {}) for n in NAMES}
    assert after == before, "the Services keep shared-svc's shape and resourceVersion"
    for name in NAMES:
        meta = after[name]
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "shared-svc"
        assert all(not r.get("controller") for r in meta["ownerReferences"])
        assert meta["spec"]["selector"] == {COMMON[COMPONENT_OF[name]]: "true"}, "gated selector"
        live = await kube.service(name)
        assert live is not None
        managers = {e["manager"] for e in live["metadata"].get("managedFields") or []}
        assert "gpu-operator" not in managers, "our fields stay ours"
    assert writes(svc) == ours, "shared-svc makes no write after gpu-operator's PUTs"
    assert await conflicting_writers(kube) == []
    await eventually(
        lambda: asyncio.sleep(0, svc.status()["admissionGuard"]["mode"] == mode), timeout=10
    )


async def test_policy_makes_operator_updates_change_nothing(
    control_plane: ControlPlane, kube: Kube, tmp_path: Path
) -> None:
    owner = await kube.create_cr(cp_body())
    async with (
        running(service_config(control_plane, kube.ns)) as svc,
        operator(control_plane, kube, tmp_path, owner) as writer,
        guard(control_plane, guard_docs(kube.ns, *policy_sets())),
    ):
        await neutralised(kube, svc, writer, "policy")
        assert svc.status()["admissionGuard"]["deleteGuard"] is False


async def test_webhook_makes_operator_updates_change_nothing(
    control_plane: ControlPlane, kube: Kube, tmp_path: Path, tls: Tls
) -> None:
    owner = await kube.create_cr(cp_body())
    port = free_port()
    config = webhook_config(control_plane, kube.ns, tls, port)
    async with (
        running(config) as svc,
        operator(control_plane, kube, tmp_path, owner) as writer,
        guard(control_plane, guard_docs(kube.ns, *webhook_sets(tls, port))),
    ):
        await neutralised(kube, svc, writer, "webhook")
        status = svc.status()["admissionGuard"]
        assert status["deleteGuard"] is True and status["webhookServing"] is True
        assert status["served"] is True, status["webhooks"]  # the URL answers: ours


async def test_operator_delete_of_a_needed_service_is_answered_404(
    control_plane: ControlPlane, kube: Kube, tmp_path: Path, tls: Tls
) -> None:
    # gpu-operator's ClusterPolicy with dcgm off deletes nvidia-dcgm by name on every
    # reconcile, while the GPUCluster needs it (the stable name).
    owner = await kube.create_cr(cp_body(dcgm={"enabled": False}))
    await kube.create_cr(gc_body())
    port = free_port()
    config = webhook_config(control_plane, kube.ns, tls, port)
    docs = guard_docs(kube.ns, *webhook_sets(tls, port, mutation="policy"))
    assert {d["kind"] for d in docs} == {
        "MutatingAdmissionPolicy",
        "MutatingAdmissionPolicyBinding",
        "ValidatingWebhookConfiguration",
    }
    async with (
        running(config) as svc,
        operator(control_plane, kube, tmp_path, owner) as writer,
        guard(control_plane, docs),
    ):
        await settle(svc)
        before = await kube.service("nvidia-dcgm")
        assert before is not None
        await eventually(lambda: _is(writer.delete("nvidia-dcgm", dry_run=True), 404), timeout=30)
        for _ in range(3):
            assert await writer.delete("nvidia-dcgm") == 404
        after = await kube.service("nvidia-dcgm")
        assert after is not None
        assert after["metadata"]["uid"] == before["metadata"]["uid"]
        assert after["spec"]["clusterIP"] == before["spec"]["clusterIP"]

        # Every other delete is allowed: a user's (dry run: it would go through) ...
        status = 200
        try:
            await kube.core.delete_namespaced_service("nvidia-dcgm", kube.ns, dry_run="All")
        except Exception as exc:  # pragma: no cover - the assertion below says what
            status = getattr(exc, "status", 0)
        assert status == 200
        # ... gpu-operator's of a name we do not guard ...
        base = f"/api/v1/namespaces/{kube.ns}"
        other = {"metadata": {"name": "other"}, "spec": {"ports": [{"port": 80}]}}
        assert control_plane.request("POST", f"{base}/services", other)[0] == 201
        assert await writer.delete("other") == 200
        # ... and gpu-operator's once no CR needs the Service any more. A foreign owner
        # keeps it after the GPUCluster lets go (shared-svc then removes only its refs).
        code, holder = control_plane.request(
            "POST", f"{base}/configmaps", {"metadata": {"name": "holder"}}
        )
        assert code == 201, holder
        ref = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "name": "holder",
            "uid": holder["metadata"]["uid"],
        }
        code, out = control_plane.request(
            "PATCH",
            f"{base}/services/nvidia-dcgm",
            [{"op": "add", "path": "/metadata/ownerReferences/-", "value": ref}],
            content_type="application/json-patch+json",
        )
        assert code == 200, out
        await kube.patch_cr("GPUCluster", "gpu-cluster", {"spec": {"dcgm": {"enabled": False}}})
        await settle(svc)
        await eventually(lambda: _needed_by_none(svc, "nvidia-dcgm"), timeout=15)
        assert await writer.delete("nvidia-dcgm") == 200
        assert await kube.service("nvidia-dcgm") is None


async def _is(call: Any, code: int) -> bool:
    return bool(await call == code)


async def _needed_by_none(svc: Service, name: str) -> bool:
    assert svc.controller is not None and svc.controller.last_plan is not None
    return not any(
        s.needed_by
        for s in svc.controller.last_plan.status
        if s.name == name and s.kind == "Service"
    )


async def test_webhook_down_lets_writes_through_and_shared_svc_repairs(
    control_plane: ControlPlane, kube: Kube, tmp_path: Path, tls: Tls
) -> None:
    owner = await kube.create_cr(cp_body())
    port = free_port()
    config = webhook_config(control_plane, kube.ns, tls, port)
    async with (
        operator(control_plane, kube, tmp_path, owner) as writer,
        guard(control_plane, guard_docs(kube.ns, *webhook_sets(tls, port))),
    ):
        async with running(config) as svc:
            await rolled_out(kube, svc)
            await guard_effective(lambda: writer.put("nvidia-dcgm", dry_run=True))
            kept = {n: shape(await kube.service(n) or {}) for n in NAMES}
        # shared-svc (and its webhook) is down: failurePolicy Ignore lets the PUTs through.
        for name in NAMES:
            out = await writer.put(name)
            assert out["metadata"]["labels"] == {"app": name}
            assert out["metadata"]["ownerReferences"][0]["controller"] is True
        async with running(config) as svc:
            await settle(svc)
            for name in NAMES:
                live = shape(await kube.service(name) or {})
                assert live["labels"] == kept[name]["labels"]
                assert live["ownerReferences"] == kept[name]["ownerReferences"]
                assert live["spec"]["selector"] == kept[name]["spec"]["selector"]
                assert live["uid"] == kept[name]["uid"]
            # and the guard holds again
            await guard_effective(lambda: writer.put("nvidia-dcgm", dry_run=True))


async def test_without_a_guard_the_fight_is_reported_once_per_service_naming_gpu_operator(
    control_plane: ControlPlane, kube: Kube, tmp_path: Path
) -> None:
    owner = await kube.create_cr(cp_body())
    config = service_config(
        control_plane,
        kube.ns,
        conflicting_writer_threshold=3,
        conflicting_writer_backoff_seconds=600,
    )
    async with (
        running(config) as svc,
        operator(control_plane, kube, tmp_path, owner) as writer,
    ):
        await settle(svc)

        async def fight() -> None:  # gpu-operator while an operand is not ready
            while True:
                for name in NAMES:
                    with contextlib.suppress(Exception):
                        await writer.put(name)
                await asyncio.sleep(0.2)

        fighter = asyncio.ensure_future(fight())
        try:

            async def reported() -> list[dict[str, Any]]:
                events = await conflicting_writers(kube)
                return events if len(events) >= len(NAMES) else []

            events = await eventually(reported, timeout=60)
            missing = await eventually(lambda: kube.events_for("AdmissionGuardMissing"), timeout=15)
            await asyncio.sleep(2)  # the fight goes on: no second report
            events = await conflicting_writers(kube)
        finally:
            fighter.cancel()
            await asyncio.gather(fighter, return_exceptions=True)
        by_object = sorted(e["regarding"]["name"] for e in events)
        assert by_object == sorted(NAMES), by_object
        for event in events:
            assert "gpu-operator / Update" in event["note"], event["note"]
        assert len(missing) == 1 and missing[0]["type"] == "Warning"
        assert "gpu-operator" in missing[0]["note"]
        status = svc.status()
        assert status["admissionGuard"]["mode"] == "none"
        assert {c["object"] for c in status["contested"]} == {f"Service/{n}" for n in NAMES}


async def test_policy_guards_the_gpucluster_stack_and_the_service_monitor(
    control_plane: ControlPlane, kube: Kube, tmp_path: Path
) -> None:
    """GPUCluster's PUTs carry the state label its clean-up deletes by: the guard keeps it
    off. ClusterPolicy's ServiceMonitor PUT changes nothing either."""
    monitor = {"enabled": True, "serviceMonitor": {"enabled": True, "interval": "30s"}}
    gc = await kube.create_cr(gc_body(dcgmExporter=monitor))
    cp = await kube.create_cr(cp_body(dcgmExporter=monitor))
    async with (
        running(service_config(control_plane, kube.ns)) as svc,
        operator(control_plane, kube, tmp_path, gc) as gc_writer,
        gpu_cluster_controller(control_plane, kube, tmp_path) as gpu_cluster,
        guard(control_plane, guard_docs(kube.ns, *policy_sets())),
    ):
        cp_writer = SimulatedOperator(gc_writer.api, kube.ns, cp)
        await settle(svc)
        await guard_effective(lambda: gpu_cluster.put("Service", "nvidia-dcgm-dra", dry_run=True))
        dra = ("nvidia-dcgm-dra", "nvidia-dcgm-exporter-dra")
        before = {n: shape(await kube.service(n) or {}) for n in dra}
        sm_before = await kube.service_monitor("nvidia-dcgm-exporter")
        assert sm_before is not None
        ours = writes(svc)
        for name in dra:
            answered = await gpu_cluster.put("Service", name)
            assert STATE_LABEL not in answered["metadata"]["labels"]
        sm = await cp_writer.put_monitor()
        assert sm["metadata"]["resourceVersion"] == sm_before["metadata"]["resourceVersion"]
        assert sm["metadata"]["labels"] == sm_before["metadata"]["labels"]
        assert sm["spec"] == sm_before["spec"]
        await settle(svc)
        assert {n: shape(await kube.service(n) or {}) for n in dra} == before
        assert writes(svc) == ours
        assert await conflicting_writers(kube) == []


# --- the GPUCluster's own ServiceMonitor (issue 28) ---------------------------------------

DRA_MONITOR = "nvidia-dcgm-exporter-dra"
MONITORED_GC = {
    "enabled": True,
    "serviceMonitor": {"enabled": True, "interval": "2s", "additionalLabels": {"release": "p"}},
}


async def gpu_cluster_monitor_puts_change_nothing(
    kube: Kube, svc: Service, gpu_cluster: SimulatedGpuCluster, gc: dict[str, Any], mode: str
) -> None:
    """Its reconciles (create, 409, GET, whole PUT) are accepted and change nothing of the
    adopted ServiceMonitor: same resourceVersion, no state label, no controller reference,
    shared-svc's selector; shared-svc writes nothing."""
    await settle(svc)
    await guard_effective(lambda: gpu_cluster.put("ServiceMonitor", DRA_MONITOR, dry_run=True))
    live = await kube.service_monitor(DRA_MONITOR)
    assert live is not None
    before = shape(live)
    labels = before["labels"]
    assert labels["app.kubernetes.io/managed-by"] == "shared-svc" and labels["release"] == "p"
    assert STATE_LABEL not in labels
    assert [(r["kind"], r["uid"], r["controller"]) for r in before["ownerReferences"]] == [
        ("GPUCluster", gc["metadata"]["uid"], False)
    ]
    assert before["spec"]["selector"] == {
        "matchLabels": {
            "app.kubernetes.io/managed-by": "shared-svc",
            "shared-svc.nvidia.com/service-monitor": DRA_MONITOR,
        }
    }
    # What it PUTs: its controller reference, the state label, its selector.
    [sent] = [o for o in gpu_cluster.render(gc, monitors=True) if o["kind"] == "ServiceMonitor"]
    assert sent["metadata"]["ownerReferences"][0]["controller"] is True
    assert sent["metadata"]["labels"][STATE_LABEL] == "state-dcgm-exporter"
    assert sent["spec"]["selector"] == {"matchLabels": {"app": DRA_MONITOR}}
    ours = writes(svc)
    for _ in range(3):  # several reconciles' worth
        answered = await gpu_cluster.reconcile()
        sm = answered[f"ServiceMonitor/{DRA_MONITOR}"]
        assert sm["metadata"]["resourceVersion"] == before["resourceVersion"]
        await asyncio.sleep(0.3)
    await settle(svc)
    after = await kube.service_monitor(DRA_MONITOR)
    assert after is not None and shape(after) == before
    managers = {e["manager"] for e in after["metadata"].get("managedFields") or []}
    assert "gpu-operator" not in managers, "our fields stay ours"
    assert writes(svc) == ours, "shared-svc makes no write after its PUTs"
    assert await conflicting_writers(kube) == []
    await eventually(
        lambda: asyncio.sleep(0, svc.status()["admissionGuard"]["mode"] == mode), timeout=10
    )


async def test_policy_makes_the_gpu_cluster_monitor_put_change_nothing(
    control_plane: ControlPlane, kube: Kube, tmp_path: Path
) -> None:
    gc = await kube.create_cr(gc_body(dcgmExporter=MONITORED_GC))
    async with (
        gpu_cluster_controller(control_plane, kube, tmp_path) as gpu_cluster,
        guard(control_plane, guard_docs(kube.ns, *policy_sets())),
    ):
        # The GPUCluster controller is first: its ServiceMonitor exists as it writes it.
        created = await gpu_cluster.reconcile()
        assert STATE_LABEL in created[f"ServiceMonitor/{DRA_MONITOR}"]["metadata"]["labels"]
        async with running(service_config(control_plane, kube.ns)) as svc:
            await gpu_cluster_monitor_puts_change_nothing(kube, svc, gpu_cluster, gc, "policy")
        adopted = await kube.events_for("ServiceMonitorAdopted")
        assert {e["regarding"]["name"] for e in adopted} >= {DRA_MONITOR}


async def test_webhook_makes_the_gpu_cluster_monitor_put_change_nothing_and_its_delete_404(
    control_plane: ControlPlane, kube: Kube, tmp_path: Path, tls: Tls
) -> None:
    gc = await kube.create_cr(gc_body(dcgmExporter=MONITORED_GC))
    port = free_port()
    config = webhook_config(control_plane, kube.ns, tls, port)
    async with (
        running(config) as svc,
        gpu_cluster_controller(control_plane, kube, tmp_path) as gpu_cluster,
        guard(control_plane, guard_docs(kube.ns, *webhook_sets(tls, port))),
    ):
        # shared-svc is first: it creates the ServiceMonitor; the controller's create is a 409.
        await gpu_cluster_monitor_puts_change_nothing(kube, svc, gpu_cluster, gc, "webhook")
        live = await kube.service_monitor(DRA_MONITOR)
        assert live is not None
        # Its deletes while the GPUCluster needs it: by name, 404; its label sweep finds
        # nothing (no state label on what shared-svc keeps); a delete of a collection that
        # takes it in is judged per object (no request.name, the old object's name): 404,
        # which the API server's collection delete counts as gone (it skips NotFound), so
        # the request succeeds and the ServiceMonitor stays.
        assert await gpu_cluster.delete("ServiceMonitor", DRA_MONITOR) == 404
        assert await gpu_cluster.sweep("state-dcgm-exporter") == {}
        code = 200
        try:
            await gpu_cluster.custom.delete_collection_namespaced_custom_object(
                "monitoring.coreos.com",
                "v1",
                kube.ns,
                "servicemonitors",
                label_selector=f"app={DRA_MONITOR}",
            )
        except ApiException as exc:
            code = exc.status
        assert code == 200
        kept = await kube.service_monitor(DRA_MONITOR)
        assert kept is not None and kept["metadata"]["uid"] == live["metadata"]["uid"]
        # Once the GPUCluster stops monitoring, shared-svc deletes it (no CR needs it).
        await kube.patch_cr(
            "GPUCluster",
            "gpu-cluster",
            {"spec": {"dcgmExporter": {"serviceMonitor": {"enabled": False}}}},
        )
        await settle(svc)
        # drained first: two of its 2 s scrape intervals, then deleted
        await service_monitor_gone(kube, DRA_MONITOR)
        assert await kube.service_monitor("nvidia-dcgm-exporter") is None


async def test_a_configured_webhook_url_that_reaches_no_server_is_said_in_status_and_a_warning(
    control_plane: ControlPlane, kube: Kube, tls: Tls
) -> None:
    """``admission.webhook.url`` set, nothing serving it, ``failurePolicy: Ignore``: the
    API server lets every write through without an error; shared-svc says so (issue 19
    item 5)."""
    await kube.create_cr(cp_body())
    port = free_port()  # nothing listens there
    async with (
        running(service_config(control_plane, kube.ns, discovery_seconds=0.5)) as svc,
        guard(control_plane, guard_docs(kube.ns, *webhook_sets(tls, port))),
    ):

        async def not_served() -> bool:
            await asyncio.sleep(0)
            return svc.status()["admissionGuard"]["served"] is False

        await eventually(not_served, timeout=30)
        status = svc.status()["admissionGuard"]
        assert status["deleteGuard"] is True, "configured ..."
        unserved = [w for w in status["webhooks"] if w["served"] is False]
        assert {w["url"] for w in unserved} >= {f"https://127.0.0.1:{port}/validate-delete"}
        assert all(w["error"] for w in unserved)

        async def warned_of_both() -> list[dict[str, Any]] | None:
            # One Warning per webhook, sent one after the other: wait for the delete guard's.
            events = await kube.events_for("AdmissionGuardNotServed", namespace="default")
            ours = [e for e in events if f"127.0.0.1:{port}" in e["note"]]
            kinds = {e["regarding"]["kind"] for e in ours}
            return ours if "ValidatingWebhookConfiguration" in kinds else None

        ours = await eventually(warned_of_both, timeout=15)
        assert all(e["type"] == "Warning" for e in ours)
        await asyncio.sleep(1.5)  # more checks: one Warning per webhook, not one per check
        again = await kube.events_for("AdmissionGuardNotServed", namespace="default")
        assert [e for e in again if f"127.0.0.1:{port}" in e["note"]] == ours
