"""Desired against live: which write, if any, brings each object to its intent (section 5).

A reconcile that finds the world right writes nothing: an object is ``unchanged`` when it
is managed, every field we set equals the live value (API defaults count as equal), its
ClusterPolicy/GPUCluster references are exactly ours, it has no state label, and its intent
hash equals the hash of the current intent (so no field we set before lingers unwanted).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shared_svc.k8s.objects import K8sObject, annotations_of, labels_of, meta, spec
from shared_svc.k8s.selectors import SelectorError, label_selector
from shared_svc.reconcile.model import Action, ManagedKind
from shared_svc.reconcile.monitoring import (
    drain_stamp,
    drained_selector,
    drained_since,
    scrape_interval,
)
from shared_svc.reconcile.names import (
    COMMON_LABEL,
    DRAINED_ANNOTATION,
    INTENT_HASH_ANNOTATION,
    MONITOR_LABEL,
    SCRAPE_ANNOTATION,
    STATE_LABEL,
)
from shared_svc.reconcile.owners import OwnerRef, adoptable, cr_refs, foreign_refs, is_managed
from shared_svc.reconcile.shapes import API_DEFAULT_TRAFFIC_POLICY, API_DEFAULT_TYPE
from shared_svc.reconcile.takeover import take_over_op

OWNERS_PATH = "metadata.ownerReferences"
HASH_PATH = f'metadata.annotations["{INTENT_HASH_ANNOTATION}"]'


@dataclass(frozen=True)
class Desired:
    kind: ManagedKind
    name: str
    body: K8sObject  # the apply body: our intent only, stamped with its hash

    @property
    def owners(self) -> list[OwnerRef]:
        refs: list[OwnerRef] = self.body["metadata"]["ownerReferences"]
        return refs


def _label_path(key: str) -> str:
    return f"metadata.labels[{json.dumps(key)}]"


def _annotation_path(key: str) -> str:
    return f"metadata.annotations[{json.dumps(key)}]"


def _normal_port(port: Any) -> Any:
    if not isinstance(port, dict):
        return port
    # The API server defaults protocol to TCP and targetPort to port.
    return {
        "name": port.get("name"),
        "port": port.get("port"),
        "targetPort": port.get("targetPort", port.get("port")),
        "protocol": port.get("protocol", "TCP"),
    }


def _service_spec_changes(want: dict[str, Any], live: dict[str, Any]) -> list[str]:
    changed = []
    if want["selector"] != live.get("selector"):
        changed.append("spec.selector")
    # Ports are a list map keyed by (port, protocol): compare ours only; a port another
    # manager added survives our apply and is not ours to compare.
    live_ports = live.get("ports")
    by_key: dict[tuple[Any, Any], Any] = {}
    for port in live_ports if isinstance(live_ports, list) else []:
        if isinstance(port, dict):
            normal = _normal_port(port)
            key = (normal["port"], normal["protocol"])
            # A port that is no int or a protocol that is no string (a list, a map) is
            # never one of ours: it cannot key the map, and our apply replaces it.
            if isinstance(key[0], int) and not isinstance(key[0], bool) and isinstance(key[1], str):
                by_key.setdefault(key, normal)
    if any(by_key.get((p["port"], p["protocol"])) != p for p in want["ports"]):
        changed.append("spec.ports")
    # A field we leave unset is the API server's or another manager's: not compared here
    # (the intent hash tells whether we set it before).
    if "type" in want and want["type"] != live.get("type", API_DEFAULT_TYPE):
        changed.append("spec.type")
    policy = live.get("internalTrafficPolicy", API_DEFAULT_TRAFFIC_POLICY)
    if "internalTrafficPolicy" in want and want["internalTrafficPolicy"] != policy:
        changed.append("spec.internalTrafficPolicy")
    return changed


def _monitor_spec_changes(want: dict[str, Any], live: dict[str, Any]) -> list[str]:
    changed = [
        f"spec.{k}" for k in ("jobLabel", "namespaceSelector", "selector") if want[k] != live.get(k)
    ]
    live_endpoints = live.get("endpoints")
    if (
        not isinstance(live_endpoints, list)
        or len(live_endpoints) != 1
        or not isinstance(live_endpoints[0], dict)
    ):
        return [*changed, "spec.endpoints"]
    for key, value in want["endpoints"][0].items():
        if live_endpoints[0].get(key) != value:
            changed.append(f"spec.endpoints[0].{key}")
    return changed


def changed_fields(desired: Desired, live: K8sObject) -> list[str]:
    """Dotted paths where the live object differs from our intent."""
    body_meta = desired.body["metadata"]
    live_labels, live_annotations = labels_of(live), annotations_of(live)
    changed = [_label_path(k) for k, v in body_meta["labels"].items() if live_labels.get(k) != v]
    if STATE_LABEL in live_labels:
        changed.append(_label_path(STATE_LABEL))
    changed += [
        _annotation_path(k)
        for k, v in body_meta["annotations"].items()
        if live_annotations.get(k) != v
    ]
    if cr_refs(live) != desired.owners:
        changed.append(OWNERS_PATH)
    if desired.kind == "Service":
        changed += _service_spec_changes(desired.body["spec"], spec(live))
    else:
        changed += _monitor_spec_changes(desired.body["spec"], spec(live))
    return changed


def _pointer(*parts: str) -> str:
    return "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts)


def preconditions_of(live: K8sObject) -> dict[str, str]:
    m = meta(live)
    return {"uid": str(m.get("uid") or ""), "resourceVersion": str(m.get("resourceVersion") or "")}


def owner_patch(
    live: K8sObject, ours: list[OwnerRef], extra: tuple[K8sObject, ...] = ()
) -> tuple[K8sObject, ...]:
    """RFC 6902 patch for what apply cannot remove: others' CR references, the state label,
    and on adoption (``extra``) the fields other managers own on our behalf.

    Guarded by uid (``test``) and resourceVersion (the API server answers 409 on mismatch).
    Empty when apply alone is enough.
    """
    refs_differ = cr_refs(live) != ours
    has_state = STATE_LABEL in labels_of(live)
    if not refs_differ and not has_state and not extra:
        return ()
    pre = preconditions_of(live)
    ops: list[K8sObject] = [
        {"op": "test", "path": "/metadata/uid", "value": pre["uid"]},
        {"op": "replace", "path": "/metadata/resourceVersion", "value": pre["resourceVersion"]},
    ]
    if refs_differ:
        op = "replace" if "ownerReferences" in meta(live) else "add"
        ops.append(
            {
                "op": op,
                "path": _pointer("metadata", "ownerReferences"),
                "value": foreign_refs(live) + ours,
            }
        )
    if has_state:
        ops.append({"op": "remove", "path": _pointer("metadata", "labels", STATE_LABEL)})
    return (*ops, *extra)


def _reason(kind: ManagedKind, what: str) -> str:
    return f"{kind}{what}"


def action_for_desired(desired: Desired, live: K8sObject | None, adopt: bool) -> Action:
    kind, name, body = desired.kind, desired.name, desired.body
    if live is None:
        return Action("create", kind, name, _reason(kind, "Created"), apply=body)
    managed = is_managed(live)
    if not managed and not adoptable(live, adopt):
        return Action("skip", kind, name, _reason(kind, "NotAdopted"))
    fields = tuple(changed_fields(desired, live))
    # Adoption takes over what the previous owner set for us, so a later apply can release it.
    takeover = None if managed else take_over_op(live, body)
    patch = owner_patch(live, desired.owners, (takeover,) if takeover else ())
    pre = preconditions_of(live) if patch else None
    if managed and not fields and not patch:
        return Action("unchanged", kind, name, "InSync")
    if not managed:
        reason = _reason(kind, "Adopted")
    elif kind == "Service" and "spec.selector" in fields:
        reason = "SelectorMigrated"
    elif set(fields) <= {OWNERS_PATH, HASH_PATH}:
        reason = "OwnersChanged"
    else:
        reason = "ConfigChanged"
    return Action(
        "update",
        kind,
        name,
        reason,
        apply=body,
        json_patch=patch,
        preconditions=pre,
        changed_fields=fields,
    )


def action_for_unneeded(kind: ManagedKind, name: str, live: K8sObject) -> Action | None:
    """A live object no CR needs: deleted when ours alone, released when a foreign owner holds it."""
    if not is_managed(live):
        return None  # not ours: never touched, never deleted
    if not foreign_refs(live):
        return Action(
            "delete", kind, name, _reason(kind, "Deleted"), preconditions=preconditions_of(live)
        )
    patch = owner_patch(live, [])
    if not patch:
        return Action("skip", kind, name, "HeldByForeignOwner")
    fields: tuple[str, ...] = (OWNERS_PATH,) if cr_refs(live) else ()
    if STATE_LABEL in labels_of(live):
        fields += (_label_path(STATE_LABEL),)
    return Action(
        "update",
        kind,
        name,
        "OwnersChanged",
        json_patch=patch,
        preconditions=preconditions_of(live),
        changed_fields=fields,
    )


# What the drain waits for beside two scrape intervals: Prometheus' discovery manager sends
# target updates every 5 s and the scrape manager applies them at most every 5 s; a target
# gone from discovery has its series marked stale a little over two intervals later, unless
# its scrape job is dropped first.
DISCOVERY_SECONDS = 10.0


def going_away(
    name: str, live: K8sObject, now: float, default_interval: float
) -> tuple[Action | None, float | None]:
    """A ServiceMonitor of ours that no CR needs (ours alone; a foreign owner's is
    released by :func:`action_for_unneeded`): made to select nothing first (and let go by
    the garbage collector: our CR references removed), deleted once it has selected
    nothing for two of its scrape intervals and ``DISCOVERY_SECONDS`` (``monitoring``'s
    module docstring). Returns the write (None: wait) and, while it waits, how long."""
    wait = 2 * scrape_interval(live, default_interval) + DISCOVERY_SECONDS
    since = drained_since(live, name)
    if since is None:
        return _drain(name, live, now), wait
    left = since + wait - now
    if left > 0:
        return None, left
    delete = Action(
        "delete",
        "ServiceMonitor",
        name,
        _reason("ServiceMonitor", "Deleted"),
        preconditions=preconditions_of(live),
    )
    return delete, None


def _drain(name: str, live: K8sObject, now: float) -> Action:
    """The write that drains a ServiceMonitor of ours: it selects nothing from ``now`` on
    (the time on the object) and loses our CR references."""
    pre = preconditions_of(live)
    annotations = meta(live).get("annotations")
    # Our CR references go with the drain: the garbage collector would take it with the
    # last of its CRs (a GPUCluster released by its finalizer) before its targets'
    # series are marked; shared-svc deletes it (the time is on the object).
    owners: tuple[K8sObject, ...] = (
        ({"op": "remove", "path": _pointer("metadata", "ownerReferences")},)
        if "ownerReferences" in meta(live)
        else ()
    )
    stamp: K8sObject = (
        {
            "op": "add",
            "path": _pointer("metadata", "annotations", DRAINED_ANNOTATION),
            "value": drain_stamp(now),
        }
        if isinstance(annotations, dict)
        else {
            "op": "add",
            "path": _pointer("metadata", "annotations"),
            "value": {DRAINED_ANNOTATION: drain_stamp(now)},
        }
    )
    ops: tuple[K8sObject, ...] = (
        {"op": "test", "path": "/metadata/uid", "value": pre["uid"]},
        {"op": "replace", "path": "/metadata/resourceVersion", "value": pre["resourceVersion"]},
        {"op": "add", "path": _pointer("spec", "selector"), "value": drained_selector(name)},
        stamp,
        *owners,
    )
    return Action(
        "update",
        "ServiceMonitor",
        name,
        "ServiceMonitorDrained",
        json_patch=ops,
        preconditions=pre,
        changed_fields=("spec.selector", OWNERS_PATH) if owners else ("spec.selector",),
    )


def _scrape_of(obj: K8sObject | None) -> str | None:
    return annotations_of(obj).get(SCRAPE_ANNOTATION) if obj is not None else None


def _common_selector(selector: Any) -> bool:
    return isinstance(selector, dict) and any(k in COMMON_LABEL.values() for k in selector)


def _selected(selector: Any, labels: dict[str, dict[str, str]]) -> frozenset[str]:
    """The Services (name -> labels after the plan) a ServiceMonitor selector selects."""
    try:
        chosen = label_selector(selector)
    except SelectorError:
        return frozenset()  # prometheus-operator rejects it: it selects nothing
    return frozenset(name for name, these in labels.items() if chosen.matches(these))


@dataclass(frozen=True)
class _Plan:
    """What the order of one action depends on, from the whole plan."""

    new_monitors: frozenset[str]  # ServiceMonitors this plan creates or adopts
    labels: dict[str, dict[str, str]]  # Service name -> its labels after the plan


def _plan_of(actions: Sequence[tuple[Action, K8sObject | None]]) -> _Plan:
    labels = {}
    for action, live in actions:
        if action.kind != "Service" or action.action == "delete":
            continue
        after = action.apply if action.apply is not None else live
        if after is not None:
            labels[action.name] = labels_of(after)
    new = frozenset(
        a.name
        for a, live in actions
        if a.kind == "ServiceMonitor"
        and a.action in ("create", "update")
        and (live is None or not is_managed(live))
    )
    return _Plan(new, labels)


def _phase(action: Action, live: K8sObject | None, whole: _Plan) -> int:
    """Coverage never dips (section 5), and every scrape-"true" exporter Service stays
    selected by exactly one of our ServiceMonitors (section 7).

    0: Service creates and widening updates (scrape turns "true", selector moves to the
    common label); 1: other Service updates; 2: ServiceMonitor creates, and updates that
    select at least the Services they selected; 3 and 4: the Service writes of 0 and 1
    whose ``MONITOR_LABEL`` names a ServiceMonitor this plan creates or adopts (after it is
    ours, so the Service's label and its selection change in that one write); 5: narrowing Service
    updates (scrape "true" -> "false", selector leaves the common label); 6: other
    ServiceMonitor updates (they select fewer: after the Services moved away); then
    deletes (ServiceMonitors before the Services they selected); then actions that write
    nothing.
    """
    if action.action in ("unchanged", "skip"):
        return 9
    if action.action == "delete":
        return 7 if action.kind == "ServiceMonitor" else 8
    body = action.apply
    if action.kind == "ServiceMonitor":
        if action.reason == "ServiceMonitorDrained":
            return 6  # selects nothing: after the Services moved away
        if body is None or live is None:
            return 2
        kept = _selected(spec(body).get("selector"), whole.labels)
        return 2 if kept >= _selected(spec(live).get("selector"), whole.labels) else 6
    late = body is not None and labels_of(body).get(MONITOR_LABEL) in whole.new_monitors
    if live is None:
        return 3 if late else 0
    if body is None:
        return 1
    want_selector = spec(body).get("selector")
    old_selector = spec(live).get("selector")
    want_scrape, old_scrape = _scrape_of(body), _scrape_of(live)
    moved = want_selector != old_selector
    if old_scrape == "true" and want_scrape == "false":
        return 5
    if moved and _common_selector(old_selector) and not _common_selector(want_selector):
        return 5
    if want_scrape == "true" and old_scrape != "true":
        return 3 if late else 0
    if moved and _common_selector(want_selector):
        return 3 if late else 0
    return 4 if late else 1


def order_actions(actions: Sequence[tuple[Action, K8sObject | None]]) -> tuple[Action, ...]:
    whole = _plan_of(actions)
    ranked = sorted(
        actions, key=lambda pair: (_phase(pair[0], pair[1], whole), pair[0].kind, pair[0].name)
    )
    return tuple(action for action, _ in ranked)
