"""Adoption takes over the fields the previous owner set on our behalf (issue 10, item 1).

Pure: the managedFields transfer as a function of the live object, and the planner putting
it into the guarded adoption patch. The property (nothing lost, nothing invented) is in
proptests/test_takeover_props.py; the real API server part in
tests/test_adoption_takeover_apiserver.py.
"""

from __future__ import annotations

import copy
from typing import Any

from shared_svc.kube.writer import FIELD_MANAGER as WRITER_FIELD_MANAGER
from shared_svc.reconcile.model import Settings
from shared_svc.reconcile.planner import plan
from shared_svc.reconcile.takeover import FIELD_MANAGER, managed_paths, take_over
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
