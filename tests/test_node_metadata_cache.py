"""The upgrade controller's node caches keep metadata only, on the real API server (issue 12).

Every reader of a cached node (``plan_node`` through ``get_node``, the event sources)
reads only its metadata, so both node caches ask the API server for
``PartialObjectMetadata`` (the ``Accept`` header): a GPU node's 10-30 KiB of status
(images, conditions, capacity, nodeInfo) is neither sent, parsed nor kept, and a status
written by the kubelet changes only the resourceVersion. The objects kept still read as
Nodes (``kind: Node``, ``apiVersion: v1``), without ``managedFields``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from shared_svc.config import Config
from shared_svc.controllers.upgrade.caches import node_resources
from shared_svc.controllers.upgrade.io import KubeUpgradeIO, upgrade_write_limiter
from shared_svc.kube.reflector import Cache
from shared_svc.kube.resources import METADATA, NODES
from shared_svc.kube.writer import MERGE_PATCH, raw_request
from shared_svc.upgrade.daemonsets import parked_label_key
from shared_svc.upgrade.node_plan import NodePatch
from shared_svc.upgrade.states import state_label_key
from tests.kube import eventually, unique
from tests.realistic import api_node_status

pytestmark = pytest.mark.apiserver

# A driver name of this module's own: the state label of the shipped one ("gpu") would put
# these nodes in the caches of other tests' upgrade controllers (the API server is shared).
DRIVER = "metacache"
STATE = state_label_key(DRIVER)
PARKED = parked_label_key(DRIVER)


async def create_node(api: ApiClient, name: str, labels: dict[str, str]) -> None:
    """A Node with a spec, annotations and a large status (written as the kubelet does,
    through the status subresource)."""
    body = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, **labels},
            "annotations": {"nfd.node.kubernetes.io/feature-labels": "pci-10de.present"},
        },
        "spec": {"podCIDR": "10.244.7.0/24", "providerID": f"test://{name}"},
    }
    await raw_request(api, "POST", NODES.collection(), body=body)
    await write_status(api, name, 0)


async def write_status(api: ApiClient, name: str, generation: int) -> dict[str, Any]:
    node: dict[str, Any] = await raw_request(
        api,
        "PATCH",
        NODES.item(name, subresource="status"),
        body={"status": api_node_status(name, seed=generation)},
        content_type=MERGE_PATCH,
    )
    return node


async def read_node(api: ApiClient, name: str) -> dict[str, Any]:
    node: dict[str, Any] = await raw_request(api, "GET", NODES.item(name))
    return node


async def delete_node(api: ApiClient, name: str) -> None:
    try:
        await raw_request(api, "DELETE", NODES.item(name))
    except ApiException as exc:
        if exc.status != 404:  # not created: the test failed before
            raise


def metadata_view(node: dict[str, Any]) -> dict[str, Any]:
    """What a metadata-only cache should hold of the live ``node``."""
    meta = {k: v for k, v in node["metadata"].items() if k != "managedFields"}
    return {"apiVersion": "v1", "kind": "Node", "metadata": meta}


async def _true(value: bool) -> bool:
    return value


class Wire:
    """The ``Accept`` header of every request the cache sends, and the kind of each list
    page the API server answered with (read through aiohttp's kept body)."""

    def __init__(self, cache: Cache) -> None:
        self.accepts: list[tuple[bool, str]] = []  # (watch?, Accept)
        self.list_kinds: list[str] = []
        api = cache._api
        real = api.call_api

        async def call_api(*args: Any, **kw: Any) -> Any:
            query = dict(kw.get("query_params") or [])
            if query.get("labelSelector") != cache.resource.label_selector:
                return await real(*args, **kw)  # the test's own requests (same client)
            watch = query.get("watch") == "true"
            self.accepts.append((watch, (kw.get("header_params") or {}).get("Accept", "")))
            resp = await real(*args, **kw)
            if not watch and 200 <= resp.status <= 299:
                # aiohttp keeps a body once read: the cache reads the same bytes after.
                self.list_kinds.append(_kind(await resp.read()))
            return resp

        api.call_api = call_api  # type: ignore[method-assign]


def _kind(raw: bytes) -> str:
    return str(json.loads(raw).get("kind", ""))


@pytest.mark.parametrize("which", ["state", "parked"])
async def test_node_caches_keep_metadata_only_from_lists_and_watches(
    api: ApiClient, which: str
) -> None:
    """Both node caches ask for PartialObjectMetadata in their list pages and watches; a
    node with a large status is kept as its metadata (labels, annotations,
    resourceVersion, uid), read as a Node, without spec, status or managedFields; a node
    added later and a label change arrive through the watch the same way."""
    state_nodes, parked_nodes = node_resources(DRIVER)
    resource = state_nodes if which == "state" else parked_nodes
    label = {STATE: "upgrade-required"} if which == "state" else {PARKED: "true"}
    listed, watched, other = (unique(f"meta-{which}-{n}") for n in ("l", "w", "o"))
    await create_node(api, listed, label)
    await create_node(api, other, {})  # neither label: in neither cache
    cache = Cache(api, resource, page_size=1)
    wire = Wire(cache)
    stop = asyncio.Event()
    task = asyncio.ensure_future(cache.run(stop))
    try:
        await eventually(lambda: _true(cache.synced.is_set()), timeout=15)
        live = await read_node(api, listed)
        assert "images" in live["status"] and len(live["metadata"]["managedFields"]) >= 2
        assert cache.get(listed) == metadata_view(live)
        assert cache.get(other) is None

        # Added later: through the watch, kept the same way.
        await create_node(api, watched, label)
        added = await read_node(api, watched)
        await eventually(lambda: _true(cache.get(watched) == metadata_view(added)), timeout=15)

        # A label change arrives through the watch; a status write changes only the version.
        await raw_request(
            api,
            "PATCH",
            NODES.item(listed),
            body={"metadata": {"labels": {"example.com/drain": "now"}}},
            content_type=MERGE_PATCH,
        )
        await eventually(
            lambda: _true(
                (cache.get(listed) or {})["metadata"]["labels"].get("example.com/drain") == "now"
            ),
            timeout=15,
        )
        after_status = await write_status(api, listed, 1)
        await eventually(
            lambda: _true(cache.get(listed) == metadata_view(after_status)), timeout=15
        )
        assert set(cache.get(listed) or {}) == {"apiVersion", "kind", "metadata"}
        assert cache.relists == 1  # all of it through the one watch
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        for name in (listed, watched, other):
            await delete_node(api, name)

    # The server answered what was asked: no status on the wire, not only none kept.
    lists = {accept for watch, accept in wire.accepts if not watch}
    watches = {accept for watch, accept in wire.accepts if watch}
    assert lists == {"application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"}
    assert watches == {"application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"}
    assert wire.list_kinds and set(wire.list_kinds) == {"PartialObjectMetadataList"}


async def test_the_node_patch_answer_is_metadata_only(api: ApiClient) -> None:
    """``KubeUpgradeIO.patch_node`` reads no answer: it asks for the node's metadata only,
    so the API server does not encode (nor this process parse) a GPU node's status for
    every record it writes; the server honours it and the patch lands."""
    name = unique("meta-patch")
    await create_node(api, name, {STATE: "cordon-required"})
    answers: list[tuple[str, str]] = []  # (Accept, kind answered) of each node PATCH
    real = api.call_api

    async def call_api(*args: Any, **kw: Any) -> Any:
        resp = await real(*args, **kw)
        if args[1] == "PATCH" and args[0] == NODES.item(name):
            accept = (kw.get("header_params") or {}).get("Accept", "")
            answers.append((accept, _kind(await resp.read())))
        return resp

    api.call_api = call_api  # type: ignore[method-assign]
    io = KubeUpgradeIO(api, DRIVER, write_limiter=upgrade_write_limiter(Config()))
    try:
        live = await read_node(api, name)
        await io.patch_node(
            NodePatch(name, live["metadata"]["resourceVersion"], labels=((PARKED, "true"),))
        )
        assert (await read_node(api, name))["metadata"]["labels"][PARKED] == "true"
    finally:
        api.call_api = real  # type: ignore[method-assign]
        await delete_node(api, name)
    assert answers == [(METADATA, "PartialObjectMetadata")]
