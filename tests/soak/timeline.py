"""The soak's invariants about time (issue 44): what must hold at every moment of a step,
not only once it settled, judged on the API server's own order of events.

:class:`Watcher` lists and watches the nodes, the pods and the Services the soak is about
straight from the API server (not through shared-svc's caches: a checker must not share
the code it checks), resuming each watch at the last resourceVersion it saw after a cut,
an API server restart or an etcd kill; when that version is gone (410) it lists again and
says so (a gap: nothing is judged across it). With one etcd, resourceVersions are its
global revisions, so they order a pod's eviction against a node's state change exactly.

:class:`Timeline` (pure) replays those events in that order and reports:

- a GPU consumer asked to go (its ``deletionTimestamp``) while its node was not in a
  freeing state (``FREE``, the contract's section 3), or on a step whose upgrade path frees
  nothing (restart-only, or no upgrade at all);
- the parked label set on a node outside the freeing states, or on such a step;
  on the restart-only path both are explained when shared-svc's record on the node says
  it guessed the path (``"pathEvidence": "guess"``, reported as ``UpgradePathGuessed``):
  the contract's side "that cannot stall a full upgrade", taken where the evidence is
  gone (a leader killed before it recorded its verdict, the old driver pod deleted before
  the next one leads). Counted in :attr:`Timeline.guessed`;
- the hold (the Services contract's section 4): ``nvidia-dcgm`` moved to a selector that
  covers fewer nodes than the one it had (a node is covered when a ready pod on it is
  selected), judged on the pods at that moment; a pod that changed within :data:`LAG`
  seconds before the move still counts (shared-svc decides on its cache, a moment old).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes_asyncio.client import ApiClient

from shared_svc.k8s.selectors import selector_from_set
from shared_svc.kube.writer import raw_request
from tests.kube import WatchGone, watch_events
from tests.upgrade_flow import CONSUMER_KEY, PARKED, RECORD, STATE

CONSUMER = (CONSUMER_KEY, "true")
FREE = frozenset(
    {
        "cordon-required",
        "wait-for-jobs-required",
        "pod-deletion-required",
        "drain-required",
        "pod-restart-required",
    }
)
HELD = "nvidia-dcgm"  # the name the hold is about
LAG = 2.0  # seconds a pod's earlier version still counts for the hold (a cache's lag)
K8sObject = dict[str, Any]


@dataclass(frozen=True)
class Event:
    kind: str  # node, pod or service
    type: str  # ADDED, MODIFIED, DELETED, or LIST (obj: {"items": [...]}, after a gap)
    rv: int
    at: float  # monotonic, when it arrived
    obj: K8sObject


def ready(pod: K8sObject) -> bool:
    """Ready, and not asked to go (as the kubelet reports it: the Ready condition)."""
    return not pod["metadata"].get("deletionTimestamp") and any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def _labels(obj: K8sObject) -> dict[str, str]:
    return dict(obj["metadata"].get("labels") or {})


def _guessed(node: K8sObject) -> bool:
    """shared-svc's record on ``node`` says it guessed the upgrade's path."""
    raw = (node["metadata"].get("annotations") or {}).get(RECORD)
    try:
        return bool(raw) and json.loads(raw).get("pathEvidence") == "guess"
    except (ValueError, AttributeError):
        return False


@dataclass
class Timeline:
    """The replay (see the module doc). ``consumers``: the namespace of the GPU consumers;
    ``operands``: the namespace of the DCGM pods and Services."""

    consumers: str
    operands: str
    states: dict[str, str | None] = field(default_factory=dict)  # node -> state label
    parked: dict[str, bool] = field(default_factory=dict)
    guessing: dict[str, bool] = field(default_factory=dict)  # node -> its record says "guess"
    guessed: int = 0  # consumers asked to go, or nodes parked, on a guess of the path
    pods: dict[str, K8sObject] = field(default_factory=dict)  # uid -> latest version
    asked: set[str] = field(default_factory=set)  # consumer uids asked to go, once each
    recent: list[tuple[float, K8sObject]] = field(default_factory=list)  # replaced versions
    held: tuple[str, dict[str, str]] | None = None  # the held Service's uid and selector
    listed: set[str] = field(default_factory=set)  # the kinds listed once already
    gaps: int = 0  # lists after the first (a watch's version was gone)
    moves: int = 0  # the held Service's selector moves judged

    def feed(self, events: Iterable[Event], path: str) -> list[str]:
        """Replays ``events`` (in revision order) of a step whose upgrade path is ``path``
        (``full``, ``restart-only``, ``none``); returns what broke."""
        problems: list[str] = []
        for e in sorted(events, key=lambda e: e.rv):
            if e.type == "LIST":
                self._relist(e)
            elif e.kind == "node":
                problems += self._node(e, path)
            elif e.kind == "pod":
                problems += self._pod(e, path)
            elif e.kind == "service":
                problems += self._service(e)
        return problems

    def _relist(self, e: Event) -> None:
        self.gaps += e.kind in self.listed
        self.listed.add(e.kind)
        items = e.obj["items"]
        if e.kind == "node":
            self.states = {n["metadata"]["name"]: _labels(n).get(STATE) for n in items}
            self.parked = {n["metadata"]["name"]: PARKED in _labels(n) for n in items}
        elif e.kind == "pod":
            self.pods = {p["metadata"]["uid"]: p for p in items}
            self.asked |= {
                u for u, p in self.pods.items() if p["metadata"].get("deletionTimestamp")
            }
        else:
            self.held = None  # the next version is taken as it is, not judged as a move
            for svc in items:
                self._service(Event("service", "ADDED", e.rv, e.at, svc))

    def _node(self, e: Event, path: str) -> list[str]:
        name = e.obj["metadata"]["name"]
        labels = _labels(e.obj)
        state = labels.get(STATE)
        self.states[name] = state if e.type != "DELETED" else None
        self.guessing[name] = _guessed(e.obj)
        was, now = self.parked.get(name, False), PARKED in labels and e.type != "DELETED"
        self.parked[name] = now
        if now and not was and not self._frees(name, state, path):
            return [f"rv {e.rv}: node {name} parked in state {state!r} on a {path!r} step"]
        return []

    def _frees(self, node: str, state: str | None, path: str) -> bool:
        """Whether freeing ``node`` in ``state`` on a step of ``path`` is what the contract
        lets shared-svc do (a guess on the restart-only path: see the module doc)."""
        if state not in FREE:
            return False
        if path == "restart-only" and self.guessing.get(node, False):
            self.guessed += 1
            return True
        return path == "full"

    def _pod(self, e: Event, path: str) -> list[str]:
        meta = e.obj["metadata"]
        uid = meta["uid"]
        old = self.pods.pop(uid, None)
        if old is not None:
            self.recent.append((e.at, old))
        if e.type != "DELETED":
            self.pods[uid] = e.obj
        if (
            meta["namespace"] != self.consumers
            or _labels(e.obj).get(CONSUMER[0]) != CONSUMER[1]
            or not meta.get("deletionTimestamp")
            or uid in self.asked
        ):
            return []
        self.asked.add(uid)
        node = str(e.obj["spec"].get("nodeName"))
        state = self.states.get(node)
        if self._frees(node, state, path):
            return []
        return [
            f"rv {e.rv}: consumer {meta['namespace']}/{meta['name']} asked to go on {node} "
            f"in state {state!r} on a {path!r} step"
        ]

    def _service(self, e: Event) -> list[str]:
        meta = e.obj["metadata"]
        if meta["name"] != HELD or meta.get("namespace") != self.operands:
            return []
        if e.type == "DELETED":
            self.held = None
            return []
        selector = dict((e.obj.get("spec") or {}).get("selector") or {})
        before, self.held = self.held, (meta["uid"], selector)
        if before is None or before[0] != meta["uid"] or before[1] == selector:
            return []
        if not before[1] or not selector:
            return []
        self.moves += 1
        missing = self.covered(before[1]) - self.covered(selector, since=e.at - LAG)
        if not missing:
            return []
        return [
            f"rv {e.rv}: {HELD} moved from {before[1]} to {selector}, leaving "
            f"{sorted(missing)} uncovered (the hold)"
        ]

    def covered(self, selector: Mapping[str, str], since: float | None = None) -> set[str]:
        """The nodes on which a ready pod in the operands' namespace is selected (with
        ``since``: by its current version or one replaced after ``since``)."""
        match = selector_from_set(selector)
        pods = list(self.pods.values())
        if since is not None:
            self.recent = [(at, p) for at, p in self.recent if at >= since - LAG]
            pods += [p for at, p in self.recent if at >= since]
        return {
            str(p["spec"].get("nodeName"))
            for p in pods
            if p["metadata"]["namespace"] == self.operands
            and ready(p)
            and match.matches(_labels(p))
        }


class Watcher:
    """Lists, then watches, each of ``paths`` (kind -> collection path) until stopped
    (see the module doc); :meth:`take` hands over what arrived since the last call."""

    def __init__(self, api: ApiClient, paths: Mapping[str, str]) -> None:
        self.api = api
        self.paths = dict(paths)
        self.events: list[Event] = []
        self.reconnects = 0
        self._listed: dict[str, asyncio.Event] = {k: asyncio.Event() for k in paths}

    def take(self) -> list[Event]:
        out, self.events = self.events, []
        return out

    async def started(self) -> None:
        for listed in self._listed.values():
            await listed.wait()

    async def run(self, stop: asyncio.Event) -> None:
        tasks = [asyncio.ensure_future(self._follow(k, p)) for k, p in self.paths.items()]
        try:
            await stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow(self, kind: str, path: str) -> None:
        rv: str | None = None
        while True:
            try:
                if rv is None:
                    data = await raw_request(self.api, "GET", path, timeout=30.0)
                    rv = str(data["metadata"]["resourceVersion"])
                    items = data.get("items") or []
                    self.events.append(
                        Event(kind, "LIST", int(rv), time.monotonic(), {"items": items})
                    )
                    self._listed[kind].set()
                rv = await self._watch(kind, path, rv)
            except asyncio.CancelledError:
                raise
            except Exception:  # the API server away, a cut: resume where it was
                self.reconnects += 1
                await asyncio.sleep(0.5)

    async def _watch(self, kind: str, path: str, rv: str) -> str | None:
        """Follows one watch from ``rv``; returns the version to resume at (None: list
        again, the version is gone)."""
        try:
            async for event in watch_events(self.api, path, rv, seconds=300, bookmarks=True):
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    return None if obj.get("code") == 410 else rv
                rv = str(obj["metadata"]["resourceVersion"])
                if event.get("type") != "BOOKMARK":
                    self.events.append(Event(kind, event["type"], int(rv), time.monotonic(), obj))
        except WatchGone:
            return None
        return rv
