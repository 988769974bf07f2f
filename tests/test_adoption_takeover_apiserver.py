"""Adoption on the real API server (issue 10, items 1 and 5).

1. An adopted object releases what the CR no longer sets, as one shared-svc created does:
   the adoption takes over the fields gpu-operator's Update manager set on our behalf.
5. Repeated adoptions of the same object (a fight) are one Event with a series.
"""

from __future__ import annotations

from typing import Any

import pytest

from testenv import ControlPlane
from tests.kube import eventually
from tests.svc import Kube, apiserver_write_count, cp_body, running, service_config, settle

pytestmark = pytest.mark.apiserver

EXPORTER = "nvidia-dcgm-exporter"
MANAGED_BY = "app.kubernetes.io/managed-by"


def _owner(cr: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "nvidia.com/v1",
        "kind": "ClusterPolicy",
        "name": cr["metadata"]["name"],
        "uid": cr["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


async def _gpu_operator_objects(kube: Kube, cr: dict[str, Any]) -> None:
    """The exporter Service and ServiceMonitor as gpu-operator creates them (Update manager)."""
    await kube.core.create_namespaced_service(
        kube.ns,
        {
            "metadata": {
                "name": EXPORTER,
                "labels": {"app": EXPORTER},
                "annotations": {"prometheus.io/scrape": "true"},
                "ownerReferences": [_owner(cr)],
            },
            "spec": {
                "type": "NodePort",
                "internalTrafficPolicy": "Local",
                "selector": {"app": EXPORTER},
                "ports": [{"name": "gpu-metrics", "port": 9400, "targetPort": 9400}],
            },
        },
        field_manager="gpu-operator",
    )
    await kube.custom.create_namespaced_custom_object(
        "monitoring.coreos.com",
        "v1",
        kube.ns,
        "servicemonitors",
        {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "ServiceMonitor",
            "metadata": {
                "name": EXPORTER,
                "labels": {"app": EXPORTER, "release": "prom"},
                "ownerReferences": [_owner(cr)],
            },
            "spec": {
                "jobLabel": "app",
                "namespaceSelector": {"matchNames": [kube.ns]},
                "selector": {"matchLabels": {"app": EXPORTER}},
                "endpoints": [{"port": "gpu-metrics", "path": "/metrics"}],
            },
        },
        field_manager="gpu-operator",
    )


def _fields_of(obj: dict[str, Any], manager: str) -> dict[str, Any]:
    for entry in obj["metadata"].get("managedFields") or []:
        if entry["manager"] == manager and entry["operation"] == "Update":
            fields: dict[str, Any] = entry.get("fieldsV1") or {}
            return fields
    return {}


async def test_adopted_objects_release_what_the_cr_no_longer_sets(
    control_plane: ControlPlane, kube: Kube
) -> None:
    cr = await kube.create_cr(
        cp_body(
            dcgmExporter={
                "service": {"type": "NodePort", "internalTrafficPolicy": "Local"},
                "serviceMonitor": {"enabled": True, "additionalLabels": {"release": "prom"}},
            }
        )
    )
    await _gpu_operator_objects(kube, cr)
    before = await kube.service(EXPORTER)
    assert before is not None
    async with running(service_config(control_plane, kube.ns)) as svc:
        await settle(svc)
        adopted = await kube.service(EXPORTER)
        monitor = await kube.service_monitor(EXPORTER)
        assert adopted is not None and monitor is not None
        assert adopted["metadata"]["uid"] == before["metadata"]["uid"]
        assert adopted["metadata"]["labels"][MANAGED_BY] == "shared-svc"
        assert (adopted["spec"]["type"], adopted["spec"]["internalTrafficPolicy"]) == (
            "NodePort",
            "Local",
        )
        # gpu-operator's entry keeps only what we do not manage.
        foreign = _fields_of(adopted, "gpu-operator").get("f:spec", {})
        assert not {"f:type", "f:internalTrafficPolicy", "f:ports", "f:selector"} & set(foreign)
        assert "f:sessionAffinity" in foreign, "the rest stays with its manager"
        assert "f:release" not in _fields_of(monitor, "gpu-operator").get("f:metadata", {}).get(
            "f:labels", {}
        )

        # Steady state after the adoption: reconciles write nothing.
        writes = apiserver_write_count(control_plane, ("services", "servicemonitors"))
        for _ in range(3):
            await settle(svc)
        assert apiserver_write_count(control_plane, ("services", "servicemonitors")) == writes

        # The CR no longer sets them: API defaults for the Service, no release label.
        await kube.patch_cr(
            "ClusterPolicy",
            "cluster-policy",
            {
                "spec": {
                    "dcgmExporter": {"service": None, "serviceMonitor": {"additionalLabels": None}}
                }
            },
        )
        await settle(svc)
        after = await kube.service(EXPORTER)
        monitor = await kube.service_monitor(EXPORTER)
        assert after is not None and monitor is not None
        assert after["metadata"]["uid"] == before["metadata"]["uid"]
        assert (after["spec"]["type"], after["spec"]["internalTrafficPolicy"]) == (
            "ClusterIP",
            "Cluster",
        )
        assert all(p.get("nodePort") is None for p in after["spec"]["ports"])
        assert "release" not in monitor["metadata"]["labels"]
        assert monitor["metadata"]["labels"][MANAGED_BY] == "shared-svc"


async def test_repeated_adoptions_are_one_event_with_a_series(
    control_plane: ControlPlane, kube: Kube
) -> None:
    cr = await kube.create_cr(cp_body(dcgmExporter={"serviceMonitor": {"enabled": False}}))
    await _gpu_operator_objects(kube, cr)
    config = service_config(control_plane, kube.ns, conflicting_writer_threshold=10)
    async with running(config) as svc:
        await settle(svc)
        adoptions = 1
        for _ in range(2):
            # gpu-operator's whole-object Update takes the Service back, and we adopt it again.
            s = await kube.core.read_namespaced_service(EXPORTER, kube.ns)
            del s.metadata.labels[MANAGED_BY]
            s.metadata.owner_references = [_owner(cr)]
            await kube.core.replace_namespaced_service(
                EXPORTER, kube.ns, s, field_manager="gpu-operator"
            )
            await eventually(lambda: _managed(kube), timeout=30)
            adoptions += 1
        await settle(svc)
        events = [
            e for e in await kube.events_for("ServiceAdopted") if e["regarding"]["name"] == EXPORTER
        ]
        assert len(events) == 1, [e["metadata"]["name"] for e in events]
        assert (events[0].get("series") or {}).get("count") == adoptions


async def _managed(kube: Kube) -> bool:
    s = await kube.service(EXPORTER)
    return s is not None and s["metadata"]["labels"].get(MANAGED_BY) == "shared-svc"
