"""The caches' decoders (``kube.decode``: msgspec, the fields a projection or a metadata
view reads, the rest skipped) keep what ``json.loads`` and the projection keep, or leave the page or event to
them: the same kept objects, keys, resourceVersions and continue token, the same pruned
objects, the same error, for any list page or watch event of pods, DaemonSets or metadata-only nodes, wrong
types and hostile text included (issue 22)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st
from kubernetes_asyncio.client.exceptions import ApiException

from proptests.test_plan_json_props import DROPPED, FORMATS, odd_text, pod_texts
from proptests.test_projection_props import PATHS as DS_PATHS
from shared_svc.controllers.services.caches import operator_pods
from shared_svc.controllers.shared_caches import ALL_DAEMONSETS
from shared_svc.controllers.upgrade.caches import node_resources
from shared_svc.kube.reflector import Listed, Resource, read_page, watch_event
from shared_svc.kube.store import key_of
from tests.realistic import _fields, api_daemonset, api_node_labels, api_node_status, api_pod

PODS = operator_pods("gpu-operator")
NODES = node_resources("gpu")[0]
RESOURCES = st.sampled_from([PODS, ALL_DAEMONSETS, NODES])
NODE_PATHS = (
    ("metadata",),
    ("metadata", "name"),
    ("metadata", "labels"),
    ("metadata", "annotations"),
    ("metadata", "uid"),
    ("metadata", "resourceVersion"),
    ("metadata", "managedFields"),
    ("metadata", "zzz"),  # not a field of ObjectMeta: read the exact way
    ("kind",),
    ("zzz",),
)
EVENT_TYPES = st.sampled_from(["ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR", "OTHER"])


def exact(resource: Resource) -> Resource:
    """The declaration read the exact way (``json.loads``, then the projection)."""
    return dataclasses.replace(resource, decoder=None)


@st.composite
def daemonset_texts(draw: st.DrawFn, fmt: dict[str, Any]) -> str:
    """A DaemonSet's JSON with odd values in kept and dropped fields, and hostile tokens."""
    ds: Any = api_daemonset(draw(st.sampled_from(["nvidia-dcgm", "other"])), 3)
    paths = DS_PATHS + DROPPED + (("spec", "template", "spec", "containers"),)
    return odd_text(draw, ds, paths, fmt)


@st.composite
def node_texts(draw: st.DrawFn, fmt: dict[str, Any]) -> str:
    """A Node as PartialObjectMetadata (its managedFields too), odd values and hostile text."""
    name = draw(st.sampled_from(["node-0", "node-1"]))
    status = api_node_status(name)
    node: Any = {
        "kind": "PartialObjectMetadata",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {
            "name": name,
            "uid": "6f1c",
            "resourceVersion": "812",
            "creationTimestamp": "2026-12-01T12:00:00Z",
            "labels": api_node_labels(name),
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
            "managedFields": [
                {
                    "manager": "kubelet",
                    "operation": "Update",
                    "fieldsType": "FieldsV1",
                    "fieldsV1": _fields({"status": status}),
                    "subresource": "status",
                }
            ],
        },
    }
    return odd_text(draw, node, NODE_PATHS, fmt)


def objects(resource: Resource, fmt: dict[str, Any]) -> st.SearchStrategy[str]:
    if resource.kind == "Pod":
        return pod_texts(fmt)
    return daemonset_texts(fmt) if resource.kind == "DaemonSet" else node_texts(fmt)


LIST_METAS = st.sampled_from(
    [
        '{"resourceVersion":"77","continue":"next"}',
        '{"resourceVersion":"77"}',
        "{}",
        "null",
        '{"resourceVersion":7,"continue":null}',
        '"odd"',
    ]
)


@st.composite
def pages(draw: st.DrawFn) -> tuple[Resource, bytes]:
    resource = draw(RESOURCES)
    fmt = draw(FORMATS)
    items = draw(st.lists(objects(resource, fmt), max_size=3))
    body = (
        "[" + ",".join(items) + "]"
        if draw(st.booleans()) or items
        else draw(st.sampled_from(["null", "[]", "{}", "3"]))
    )
    text = f'{{"kind":"List","apiVersion":"v1","metadata":{draw(LIST_METAS)},"items":{body}}}'
    return resource, text.encode()


@st.composite
def events(draw: st.DrawFn) -> tuple[Resource, bytes]:
    resource = draw(RESOURCES)
    obj = draw(
        objects(resource, draw(FORMATS))
        | st.sampled_from(
            [
                '{"kind":"Status","code":410,"reason":"Gone"}',
                '{"kind":"Status","code":500,"reason":"InternalError","message":"x"}',
                '{"kind":"Pod","metadata":{"resourceVersion":"9"}}',
                "null",
            ]
        )
    )
    return resource, f'{{"type":"{draw(EVENT_TYPES)}","object":{obj}}}'.encode()


def page_outcome(raw: bytes, resource: Resource) -> Any:
    """What a list page leaves in the cache (or the error it stops the list with)."""
    listed = Listed({}, {}, "", set())
    try:
        token = read_page(raw, resource, listed, ({}, {}), resource.kept)
    except Exception as exc:
        return "refused", type(exc), str(exc)
    return token, listed


def event_outcome(raw: bytes, resource: Resource) -> Any:
    """What the reflector reads of a watch event (or the error it ends the watch with)."""
    try:
        etype, obj, pruned = watch_event(raw, resource)
        rv = obj.get("metadata", {}).get("resourceVersion")
        if etype in ("ERROR", "BOOKMARK"):
            return etype, rv
        return etype, key_of(obj), rv, resource.kept(obj), pruned
    except ApiException as exc:
        return "raised", exc.status, exc.reason, exc.body
    except Exception as exc:
        return "refused", type(exc), str(exc)


def _page(*items: str) -> bytes:
    return ('{"metadata":{"resourceVersion":"1"},"items":[' + ",".join(items) + "]}").encode()


def _pod(**fields: Any) -> str:
    pod = api_pod("nvidia-dcgm", "p-0", "node-0")
    pod.update(fields)
    return json.dumps(pod)


@given(pages())
@example((PODS, _page(_pod(), _pod(spec={"containers": 1e400, "nodeName": "n"}))))
@example((PODS, _page(_pod(status={"conditions": ["Ready"]}))))
@example((PODS, _page(_pod(metadata=None))))
@example((PODS, _page(_pod(zzz="\udc00"))))
def test_a_decoded_list_page_keeps_what_the_exact_reader_keeps_or_fails_as_it_fails(
    case: tuple[Resource, bytes],
) -> None:
    resource, raw = case
    assert page_outcome(raw, resource) == page_outcome(raw, exact(resource))


@given(events())
def test_a_decoded_watch_event_reads_as_the_exact_reader_reads_it_or_fails_as_it_fails(
    case: tuple[Resource, bytes],
) -> None:
    resource, raw = case
    assert event_outcome(raw, resource) == event_outcome(raw, exact(resource))
