"""The Services controller end to end on the real API server: the seed's acceptance
criteria and the upgrade transitions (issue 4)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from shared_svc.reconcile.monitoring import selects
from shared_svc.service import Service
from testenv import ControlPlane
from tests.admission import SimulatedGpuCluster
from tests.svc import COMMON, Kube, cp_body, gc_body, running, service_config, settle

pytestmark = pytest.mark.apiserver

SCRAPE = "prometheus.io/scrape"


@pytest.fixture
async def svc(control_plane: ControlPlane, kube: Kube) -> AsyncIterator[Service]:
    async with running(service_config(control_plane, kube.ns)) as service:
        yield service


def refs(obj: dict[str, Any]) -> list[tuple[str, str, bool]]:
    return [
        (r["kind"], r["uid"], bool(r.get("controller")))
        for r in obj["metadata"].get("ownerReferences") or []
    ]


async def test_cluster_policy_exposes_only_the_legacy_names(kube: Kube, svc: Service) -> None:
    cp = await kube.create_cr(cp_body())
    await settle(svc)
    services = await kube.services()
    assert set(services) == {"nvidia-dcgm", "nvidia-dcgm-exporter"}, (
        "the legacy stack never exposes -dra names"
    )
    dcgm, exporter = services["nvidia-dcgm"], services["nvidia-dcgm-exporter"]
    assert dcgm["spec"]["internalTrafficPolicy"] == "Local"
    assert dcgm["spec"]["type"] == "ClusterIP"
    assert dcgm["spec"]["selector"] == {"app": "nvidia-dcgm"}
    assert dcgm["spec"]["ports"][0]["port"] == 5555 and dcgm["spec"]["clusterIP"]
    assert exporter["spec"]["selector"] == {"app": "nvidia-dcgm-exporter"}
    assert exporter["metadata"]["annotations"][SCRAPE] == "true"
    assert exporter["metadata"]["labels"]["app"] == "nvidia-dcgm-exporter"
    for s in services.values():
        assert refs(s) == [("ClusterPolicy", cp["metadata"]["uid"], False)]
        assert s["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "shared-svc"
        assert "nvidia.com/gpu-operator.state" not in s["metadata"]["labels"]
    created = await kube.events_for("ServiceCreated")
    assert {e["regarding"]["name"] for e in created} == {"nvidia-dcgm", "nvidia-dcgm-exporter"}


async def test_gpu_cluster_exposes_both_names_and_moves_to_common_labels_after_rollout(
    kube: Kube, svc: Service
) -> None:
    gc = await kube.create_cr(gc_body())
    await settle(svc)
    services = await kube.services()
    assert set(services) == {
        "nvidia-dcgm",
        "nvidia-dcgm-dra",
        "nvidia-dcgm-exporter",
        "nvidia-dcgm-exporter-dra",
    }
    for name in ("nvidia-dcgm", "nvidia-dcgm-dra"):
        assert services[name]["spec"]["internalTrafficPolicy"] == "Local", name
    # No labelled pods yet: the aliases start on the DRA app labels.
    assert services["nvidia-dcgm"]["spec"]["selector"] == {"app": "nvidia-dcgm-dra"}
    assert services["nvidia-dcgm-exporter"]["spec"]["selector"] == {
        "app": "nvidia-dcgm-exporter-dra"
    }
    assert services["nvidia-dcgm-exporter-dra"]["spec"]["selector"] == {
        "app": "nvidia-dcgm-exporter-dra"
    }
    # Both exporter Services select the same pods: only the canonical one is scraped.
    assert services["nvidia-dcgm-exporter"]["metadata"]["annotations"][SCRAPE] == "true"
    assert services["nvidia-dcgm-exporter-dra"]["metadata"]["annotations"][SCRAPE] == "false"
    for s in services.values():
        assert refs(s) == [("GPUCluster", gc["metadata"]["uid"], False)]
    ips = {n: s["spec"]["clusterIP"] for n, s in services.items()}

    for app in ("nvidia-dcgm-dra", "nvidia-dcgm-exporter-dra"):
        await kube.daemonset(app, common=True, desired=2)
        await kube.pod(f"{app}-a", app, common=True)
        await kube.pod(f"{app}-b", app, common=True)
    await settle(svc)
    services = await kube.services()
    assert services["nvidia-dcgm"]["spec"]["selector"] == {COMMON["dcgm"]: "true"}
    assert services["nvidia-dcgm-exporter"]["spec"]["selector"] == {COMMON["exporter"]: "true"}
    assert services["nvidia-dcgm-dra"]["spec"]["selector"] == {"app": "nvidia-dcgm-dra"}, (
        "-dra names keep the DRA label"
    )
    assert {n: s["spec"]["clusterIP"] for n, s in services.items()} == ips
    migrated = await kube.events_for("SelectorMigrated")
    assert {e["regarding"]["name"] for e in migrated} == {"nvidia-dcgm", "nvidia-dcgm-exporter"}


async def test_selectors_follow_the_rollout_gate(kube: Kube, svc: Service) -> None:
    """Old pods with the new service, a half-done rollout, OnDelete stragglers, all new, then a rollback."""
    await kube.create_cr(cp_body(dcgmExporter={"enabled": False}))
    app = "nvidia-dcgm"
    old = {"app": app}
    new = {COMMON["dcgm"]: "true"}

    async def selector() -> dict[str, str]:
        await settle(svc)
        s = await kube.service(app)
        assert s is not None
        sel: dict[str, str] = s["spec"]["selector"]
        return sel

    # Old pods, DaemonSet without the common label: stays on app.
    await kube.daemonset(app, common=False, desired=2)
    await kube.pod("p1", app, common=False)
    await kube.pod("p2", app, common=False)
    assert await selector() == old
    # Template updated, rollout half done.
    await kube.daemonset(app, common=True, desired=2, updated=1, available=2)
    await kube.pod("p1", app, common=True)
    assert await selector() == old
    # OnDelete: status complete, but one old pod remains.
    await kube.daemonset(app, common=True, desired=2, on_delete=True)
    assert await selector() == old
    pending = svc.status()["objects"]
    gates = next(o for o in pending if o["name"] == app)["gates"]
    assert (
        gates
        and not gates[0]["open"]
        and any("p2" in f or "common label" in f for f in gates[0]["failing"])
    ), gates
    # The straggler is replaced: every pod labelled.
    await kube.delete_pod("p2")
    await kube.pod("p3", app, common=True)
    assert await selector() == new
    # Operator rollback: the template loses the label and a pod comes back without it.
    await kube.daemonset(app, common=False, desired=2)
    await kube.pod("p4", app, common=False)
    assert await selector() == old


async def test_adopts_services_created_by_gpu_operator_keeping_cluster_ip(
    control_plane: ControlPlane, kube: Kube, svc: Service, tmp_path: Path
) -> None:
    # Created off, so gpu-operator's Services exist before shared-svc needs them (it serves
    # a change at once: with the stacks on, it could create them first). They are what the
    # GPUCluster controller writes for the CR turned on (tests/admission.py).
    off = {"enabled": False}
    gc = await kube.create_cr(gc_body(dcgm=off, dcgmExporter=off))
    on = {"enabled": True}
    turned_on = {**gc, "spec": {**gc["spec"], "dcgm": on, "dcgmExporter": on}}
    writer = await SimulatedGpuCluster.start(control_plane, tmp_path, kube.ns)
    before = {}
    try:
        for obj in writer.render(turned_on, monitors=True):
            created = await writer.write(obj)
            assert created["metadata"]["labels"]["nvidia.com/gpu-operator.state"]
            before[obj["metadata"]["name"]] = (
                created["metadata"]["uid"],
                created["spec"]["clusterIP"],
            )
    finally:
        await writer.close()
    assert set(before) == {"nvidia-dcgm-dra", "nvidia-dcgm-exporter-dra"}
    await kube.patch_cr("GPUCluster", "gpu-cluster", {"spec": {"dcgm": on, "dcgmExporter": on}})
    await settle(svc)
    for name, (uid, ip) in before.items():
        s = await kube.service(name)
        assert s is not None
        assert (s["metadata"]["uid"], s["spec"]["clusterIP"]) == (uid, ip), (
            "adopted, not re-created"
        )
        assert refs(s) == [("GPUCluster", gc["metadata"]["uid"], False)]
        assert "nvidia.com/gpu-operator.state" not in s["metadata"]["labels"]
        assert s["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "shared-svc"
    adopted = await kube.events_for("ServiceAdopted")
    assert {e["regarding"]["name"] for e in adopted} == set(before)


async def test_unmanaged_service_with_foreign_owner_is_not_adopted(
    kube: Kube, svc: Service
) -> None:
    # The foreign Service exists before the CR: the controller reconciles a new CR at once
    # and would otherwise create nvidia-dcgm itself first.
    keeper = await kube.core.create_namespaced_config_map(kube.ns, {"metadata": {"name": "keeper"}})
    body = {
        "metadata": {
            "name": "nvidia-dcgm",
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "name": "keeper",
                    "uid": keeper.metadata.uid,
                }
            ],
        },
        "spec": {"selector": {"app": "someone-else"}, "ports": [{"port": 1234}]},
    }
    await kube.core.create_namespaced_service(kube.ns, body)
    await kube.create_cr(cp_body(dcgmExporter={"enabled": False}))
    await settle(svc)
    s = await kube.service("nvidia-dcgm")
    assert s is not None and s["spec"]["selector"] == {"app": "someone-else"}, "left untouched"
    assert any(p["reason"] == "ServiceNotAdopted" for p in svc.status()["pending"])
    assert await kube.events_for("ServiceNotAdopted")


async def test_migration_between_stacks_keeps_stable_services_and_cluster_ips(
    kube: Kube, svc: Service
) -> None:
    deleted: list[str] = []
    seen_rv = {"rv": ""}

    async def watch_deletes() -> None:
        from kubernetes_asyncio import watch

        w = watch.Watch()
        async for ev in w.stream(kube.core.list_namespaced_service, kube.ns, timeout_seconds=120):
            seen_rv["rv"] = ev["object"].metadata.resource_version
            if ev["type"] == "DELETED":
                deleted.append(ev["object"].metadata.name)

    watcher = asyncio.ensure_future(watch_deletes())
    try:
        cp = await kube.create_cr(cp_body())
        await settle(svc)
        start = await kube.services()
        ips = {n: (s["metadata"]["uid"], s["spec"]["clusterIP"]) for n, s in start.items()}

        # Migration: the GPUCluster arrives, then the ClusterPolicy leaves.
        gc = await kube.create_cr(gc_body())
        await settle(svc)
        both = await kube.services()
        assert refs(both["nvidia-dcgm"]) == sorted(
            [
                ("ClusterPolicy", cp["metadata"]["uid"], False),
                ("GPUCluster", gc["metadata"]["uid"], False),
            ]
        )
        assert both["nvidia-dcgm"]["spec"]["selector"] == {"app": "nvidia-dcgm"}, (
            "legacy pods keep their name"
        )
        # Both stacks running, gate closed: the -dra exporter is scraped too, so no exporter goes unscraped.
        assert both["nvidia-dcgm-exporter-dra"]["metadata"]["annotations"][SCRAPE] == "true"
        assert any(p["reason"] == "SelectorMigrationPending" for p in svc.status()["pending"])

        await kube.delete_cr("ClusterPolicy", "cluster-policy")
        await settle(svc)
        after = await kube.services()
        for name in ("nvidia-dcgm", "nvidia-dcgm-exporter"):
            assert (after[name]["metadata"]["uid"], after[name]["spec"]["clusterIP"]) == ips[name]
            assert refs(after[name]) == [("GPUCluster", gc["metadata"]["uid"], False)]
        assert after["nvidia-dcgm"]["spec"]["selector"] == {"app": "nvidia-dcgm-dra"}
        assert after["nvidia-dcgm-exporter-dra"]["metadata"]["annotations"][SCRAPE] == "false"

        # And back: a ClusterPolicy arrives, the GPUCluster leaves; the -dra names go away.
        cp2 = await kube.create_cr(cp_body())
        await settle(svc)
        await kube.delete_cr("GPUCluster", "gpu-cluster")
        await settle(svc)
        back = await kube.services()
        assert set(back) == {"nvidia-dcgm", "nvidia-dcgm-exporter"}
        for name in ("nvidia-dcgm", "nvidia-dcgm-exporter"):
            assert (back[name]["metadata"]["uid"], back[name]["spec"]["clusterIP"]) == ips[name]
            assert refs(back[name]) == [("ClusterPolicy", cp2["metadata"]["uid"], False)]
        assert back["nvidia-dcgm"]["spec"]["selector"] == {"app": "nvidia-dcgm"}
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    assert "nvidia-dcgm" not in deleted and "nvidia-dcgm-exporter" not in deleted
    assert sorted(deleted) == ["nvidia-dcgm-dra", "nvidia-dcgm-exporter-dra"]
    assert len(await kube.events_for("ServiceDeleted")) == 2


async def test_recreated_cr_with_new_uid_replaces_the_reference(kube: Kube, svc: Service) -> None:
    gc = await kube.create_cr(gc_body())
    old = await kube.create_cr(cp_body())
    await settle(svc)
    await kube.delete_cr("ClusterPolicy", "cluster-policy")
    new = await kube.create_cr(cp_body())
    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    await settle(svc)
    s = await kube.service("nvidia-dcgm")
    assert s is not None
    assert refs(s) == sorted(
        [
            ("ClusterPolicy", new["metadata"]["uid"], False),
            ("GPUCluster", gc["metadata"]["uid"], False),
        ]
    )


async def test_deleted_cr_releases_and_deletes_but_foreign_owner_keeps(
    kube: Kube, svc: Service
) -> None:
    await kube.create_cr(cp_body())
    await settle(svc)
    keeper = await kube.core.create_namespaced_config_map(kube.ns, {"metadata": {"name": "keeper"}})
    foreign = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "keeper",
        "uid": keeper.metadata.uid,
    }
    exporter = await kube.service("nvidia-dcgm-exporter")
    assert exporter is not None
    await kube.core.patch_namespaced_service(
        "nvidia-dcgm-exporter",
        kube.ns,
        [{"op": "add", "path": "/metadata/ownerReferences/-", "value": foreign}],
        _content_type="application/json-patch+json",
    )
    await settle(svc)
    await kube.delete_cr("ClusterPolicy", "cluster-policy")
    await settle(svc)
    assert await kube.service("nvidia-dcgm") is None, (
        "no CR needs it and no foreign owner: deleted by the service"
    )
    kept = await kube.service("nvidia-dcgm-exporter")
    assert kept is not None, "a foreign owner still holds it"
    assert [(r["kind"], r["name"]) for r in kept["metadata"]["ownerReferences"]] == [
        ("ConfigMap", "keeper")
    ]
    assert [e["regarding"]["name"] for e in await kube.events_for("ServiceDeleted")] == [
        "nvidia-dcgm"
    ]


async def test_service_monitor_selects_only_the_canonical_service(kube: Kube, svc: Service) -> None:
    monitor = {"enabled": True, "interval": "15s", "additionalLabels": {"release": "prom"}}
    await kube.create_cr(gc_body(dcgmExporter={"enabled": True, "serviceMonitor": monitor}))
    await settle(svc)
    sm = await kube.service_monitor("nvidia-dcgm-exporter")
    assert sm is not None
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["jobLabel"] == "app"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [kube.ns]}
    # It selects exactly the canonical Service (the alias is "false": the canonical Service
    # covers the DRA pods), and the GPUCluster's own ServiceMonitor selects nothing.
    dra = await kube.service_monitor("nvidia-dcgm-exporter-dra")
    assert dra is not None
    services = await kube.services()
    for monitor, selected in ((sm, ["nvidia-dcgm-exporter"]), (dra, [])):
        assert [
            n
            for n, o in sorted(services.items())
            if selects(monitor, o["metadata"]["labels"], kube.ns)
        ] == selected
    assert (
        sm["spec"]["endpoints"][0]["port"] == "gpu-metrics"
        and sm["spec"]["endpoints"][0]["interval"] == "15s"
    )

    # Someone else's ServiceMonitor scraping the same Service is reported, not fought.
    other = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": "my-dcgm", "namespace": kube.ns},
        "spec": {
            "selector": {"matchLabels": {"app": "nvidia-dcgm-exporter"}},
            "endpoints": [{"port": "gpu-metrics"}],
        },
    }
    await kube.custom.create_namespaced_custom_object(
        "monitoring.coreos.com", "v1", kube.ns, "servicemonitors", other
    )
    await settle(svc)
    assert any(
        p["reason"] == "DuplicateScrapeTarget" and "my-dcgm" in p["object"]
        for p in svc.status()["pending"]
    )
    dup = await kube.events_for("DuplicateScrapeTarget")
    assert [e["regarding"]["name"] for e in dup] == ["my-dcgm"]
    assert await kube.service_monitor("my-dcgm") is not None


async def test_invalid_spec_keeps_ownership_and_reports(kube: Kube, svc: Service) -> None:
    gc = await kube.create_cr(gc_body())
    await settle(svc)
    # The CRD accepts any string here; only shared-svc (and the Service API) can judge it.
    await kube.patch_cr(
        "GPUCluster", "gpu-cluster", {"spec": {"dcgmExporter": {"service": {"type": "Bogus"}}}}
    )
    await settle(svc)
    errors = svc.status()["errors"]
    assert [(e["kind"], e["reason"]) for e in errors] == [("GPUCluster", "InvalidSpec")]
    s = await kube.service("nvidia-dcgm-exporter-dra")
    assert s is not None and refs(s) == [("GPUCluster", gc["metadata"]["uid"], False)]
    assert s["spec"]["type"] == "ClusterIP"
    ev = await kube.events_for("InvalidSpec", namespace="default")
    assert any(e["regarding"]["kind"] == "GPUCluster" for e in ev)
