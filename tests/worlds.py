"""Small factories for reconcile worlds, and an in-memory API server that applies plans.

Shared by tests/test_reconcile_*.py, proptests/ and benchmarks/. ``apply_plan`` simulates
what the shell and the API server do with a plan closely enough for the properties:
server-side apply by one field manager (fields it set before and no longer sends are
removed), RFC 6902 patches with the uid test and the resourceVersion guard, deletes with
preconditions, API defaulting (protocol, targetPort, type, internalTrafficPolicy) and
assignment of clusterIP and nodePorts.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from shared_svc.k8s.objects import K8sObject
from shared_svc.reconcile.model import WORLD_KINDS, Action, Plan, World

NS = "gpu-operator"
CP_API = "nvidia.com/v1"
GC_API = "nvidia.com/v1alpha1"
MANAGED = {"app.kubernetes.io/managed-by": "shared-svc"}
STATE_LABEL = "nvidia.com/gpu-operator.state"
COMMON = {
    "dcgm": "nvidia.com/gpu-operator.dcgm",
    "exporter": "nvidia.com/gpu-operator.dcgm-exporter",
}
APPS = {
    ("ClusterPolicy", "dcgm"): "nvidia-dcgm",
    ("ClusterPolicy", "exporter"): "nvidia-dcgm-exporter",
    ("GPUCluster", "dcgm"): "nvidia-dcgm-dra",
    ("GPUCluster", "exporter"): "nvidia-dcgm-exporter-dra",
}


def ts(day: int) -> str:
    """A creationTimestamp ``day`` days into 2024 (sorts as text like the API's)."""
    return f"2024-01-{day:02d}T00:00:00Z" if day < 29 else f"2024-02-{day - 28:02d}T00:00:00Z"


# ---------------------------------------------------------------- custom resources


def cluster_policy(
    name: str = "cluster-policy",
    *,
    uid: str | None = None,
    day: int = 1,
    spec: Any = None,
    deleting: bool = False,
) -> K8sObject:
    """A ClusterPolicy; ``spec=None`` is the empty spec (ClusterPolicy defaults: all on)."""
    return _cr(
        "ClusterPolicy",
        CP_API,
        name,
        uid or f"uid-cp-{name}",
        day,
        {} if spec is None else spec,
        deleting,
    )


def gpu_cluster(
    name: str = "gpu-cluster",
    *,
    uid: str | None = None,
    day: int = 2,
    spec: Any = None,
    deleting: bool = False,
) -> K8sObject:
    """A GPUCluster; ``spec=None`` enables DCGM and the exporter (GPUCluster defaults are off)."""
    if spec is None:
        spec = gc_spec()
    return _cr("GPUCluster", GC_API, name, uid or f"uid-gc-{name}", day, spec, deleting)


def gc_spec(
    *,
    dcgm: bool | None = True,
    exporter: bool | None = True,
    service: Any = None,
    monitor: Any = None,
) -> dict[str, Any]:
    """A GPUCluster/ClusterPolicy spec; ``exporter=None`` omits the dcgmExporter block."""
    spec: dict[str, Any] = {"draDriver": {}}
    if dcgm is not None:
        spec["dcgm"] = {"enabled": dcgm}
    if exporter is not None:
        block: dict[str, Any] = {"enabled": exporter}
        if service is not None:
            block["service"] = service
        if monitor is not None:
            block["serviceMonitor"] = monitor
        spec["dcgmExporter"] = block
    return spec


def _cr(kind: str, api: str, name: str, uid: str, day: int, spec: Any, deleting: bool) -> K8sObject:
    meta: dict[str, Any] = {"name": name, "uid": uid, "creationTimestamp": ts(day), "generation": 1}
    if deleting:
        meta["deletionTimestamp"] = ts(day + 1)
    return {"apiVersion": api, "kind": kind, "metadata": meta, "spec": spec}


def cr_ref(cr: K8sObject, *, controller: bool = False) -> dict[str, Any]:
    return {
        "apiVersion": cr["apiVersion"],
        "kind": cr["kind"],
        "name": cr["metadata"]["name"],
        "uid": cr["metadata"]["uid"],
        "controller": controller,
        "blockOwnerDeletion": controller,
    }


def foreign_ref(name: str = "keeper", uid: str = "uid-foreign") -> dict[str, Any]:
    return {"apiVersion": "example.com/v1", "kind": "Keeper", "name": name, "uid": uid}


# ---------------------------------------------------------------- workloads


def app_labels(app: str, *, common: bool = True) -> dict[str, str]:
    """A workload's ``app`` label and, when ``common``, its component's common label."""
    labels = {"app": app}
    if common:
        labels[COMMON["exporter" if "exporter" in app else "dcgm"]] = "true"
    return labels


def daemonset(
    app: str,
    *,
    common: bool = True,
    desired: int = 2,
    updated: int | None = None,
    available: int | None = None,
    generation: int = 1,
    observed: int | None = None,
    on_delete: bool = False,
) -> K8sObject:
    """A DaemonSet named like its ``app`` label; complete rollout unless told otherwise."""
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {
            "name": app,
            "namespace": NS,
            "uid": f"uid-ds-{app}",
            "generation": generation,
        },
        "spec": {
            "selector": {"matchLabels": {"app": app}},
            "updateStrategy": {"type": "OnDelete" if on_delete else "RollingUpdate"},
            "template": {"metadata": {"labels": app_labels(app, common=common)}},
        },
        "status": {
            "observedGeneration": generation if observed is None else observed,
            "desiredNumberScheduled": desired,
            "updatedNumberScheduled": desired if updated is None else updated,
            "numberAvailable": desired if available is None else available,
        },
    }


def pod(
    app: str,
    name: str,
    *,
    common: bool = True,
    ready: bool = True,
    deleting: bool = False,
    node: str | None = None,
) -> K8sObject:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": NS,
        "labels": app_labels(app, common=common),
        "uid": f"uid-pod-{name}",
    }
    if deleting:
        meta["deletionTimestamp"] = ts(3)
    condition = {"type": "Ready", "status": "True" if ready else "False"}
    body: K8sObject = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "status": {"conditions": [condition]},
    }
    if node is not None:
        body["spec"] = {"nodeName": node}
    return body


def stack(
    kind: str,
    *,
    common: bool = True,
    pods: int = 2,
    components: Iterable[str] = ("dcgm", "exporter"),
) -> list[K8sObject]:
    """DaemonSets plus pods of one stack, fully rolled out (with or without the common label)."""
    out: list[K8sObject] = []
    for component in components:
        app = APPS[(kind, component)]
        out.append(daemonset(app, common=common, desired=pods))
        out.extend(pod(app, f"{app}-{i}", common=common) for i in range(pods))
    return out


# ---------------------------------------------------------------- live Services / ServiceMonitors


def service(
    name: str,
    *,
    managed: bool = False,
    owners: Iterable[Mapping[str, Any]] = (),
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    selector: Mapping[str, str] | None = None,
    spec: Mapping[str, Any] | None = None,
    uid: str | None = None,
    rv: str = "7",
) -> K8sObject:
    """A live Service as the API returns it (clusterIP assigned, defaults filled)."""
    all_labels = {"app": name, **(labels or {})}
    if managed:
        all_labels.update(MANAGED)
    port = 5555 if name in ("nvidia-dcgm", "nvidia-dcgm-dra") else 9400
    body_spec: dict[str, Any] = {
        "selector": dict(selector or {"app": name}),
        "ports": [
            {
                "name": "dcgm" if port == 5555 else "gpu-metrics",
                "port": port,
                "targetPort": port,
                "protocol": "TCP",
            }
        ],
        "type": "ClusterIP",
        "clusterIP": "10.0.0.1",
        "clusterIPs": ["10.0.0.1"],
        "internalTrafficPolicy": "Local" if port == 5555 else "Cluster",
        "ipFamilies": ["IPv4"],
        "ipFamilyPolicy": "SingleStack",
        **(spec or {}),
    }
    meta: dict[str, Any] = {
        "name": name,
        "namespace": NS,
        "uid": uid or f"uid-svc-{name}",
        "resourceVersion": rv,
        "labels": all_labels,
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    if owners:
        meta["ownerReferences"] = [dict(o) for o in owners]
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": body_spec}


def gpu_operator_service(name: str, cr: K8sObject) -> K8sObject:
    """A Service as gpu-operator's built-in controllers leave it: controller ref, state label (GPUCluster)."""
    labels = (
        {STATE_LABEL: "state-dcgm-exporter" if "exporter" in name else "state-dcgm"}
        if cr["kind"] == "GPUCluster"
        else {}
    )
    annotations = {"prometheus.io/scrape": "true"} if "exporter" in name else None
    return service(
        name, owners=[cr_ref(cr, controller=True)], labels=labels, annotations=annotations
    )


def service_monitor(
    name: str,
    *,
    match_labels: Mapping[str, str] | None = None,
    managed: bool = False,
    owners: Iterable[Mapping[str, Any]] = (),
    uid: str | None = None,
) -> K8sObject:
    labels = {"app": name, **(MANAGED if managed else {})}
    meta: dict[str, Any] = {
        "name": name,
        "namespace": NS,
        "uid": uid or f"uid-sm-{name}",
        "resourceVersion": "5",
        "labels": labels,
    }
    if owners:
        meta["ownerReferences"] = [dict(o) for o in owners]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": meta,
        "spec": {
            "jobLabel": "app",
            "namespaceSelector": {"matchNames": [NS]},
            "selector": {"matchLabels": dict(match_labels or {"app": name})},
            "endpoints": [{"port": "gpu-metrics", "path": "/metrics"}],
        },
    }


# ---------------------------------------------------------------- gpu-operator's GPUCluster controller

# The state of each object the GPUCluster controller renders (its state label's value).
GC_STATES = {
    ("Service", "nvidia-dcgm-dra"): "state-dcgm",
    ("Service", "nvidia-dcgm-exporter-dra"): "state-dcgm-exporter",
    ("ServiceMonitor", "nvidia-dcgm-exporter-dra"): "state-dcgm-exporter",
}


def gpu_cluster_objects(
    gc: K8sObject, namespace: str = NS, *, monitors: bool = True
) -> list[K8sObject]:
    """What gpu-operator v26.7.0's GPUCluster controller writes for ``gc`` (facts 1.1, 4 and
    10), in its order, as the bodies it sends: ``nvidia-dcgm-dra`` (``dcgm.enabled: true``),
    ``nvidia-dcgm-exporter-dra`` (the exporter on) and, with its ``serviceMonitor.enabled``
    and the API served (``monitors``), the ServiceMonitor ``nvidia-dcgm-exporter-dra``; each
    with a controller reference to ``gc`` and the state label. The one rendering of it
    (tests/admission.py ``SimulatedGpuCluster`` writes these to an API server)."""
    spec = gc.get("spec") or {}
    block = spec.get("dcgmExporter")
    exporter = isinstance(block, dict) and block.get("enabled") is not False
    block = block if isinstance(block, dict) else {}
    out = []
    if (spec.get("dcgm") or {}).get("enabled") is True:
        out.append(_gc_service(gc, namespace, "nvidia-dcgm-dra", {}))
    if exporter:
        out.append(
            _gc_service(gc, namespace, "nvidia-dcgm-exporter-dra", block.get("service") or {})
        )
        monitor = block.get("serviceMonitor") or {}
        if monitors and monitor.get("enabled") is True:
            out.append(_gc_service_monitor(gc, namespace, monitor))
    return out


def _gc_metadata(gc: K8sObject, namespace: str, kind: str, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "labels": {"app": name, STATE_LABEL: GC_STATES[(kind, name)]},
        "ownerReferences": [cr_ref(gc, controller=True)],
    }


def _gc_service(gc: K8sObject, namespace: str, name: str, settings: dict[str, Any]) -> K8sObject:
    metadata = _gc_metadata(gc, namespace, "Service", name)
    if name == "nvidia-dcgm-dra":
        port = {"name": "dcgm", "port": 5555, "targetPort": 5555, "protocol": "TCP"}
        spec: dict[str, Any] = {"type": "ClusterIP", "internalTrafficPolicy": "Local"}
    else:
        metadata["annotations"] = {"prometheus.io/scrape": "true"}
        port = {"name": "gpu-metrics", "port": 9400, "targetPort": 9400, "protocol": "TCP"}
        spec = {"type": settings.get("type") or "ClusterIP"}
        if settings.get("internalTrafficPolicy"):
            spec["internalTrafficPolicy"] = settings["internalTrafficPolicy"]
    spec.update({"selector": {"app": name}, "ports": [port]})
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata, "spec": spec}


def _gc_service_monitor(gc: K8sObject, namespace: str, settings: dict[str, Any]) -> K8sObject:
    """manifests/state-dcgm-exporter/0600_service_monitor.yaml (facts 4)."""
    name = "nvidia-dcgm-exporter-dra"
    metadata = _gc_metadata(gc, namespace, "ServiceMonitor", name)
    extra = {str(k): str(v) for k, v in (settings.get("additionalLabels") or {}).items()}
    metadata["labels"] = {"app": name, **extra, STATE_LABEL: GC_STATES[("ServiceMonitor", name)]}
    endpoint: dict[str, Any] = {"port": "gpu-metrics", "path": "/metrics"}
    for key in ("interval", "scrapeTimeout"):
        if settings.get(key):
            endpoint[key] = settings[key]
    endpoint["honorLabels"] = settings.get("honorLabels") is True  # always emitted
    if settings.get("relabelings"):
        endpoint["relabelings"] = settings["relabelings"]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": metadata,
        "spec": {
            "jobLabel": "app",
            "namespaceSelector": {"matchNames": [namespace]},
            "selector": {"matchLabels": {"app": name}},
            "endpoints": [endpoint],
        },
    }


_FIELDS = WORLD_KINDS  # kind -> World field


def world(*objects: K8sObject | Iterable[K8sObject]) -> World:
    """A World from objects (or lists of them), sorted into fields by kind."""
    buckets: dict[str, list[K8sObject]] = {f: [] for f in _FIELDS.values()}
    for item in objects:
        for obj in [item] if isinstance(item, dict) else item:
            buckets[_FIELDS[obj["kind"]]].append(obj)
    return World(**{k: tuple(v) for k, v in buckets.items()})


def with_objects(base: World, *objects: K8sObject) -> World:
    """``base`` with objects replaced (same kind and name) or added."""
    fields = {f: list(getattr(base, f)) for f in _FIELDS.values()}
    for obj in objects:
        items = fields[_FIELDS[obj["kind"]]]
        items[:] = [o for o in items if o["metadata"]["name"] != obj["metadata"]["name"]] + [obj]
    return World(**{k: tuple(v) for k, v in fields.items()})


def without(base: World, kind: str, name: str) -> World:
    field = _FIELDS[kind]
    return replace(
        base, **{field: tuple(o for o in getattr(base, field) if o["metadata"]["name"] != name)}
    )


def find(base: World, kind: str, name: str) -> K8sObject | None:
    return next((o for o in getattr(base, _FIELDS[kind]) if o["metadata"]["name"] == name), None)


def action_of(plan: Plan, kind: str, name: str) -> Action:
    return next(a for a in plan.actions if a.kind == kind and a.name == name)


# ---------------------------------------------------------------- the in-memory API server


class PreconditionFailed(Exception):
    """409: the uid or resourceVersion of the target changed."""


_UIDS = itertools.count(1)
_LAST_APPLIED = "shared-svc"


def apply_plan(base: World, plan: Plan) -> World:
    """The world after the shell executed ``plan`` against an API server."""
    stores = {
        "Service": {o["metadata"]["name"]: copy.deepcopy(o) for o in base.services},
        "ServiceMonitor": {o["metadata"]["name"]: copy.deepcopy(o) for o in base.service_monitors},
    }
    rv = itertools.count(_max_rv(base) + 1)
    for action in plan.writes:
        store = stores[action.kind]
        live = store.get(action.name)
        if action.action == "delete":
            if live is None or _preconditions(live) != action.preconditions:
                raise PreconditionFailed(f"delete {action.kind}/{action.name}")
            del store[action.name]
            continue
        if action.json_patch:
            if live is None:
                raise PreconditionFailed(f"patch of missing {action.kind}/{action.name}")
            live = json_patch(live, action.json_patch)
            live["metadata"]["resourceVersion"] = str(next(rv))
        if action.apply is not None:
            live = server_side_apply(live, action.apply)
            live["metadata"]["resourceVersion"] = str(next(rv))
        assert live is not None
        store[action.name] = live
    return replace(
        base,
        services=tuple(stores["Service"][n] for n in sorted(stores["Service"])),
        service_monitors=tuple(
            stores["ServiceMonitor"][n] for n in sorted(stores["ServiceMonitor"])
        ),
    )


def _max_rv(base: World) -> int:
    rvs = [
        o["metadata"].get("resourceVersion", "0") for o in (*base.services, *base.service_monitors)
    ]
    return max((int(r) for r in rvs if str(r).isdigit()), default=0)


def _preconditions(live: K8sObject) -> dict[str, str]:
    return {
        "uid": str(live["metadata"].get("uid", "")),
        "resourceVersion": str(live["metadata"].get("resourceVersion", "")),
    }


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def json_patch(live: K8sObject, ops: Iterable[K8sObject]) -> K8sObject:
    """RFC 6902 subset (test/add/replace/remove on object paths) plus the API's rv guard."""
    obj = copy.deepcopy(live)
    for op in ops:
        *parents, last = [_unescape(t) for t in op["path"].split("/")[1:]]
        target = obj
        for part in parents:
            target = target[part]
        if op["path"] == "/metadata/resourceVersion":
            # The API server rejects a patch whose resourceVersion is not the current one.
            if str(op["value"]) != str(live["metadata"].get("resourceVersion", "")):
                raise PreconditionFailed("resourceVersion changed")
            continue
        if op["op"] == "test":
            if target.get(last) != op["value"]:
                raise PreconditionFailed(f"test failed at {op['path']}")
        elif op["op"] == "add":
            target[last] = copy.deepcopy(op["value"])
        elif op["op"] == "replace":
            if last not in target:
                raise PreconditionFailed(f"replace of missing {op['path']}")
            target[last] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            if last not in target:
                raise PreconditionFailed(f"remove of missing {op['path']}")
            del target[last]
    if obj["metadata"].get("ownerReferences") == []:
        del obj["metadata"]["ownerReferences"]
    return obj


def server_side_apply(live: K8sObject | None, body: K8sObject) -> K8sObject:
    """Apply ``body`` as field manager shared-svc: set what it sends, drop what it no longer sends."""
    body = copy.deepcopy(body)
    if live is None:
        obj: K8sObject = {
            "apiVersion": body["apiVersion"],
            "kind": body["kind"],
            "metadata": {
                "name": body["metadata"]["name"],
                "namespace": body["metadata"]["namespace"],
                "uid": f"uid-new-{next(_UIDS)}",
            },
            "spec": {},
        }
    else:
        obj = copy.deepcopy(live)
    meta, prev = obj["metadata"], _last_applied(obj)
    prev_meta = prev.get("metadata", {})
    for section in ("labels", "annotations"):
        current = dict(meta.get(section) or {})
        for key in prev_meta.get(section, {}):
            if key not in body["metadata"][section]:
                current.pop(key, None)
        current.update(body["metadata"][section])
        meta[section] = current
    # ownerReferences is a list map keyed by uid.
    new_refs = body["metadata"]["ownerReferences"]
    dropped = {r["uid"] for r in prev_meta.get("ownerReferences", [])} - {
        r["uid"] for r in new_refs
    }
    refs = [r for r in meta.get("ownerReferences", []) if r["uid"] not in dropped]
    for ref in new_refs:
        index = next((i for i, r in enumerate(refs) if r["uid"] == ref["uid"]), None)
        if index is None:
            refs.append(ref)
        else:
            refs[index] = ref
    if refs:
        meta["ownerReferences"] = refs
    else:
        meta.pop("ownerReferences", None)
    spec = obj.setdefault("spec", {})
    for key in prev.get("spec", {}):
        if key not in body["spec"]:
            spec.pop(key, None)
    spec.update(body["spec"])
    if obj["kind"] == "Service":
        _service_defaults(spec, live)
    meta["managedFields"] = [{"manager": _LAST_APPLIED, "operation": "Apply", "applied": body}]
    return obj


def _last_applied(obj: K8sObject) -> dict[str, Any]:
    for entry in obj["metadata"].get("managedFields", []):
        if entry.get("manager") == _LAST_APPLIED and "applied" in entry:
            applied: dict[str, Any] = entry["applied"]
            return applied
    return {}


def _service_defaults(spec: dict[str, Any], live: K8sObject | None) -> None:
    live_spec = live.get("spec", {}) if live else {}
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("internalTrafficPolicy", "Cluster")
    spec.setdefault("sessionAffinity", "None")
    for key, value in (
        ("clusterIP", "10.0.9.9"),
        ("clusterIPs", ["10.0.9.9"]),
        ("ipFamilies", ["IPv4"]),
        ("ipFamilyPolicy", "SingleStack"),
    ):
        spec.setdefault(key, live_spec.get(key, value))
    live_ports = {p.get("name"): p for p in live_spec.get("ports", []) if isinstance(p, dict)}
    for number, port in enumerate(spec.get("ports", [])):
        port.setdefault("protocol", "TCP")
        port.setdefault("targetPort", port["port"])
        if spec["type"] in ("NodePort", "LoadBalancer"):
            port.setdefault(
                "nodePort", live_ports.get(port.get("name"), {}).get("nodePort", 30000 + number)
            )
        else:
            port.pop("nodePort", None)


# ---------------------------------------------------------------- reading plans


def settled(base: World, settings: Any = None, rounds: int = 3) -> World:
    """Plan and apply until nothing is written (a fixed point), at most ``rounds`` times."""
    from shared_svc.reconcile.model import Settings
    from shared_svc.reconcile.planner import plan

    settings = settings or Settings()
    for _ in range(rounds):
        result = plan(base, settings)
        if not result.writes:
            return base
        base = apply_plan(base, result)
    raise AssertionError("no fixed point: the plan keeps writing")


def manifest(plan: Plan, kind: str, name: str) -> K8sObject:
    return next(o for o in plan.objects if o["kind"] == kind and o["metadata"]["name"] == name)


def owner_names(obj: K8sObject) -> list[str]:
    return [f"{r['kind']}/{r['name']}" for r in obj["metadata"].get("ownerReferences", [])]
