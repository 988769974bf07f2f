"""Records pods and EndpointSlices of the DCGM Services, and finds per-node endpoint gaps.

Both watches read the same etcd, so their resourceVersions order all events on one
timeline (opaque to clients in general; in this single-etcd test control plane they are
etcd revisions). Replaying that timeline tells, at every moment the API server recorded,
which nodes had a ready DCGM pod and which nodes a Service had a ready endpoint on.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client import ApiClient

# Service name -> the pods (by ``app``) of either stack that serve it on their node. Only the
# name the hold applies to: nvidia-dcgm-exporter follows the selector rules at once (contract
# section 4, issue 20), so it may leave a node before the new pods there are ready; what its
# consumer, the scraper, sees is proven by tests/test_scrape_prometheus.py.
SERVED_BY = {
    "nvidia-dcgm": ("nvidia-dcgm", "nvidia-dcgm-dra"),
}
SLICE_LABEL = "kubernetes.io/service-name"


@dataclass
class Gap:
    service: str
    node: str
    resource_version: int
    what: str  # the event that opened it

    def __str__(self) -> str:
        return f"{self.service} has no ready endpoint on {self.node} at rv {self.resource_version} ({self.what})"


@dataclass
class Timeline:
    events: list[tuple[int, str, str, dict[str, Any]]] = field(default_factory=list)

    def gaps(self) -> list[Gap]:
        """Moments when a node with a ready DCGM pod of either stack had, for a Service that
        had covered it before, no ready endpoint of that Service."""
        pods: dict[str, dict[str, Any]] = {}
        slices: dict[str, dict[str, Any]] = {}
        covered_before: dict[str, set[str]] = {s: set() for s in SERVED_BY}
        found: list[Gap] = []
        for rv, kind, type_, obj in sorted(self.events, key=lambda e: e[0]):
            store = pods if kind == "Pod" else slices
            name = obj["metadata"]["name"]
            if type_ == "DELETED":
                store.pop(name, None)
            else:
                store[name] = obj
            for service, apps in SERVED_BY.items():
                with_pod = {
                    p["spec"]["nodeName"]
                    for p in pods.values()
                    if p["metadata"].get("labels", {}).get("app") in apps and _serving(p)
                }
                covered = {
                    ep.get("nodeName")
                    for s in slices.values()
                    if s["metadata"].get("labels", {}).get(SLICE_LABEL) == service
                    for ep in s.get("endpoints") or []
                    if (ep.get("conditions") or {}).get("ready")
                }
                for node in sorted((covered_before[service] & with_pod) - covered):
                    found.append(Gap(service, node, rv, f"{type_} {kind}/{name}"))
                covered_before[service] |= covered
        return found


def _serving(pod: dict[str, Any]) -> bool:
    if pod["metadata"].get("deletionTimestamp") or not pod.get("spec", {}).get("nodeName"):
        return False
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


@contextlib.asynccontextmanager
async def recorded(api: ApiClient, namespace: str) -> Any:
    """Records pod and EndpointSlice events of ``namespace`` while the block runs."""
    timeline = Timeline()
    core = client.CoreV1Api(api)
    discovery = client.DiscoveryV1Api(api)
    apps = sorted({a for v in SERVED_BY.values() for a in v})
    sources = (
        ("Pod", core.list_namespaced_pod, f"app in ({','.join(apps)})"),
        (
            "EndpointSlice",
            discovery.list_namespaced_endpoint_slice,
            f"{SLICE_LABEL} in ({','.join(SERVED_BY)})",
        ),
    )
    started = []
    tasks = []
    for kind, lister, selector in sources:
        ready = asyncio.Event()
        started.append(ready)
        tasks.append(
            asyncio.ensure_future(_record(timeline, kind, lister, namespace, selector, ready))
        )
    await asyncio.wait_for(asyncio.gather(*(r.wait() for r in started)), timeout=30)
    try:
        yield timeline
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _record(
    timeline: Timeline,
    kind: str,
    lister: Any,
    namespace: str,
    selector: str,
    ready: asyncio.Event,
) -> None:
    api = lister.__self__.api_client
    listed = await lister(namespace, label_selector=selector)
    rv = listed.metadata.resource_version
    for item in listed.items:
        obj = api.sanitize_for_serialization(item)
        timeline.events.append((int(obj["metadata"]["resourceVersion"]), kind, "ADDED", obj))
    ready.set()
    while True:
        w = watch.Watch()
        async with w.stream(
            lister,
            namespace,
            label_selector=selector,
            resource_version=rv,
            allow_watch_bookmarks=True,
            timeout_seconds=300,
        ) as stream:
            async for event in stream:
                obj = api.sanitize_for_serialization(event["object"])
                rv = obj["metadata"]["resourceVersion"]
                if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                    timeline.events.append((int(rv), kind, event["type"], obj))
