"""Adoption takes over the fields the previous owner set on our behalf (issue 10, item 1).

Pure: the managedFields transfer as a function of the live object, and the planner putting
it into the guarded adoption patch. The property (nothing lost, nothing invented) is in
proptests/test_takeover_props.py. On the real API server (issue 10, items 1 and 5): an
adopted object releases what the CR no longer sets, as one shared-svc created does, and
repeated adoptions of the same object (a fight) are one Event with a series.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from shared_svc.kube.writer import FIELD_MANAGER as WRITER_FIELD_MANAGER
from shared_svc.reconcile.model import Settings
from shared_svc.reconcile.planner import plan
from shared_svc.reconcile.takeover import FIELD_MANAGER, managed_paths, take_over
from testenv import ControlPlane
from tests.kube import eventually
from tests.svc import Kube, apiserver_write_count, cp_body, running, service_config, settle
from tests.worlds import (
    action_of,
    apply_plan,
    cluster_policy,
    gpu_operator_service,
    world,
)

CP = cluster_policy()
PORT_KEY = 'k:{"port":9400,"protocol":"TCP"}'
OWNER_KEY = 'k:{"uid":"uid-cp"}'


def gpu_operator_fields() -> dict[str, Any]:
    """What an Update (create) by gpu-operator records on a NodePort/Local exporter Service."""
    return {
        "f:metadata": {
            "f:annotations": {".": {}, "f:prometheus.io/scrape": {}},
            "f:labels": {".": {}, "f:app": {}},
            "f:ownerReferences": {
                ".": {},
                OWNER_KEY: {"f:controller": {}, "f:uid": {}, "f:kind": {}},
            },
        },
        "f:spec": {
            "f:internalTrafficPolicy": {},
            "f:ports": {
                ".": {},
                PORT_KEY: {".": {}, "f:name": {}, "f:port": {}, "f:targetPort": {}},
            },
            "f:selector": {},
            "f:sessionAffinity": {},
            "f:type": {},
        },
    }


def entry(manager: str, operation: str, fields: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {
        "manager": manager,
        "operation": operation,
        "apiVersion": "v1",
        "time": "2026-11-30T10:00:00Z",
        "fieldsType": "FieldsV1",
        "fieldsV1": fields,
        **more,
    }


def adopted_service() -> dict[str, Any]:
    live = gpu_operator_service("nvidia-dcgm-exporter", CP)
    live["metadata"]["managedFields"] = [entry("gpu-operator", "Update", gpu_operator_fields())]
    return live


SERVICE_PATHS = managed_paths("Service", ["app", "app.kubernetes.io/managed-by"], [])


def test_the_field_manager_is_the_writers() -> None:
    assert FIELD_MANAGER == WRITER_FIELD_MANAGER


def test_our_paths_move_from_the_previous_owner_into_our_apply_entry() -> None:
    new = take_over(adopted_service(), SERVICE_PATHS)
    assert new is not None
    foreign, ours = new
    assert foreign["manager"] == "gpu-operator" and foreign["time"] == "2026-11-30T10:00:00Z"
    # What we do not manage stays with gpu-operator; emptied parents are pruned, not left as
    # an empty set (which would mean "owns the whole field").
    assert foreign["fieldsV1"] == {
        "f:metadata": {"f:annotations": {".": {}}, "f:labels": {".": {}}},
        "f:spec": {"f:sessionAffinity": {}},
    }
    assert (ours["manager"], ours["operation"], ours["apiVersion"]) == ("shared-svc", "Apply", "v1")
    spec = ours["fieldsV1"]["f:spec"]
    assert set(spec) == {"f:type", "f:internalTrafficPolicy", "f:ports", "f:selector"}
    assert spec["f:ports"][PORT_KEY]["f:port"] == {}
    assert ours["fieldsV1"]["f:metadata"]["f:labels"] == {"f:app": {}}
    assert ours["fieldsV1"]["f:metadata"]["f:annotations"] == {"f:prometheus.io/scrape": {}}
    assert OWNER_KEY in ours["fieldsV1"]["f:metadata"]["f:ownerReferences"]


def test_merges_into_an_existing_apply_entry_and_keeps_subresources() -> None:
    live = adopted_service()
    status = entry("gpu-operator", "Update", {"f:status": {"f:loadBalancer": {}}})
    status["subresource"] = "status"
    mine = entry(FIELD_MANAGER, "Apply", {"f:spec": {"f:ports": {"k:x": {"f:port": {}}}}})
    live["metadata"]["managedFields"] += [status, mine]
    new = take_over(live, SERVICE_PATHS)
    assert new is not None and len(new) == 3
    assert new[1] == status
    assert set(new[2]["fieldsV1"]["f:spec"]["f:ports"]) == {"k:x", ".", PORT_KEY}


def test_nothing_to_take_is_no_change() -> None:
    live = adopted_service()
    live["metadata"]["managedFields"] = [
        entry("gpu-operator", "Update", {"f:spec": {"f:sessionAffinity": {}}})
    ]
    assert take_over(live, SERVICE_PATHS) is None
    assert take_over(gpu_operator_service("nvidia-dcgm", CP), SERVICE_PATHS) is None
    odd = adopted_service()
    odd["metadata"]["managedFields"] = [None, entry("x", "Update", "not a tree"), 3]  # type: ignore[arg-type]
    assert take_over(odd, SERVICE_PATHS) is None


def test_service_monitor_takes_every_label_and_the_whole_spec() -> None:
    paths = managed_paths("ServiceMonitor", ["app"], [])
    live = {
        "apiVersion": "monitoring.coreos.com/v1",
        "metadata": {
            "managedFields": [
                entry(
                    "gpu-operator",
                    "Update",
                    {
                        "f:metadata": {"f:labels": {".": {}, "f:release": {}, "f:app": {}}},
                        "f:spec": {"f:endpoints": {}, "f:selector": {}},
                    },
                    apiVersion="monitoring.coreos.com/v1",
                )
            ]
        },
    }
    new = take_over(live, paths)
    assert new is not None and len(new) == 1, "an entry left empty is dropped"
    assert new[0]["manager"] == FIELD_MANAGER and new[0]["apiVersion"] == "monitoring.coreos.com/v1"
    assert "f:release" in new[0]["fieldsV1"]["f:metadata"]["f:labels"]


def test_the_adoption_patch_carries_the_transfer_and_adoption_still_settles() -> None:
    live = adopted_service()
    result = plan(world(CP, live), Settings())
    action = action_of(result, "Service", "nvidia-dcgm-exporter")
    assert action.reason == "ServiceAdopted" and action.json_patch
    assert action.json_patch[0]["op"] == "test" and action.json_patch[0]["path"] == "/metadata/uid"
    ops = [op for op in action.json_patch if op["path"] == "/metadata/managedFields"]
    assert len(ops) == 1 and ops[0]["value"] == take_over(
        live,
        managed_paths(
            "Service",
            action.apply["metadata"]["labels"] if action.apply else {},
            action.apply["metadata"]["annotations"] if action.apply else {},
        ),
    )
    after = apply_plan(world(CP, live), result)
    assert plan(after, Settings()).writes == ()


def test_a_managed_object_is_never_taken_over_again() -> None:
    """Only adoption rewrites managedFields: steady state stays write-free."""
    live = adopted_service()
    settled_world = apply_plan(world(CP, live), plan(world(CP, live), Settings()))
    svc = next(s for s in settled_world.services if s["metadata"]["name"] == "nvidia-dcgm-exporter")
    svc = copy.deepcopy(svc)
    svc["metadata"]["managedFields"].append(entry("kubectl", "Update", gpu_operator_fields()))
    result = plan(world(CP, svc, *[s for s in settled_world.services if s is not svc]), Settings())
    action = action_of(result, "Service", "nvidia-dcgm-exporter")
    assert action.action == "unchanged"


def test_odd_trees_are_left_alone_not_lost_and_never_raise() -> None:
    live = adopted_service()
    odd = {"f:metadata": "x", "f:spec": {"f:type": 5, "f:ports": [1], "f:selector": {}}}
    live["metadata"]["managedFields"] = [entry("gpu-operator", "Update", odd)]
    new = take_over(live, SERVICE_PATHS)
    assert new is not None
    assert new[0]["fieldsV1"] == {"f:metadata": "x", "f:spec": {"f:type": 5, "f:ports": [1]}}
    assert new[1]["fieldsV1"] == {"f:spec": {"f:selector": {}}}


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


@pytest.mark.apiserver
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


@pytest.mark.apiserver
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
