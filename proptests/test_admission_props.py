"""The admission guard's pure rules (shared_svc/admission/rules.py): the mutation restores
exactly what shared-svc owns and nothing else; a request that is not ours is never
changed; a delete is refused only for gpu-operator, only while a CR needs the object."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from shared_svc.admission.rules import (
    GUARDED,
    decide_delete,
    decide_update,
    operator_username,
    review,
)

NS = "gpu-operator"
OPERATOR = operator_username(NS, "gpu-operator")
NAMES = [(kind, name) for kind, names in GUARDED.items() for name in names]
# What shared-svc owns (the contract, section 5), spelled out here independently of the code.
RESTORED = (
    ("/metadata/labels", ("metadata", "labels")),
    ("/metadata/annotations", ("metadata", "annotations")),
    ("/metadata/ownerReferences", ("metadata", "ownerReferences")),
    ("/metadata/managedFields", ("metadata", "managedFields")),
    ("/spec", ("spec",)),
)

keys = st.sampled_from(["app", "app.kubernetes.io/managed-by", "x/y", "a~b", "nvidia.com/z"])
values = st.sampled_from(["shared-svc", "gpu-operator", "true", "nvidia-dcgm", ""])
string_maps = st.dictionaries(keys, values, max_size=4)
owner_refs = st.lists(
    st.fixed_dictionaries(
        {
            "apiVersion": st.sampled_from(["nvidia.com/v1", "nvidia.com/v1alpha1", "v1"]),
            "kind": st.sampled_from(["ClusterPolicy", "GPUCluster", "ConfigMap"]),
            "name": st.sampled_from(["cluster-policy", "gpu-cluster", "holder"]),
            "uid": st.uuids().map(str),
        },
        optional={"controller": st.booleans(), "blockOwnerDeletion": st.booleans()},
    ),
    max_size=3,
)
managed_fields = st.lists(
    st.fixed_dictionaries(
        {
            "manager": st.sampled_from(["shared-svc", "gpu-operator", "kubectl"]),
            "operation": st.sampled_from(["Apply", "Update"]),
            "fieldsV1": st.just({"f:spec": {"f:selector": {}}}),
        }
    ),
    max_size=3,
)
specs = st.fixed_dictionaries(
    {"selector": string_maps, "ports": st.just([{"port": 5555}])},
    optional={"clusterIP": st.just("10.0.0.7"), "internalTrafficPolicy": st.just("Local")},
)


@st.composite
def objects(draw: st.DrawFn, kind: str, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": NS, "uid": "u-1", "resourceVersion": "7"}
    for key, strategy in (
        ("labels", string_maps),
        ("annotations", string_maps),
        ("ownerReferences", owner_refs),
        ("managedFields", managed_fields),
    ):
        if draw(st.booleans()):
            meta[key] = draw(strategy)
    obj: dict[str, Any] = {"kind": kind, "metadata": meta}
    if draw(st.booleans()):
        obj["spec"] = draw(specs)
    if draw(st.booleans()):
        obj["status"] = {"loadBalancer": {}}
    return obj


def ours(obj: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out["metadata"].setdefault("labels", {})["app.kubernetes.io/managed-by"] = "shared-svc"
    return out


def operators(obj: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "nvidia.com/v1",
            "kind": "ClusterPolicy",
            "name": "cluster-policy",
            "uid": "cp-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    return out


def apply_patch(obj: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 add/remove for the object-member paths the guard uses."""
    out = copy.deepcopy(obj)
    for op in ops:
        *parents, leaf = [
            p.replace("~1", "/").replace("~0", "~") for p in op["path"][1:].split("/")
        ]
        node = out
        for p in parents:
            node = node[p]
        if op["op"] == "add":
            node[leaf] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            del node[leaf]
        else:  # pragma: no cover - the guard emits no other op
            raise AssertionError(op)
    return out


def without_restored(obj: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    for _, path in RESTORED:
        node = out
        for p in path[:-1]:
            node = node.get(p, {})
        node.pop(path[-1], None)
    return out


def restored_part(obj: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for pointer, path in RESTORED:
        node: Any = obj
        for p in path:
            node = node.get(p) if isinstance(node, dict) else None
        out[pointer] = node
    return out


pairs = st.sampled_from(NAMES).flatmap(
    lambda kn: st.tuples(st.just(kn), objects(*kn), objects(*kn))
)


@given(pairs)
def test_the_mutation_restores_exactly_what_we_own(pair: Any) -> None:
    (kind, _), old, new = pair
    old, new = ours(old), operators(new)
    ops = decide_update(old, new, kind=kind, namespace=NS, request_namespace=NS)
    assert ops is not None
    result = apply_patch(new, ops)
    assert restored_part(result) == restored_part(old), "what we own comes from the old object"
    assert without_restored(result) == without_restored(new), "everything else is untouched"


@given(pairs, st.sampled_from(["namespace", "owner", "label", "name"]))
def test_a_request_we_do_not_own_is_never_changed(pair: Any, broken: str) -> None:
    (kind, name), old, new = pair
    old, new = ours(old), operators(new)
    request_ns = NS
    if broken == "namespace":
        request_ns = "elsewhere"
    elif broken == "owner":
        for ref in new["metadata"]["ownerReferences"]:
            ref["controller"] = False  # shared-svc's own shape: never a controller
    elif broken == "label":
        old["metadata"]["labels"]["app.kubernetes.io/managed-by"] = "gpu-operator"
    else:
        new["metadata"]["name"] = old["metadata"]["name"] = name + "-x"
    assert decide_update(old, new, kind=kind, namespace=NS, request_namespace=request_ns) is None
    body = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "r1",
            "operation": "UPDATE",
            "namespace": request_ns,
            "name": new["metadata"]["name"],
            "resource": {"resource": "services" if kind == "Service" else "servicemonitors"},
            "object": new,
            "oldObject": old,
        },
    }
    response = review(body, namespace=NS, operator_users=[OPERATOR], needed_by={})["response"]
    assert response == {"uid": "r1", "allowed": True}


@given(pairs)
def test_the_review_patch_is_the_rule(pair: Any) -> None:
    (kind, name), old, new = pair
    old, new = ours(old), operators(new)
    body = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "r2",
            "operation": "UPDATE",
            "namespace": NS,
            "name": name,
            "resource": {"resource": "services" if kind == "Service" else "servicemonitors"},
            "object": new,
            "oldObject": old,
        },
    }
    response = review(body, namespace=NS, operator_users=[OPERATOR], needed_by=None)["response"]
    assert response["allowed"] is True and response["patchType"] == "JSONPatch"
    patch = json.loads(base64.b64decode(response["patch"]))
    assert patch == decide_update(old, new, kind=kind, namespace=NS, request_namespace=NS)


@given(
    st.sampled_from([*NAMES, ("Service", "other"), ("ConfigMap", "nvidia-dcgm")]),
    st.sampled_from([NS, "elsewhere"]),
    st.sampled_from([OPERATOR, "system:serviceaccount:gpu-operator:shared-svc", "alice"]),
    st.one_of(
        st.none(),
        st.dictionaries(
            st.sampled_from(NAMES),
            st.lists(st.sampled_from(["ClusterPolicy/cluster-policy", "GPUCluster/gpu-cluster"])),
        ),
    ),
    st.booleans(),
)
def test_a_delete_is_refused_only_for_gpu_operator_or_a_dry_run_while_a_cr_needs_it(
    target: tuple[str, str],
    namespace: str,
    user: str,
    needed_by: dict[tuple[str, str], list[str]] | None,
    dry_run: bool,
) -> None:
    """A dry run (the guard probe's; the chart's matchConditions send no other) is judged
    as gpu-operator's delete; a real delete by anyone else is never refused."""
    kind, name = target
    verdict = decide_delete(
        kind=kind,
        name=name,
        request_namespace=namespace,
        namespace=NS,
        username=user,
        operator_users=[OPERATOR],
        needed_by=needed_by,
        dry_run=dry_run,
    )
    judged = target in NAMES and namespace == NS and (user == OPERATOR or dry_run)
    refused = judged and needed_by is not None and bool(needed_by.get(target))
    assert verdict.allowed is not refused
    if dry_run and judged and not refused:
        assert verdict.message, "an allowed dry run says the guard answered"
    if refused:
        assert (verdict.code, verdict.reason) == (404, "NotFound")
        assert all(cr in verdict.message for cr in (needed_by or {})[target])
