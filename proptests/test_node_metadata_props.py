"""A metadata-only node cache does not change a single plan (issue 12).

The upgrade controller's node caches keep each Node as ``Resource.kept`` makes it for a
``metadata_only`` resource: ``{apiVersion, kind, metadata}`` less ``managedFields``
(``kube.resources.metadata_view``), which is what the API server's
``PartialObjectMetadata`` carries. Over any sequence of upgrade states, pods, DaemonSets
and settings, ``plan_node`` on that view gives the very plan it gives on the whole Node
as the API server serves it (spec, a kubelet's status, managedFields, odd values in
fields nobody reads), patches, evictions, reports and status alike.
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from proptests.strategies import json_values, set_at
from proptests.test_upgrade_props import Traits, apply, build_pod, step, traits, with_state
from shared_svc.controllers.upgrade.caches import node_resources
from shared_svc.kube.store import SharedValues
from shared_svc.upgrade.planner import plan_node
from shared_svc.upgrade.record import record_annotation_key
from shared_svc.upgrade.settings import UpgradeSettings
from testenv import upgrade_examples as ex

STATE_NODES, PARKED_NODES = node_resources("gpu")
RECORD = record_annotation_key("gpu")

# Fields of a whole Node that no planner reads, and what an odd node may carry there.
UNREAD = (
    ("spec",),
    ("spec", "taints"),
    ("spec", "unschedulable"),
    ("status",),
    ("status", "conditions"),
    ("status", "images"),
    ("metadata", "managedFields"),
)


def kubelet_status(images: int, ready: bool) -> dict[str, Any]:
    return {
        "capacity": {"cpu": "64", "memory": "1056721182Ki", "nvidia.com/gpu": "8"},
        "allocatable": {"cpu": "63", "memory": "1056618782Ki", "nvidia.com/gpu": "8"},
        "conditions": [
            {
                "type": "Ready",
                "status": "True" if ready else "False",
                "reason": "KubeletReady" if ready else "KubeletNotReady",
                "lastHeartbeatTime": "2026-01-01T00:00:00Z",
            }
        ],
        "nodeInfo": {"kubeletVersion": "v1.36.3", "containerRuntimeVersion": "containerd://1.7"},
        "images": [
            {"names": [f"nvcr.io/nvidia/image-{i}:1"], "sizeBytes": 1_000_000 + i}
            for i in range(images)
        ],
    }


@st.composite
def whole(draw: st.DrawFn, node: dict[str, Any]) -> dict[str, Any]:
    """``node`` as the API server serves it: a spec, a kubelet's status, managedFields,
    maybe cordoned or tainted, maybe an odd value in a field nobody reads."""
    out = copy.deepcopy(node)
    out["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z"
    out["metadata"]["managedFields"] = [
        {
            "manager": manager,
            "operation": "Update",
            "apiVersion": "v1",
            "fieldsType": "FieldsV1",
            "fieldsV1": {"f:status": {"f:conditions": {}}} if manager == "kubelet" else {},
        }
        for manager in ("kubelet", "shared-svc-upgrade")
    ]
    out["spec"] = {"podCIDR": "10.244.1.0/24", "providerID": "test://node-1"}
    if draw(st.booleans()):
        out["spec"]["unschedulable"] = True  # cordoned by the operator's upgrade flow
        out["spec"]["taints"] = [
            {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
        ]
    out["status"] = kubelet_status(draw(st.integers(0, 5)), draw(st.booleans()))
    if draw(st.booleans()):
        set_at(out, draw(st.sampled_from(UNREAD)), draw(json_values))
    return out


def cached(node: dict[str, Any]) -> dict[str, Any]:
    """What the node caches keep of ``node`` (both resources keep it the same way), and
    shared as a projected cache shares its objects (``SharedValues``: sharing changes no
    plan either). The whole node is not changed."""
    view = SharedValues()(STATE_NODES.kept(copy.deepcopy(node)))
    assert view == PARKED_NODES.kept(copy.deepcopy(node))
    return view


record_values = st.none() | st.text(max_size=8) | st.just('{"v": 1}')


@given(
    pod_traits=st.lists(traits, max_size=5),
    steps=st.lists(step, min_size=1, max_size=8),
    detection=st.sampled_from(["off", "report", "evict"]),
    delete_after_timeout=st.booleans(),
    parked_before=st.booleans(),
    record_before=record_values,
    declared_daemonset=st.none() | st.booleans(),
    data=st.data(),
)
def test_a_plan_over_the_metadata_view_is_the_plan_over_the_whole_node(
    pod_traits: list[Traits],
    steps: list[tuple[str | None, int, str, bool]],
    detection: str,
    delete_after_timeout: bool,
    parked_before: bool,
    record_before: str | None,
    declared_daemonset: bool | None,
    data: st.DataObject,
) -> None:
    settings = UpgradeSettings(detection=detection, delete_after_timeout=delete_after_timeout)  # type: ignore[arg-type]
    annotations = {"nvidia.com/gpu-driver-upgrade-enabled": "true"}
    if record_before is not None:
        annotations[RECORD] = record_before  # someone else's (or a broken) record
    labels = {"kubernetes.io/hostname": "node-1", "nvidia.com/gpu.present": "true"}
    node = data.draw(
        whole(ex.node(state=None, labels=labels, annotations=annotations, parked=parked_before))
    )
    pods = [build_pod(i, t) for i, t in enumerate(pod_traits)]
    daemonsets: list[dict[str, Any]] = []
    if declared_daemonset is not None:
        ds = ex.daemonset("dcgm-exporter", declared=declared_daemonset)
        daemonsets.append(ds)
        pods.append(ex.daemonset_pod(ds, labels={"nvidia.com/gpu-driver-upgrade.consumer": "true"}))
    blocked = frozenset(f"ml/p{i}" for i, t in enumerate(pod_traits) if t.blocked)
    now = 1_700_000_000.0

    for state, dt, how, kubelet in steps:
        now += dt
        if kubelet:
            pods = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        node = with_state(node, state)
        view = cached(node)
        assert set(view) == {"apiVersion", "kind", "metadata"}
        assert (view["apiVersion"], view["kind"]) == ("v1", "Node")
        assert "managedFields" not in view["metadata"] and cached(view) == view
        plan = plan_node(view, pods, daemonsets, settings, now)
        assert plan == plan_node(node, pods, daemonsets, settings, now)
        node, pods = apply(node, pods, plan, how, blocked)
