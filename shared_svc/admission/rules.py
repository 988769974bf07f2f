"""Pure admission decisions: what the guard does with one request (no I/O).

- ``decide_update``: a whole-object UPDATE by gpu-operator (a controller owner reference to
  a ClusterPolicy or GPUCluster) of an object shared-svc manages gets a JSON patch that puts
  back, from the old object, everything shared-svc owns: labels, annotations, spec,
  ownerReferences and managedFields. The update then changes nothing (no new
  resourceVersion). Any other request: ``None`` (never changed).
- ``decide_delete``: gpu-operator's DELETE of an object a CR still needs (shared-svc's last
  plan) is answered ``404 NotFound``, which gpu-operator takes as "already deleted" (a 403
  would stall its later states). Every other delete is allowed. The object is named by the
  request, or, in a delete of a collection (the API server asks once per object with no
  name: the GPUCluster's clean-up deletes by the state label), by ``oldObject``. A dry-run
  DELETE is answered as gpu-operator's, by whomever: it removes nothing, and the chart's
  ``matchConditions`` send the webhook no dry run but shared-svc's own guard probe
  (``admission.probe``), which reads the answer to know the API server reached the guard.
- ``review``: one AdmissionReview v1 request in, its response out.

The MutatingAdmissionPolicy in the chart (templates/admission-policy.yaml) expresses the
same ``decide_update`` in CEL; tests/test_admission_guard.py proves both on the API
server.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shared_svc.k8s.managed_fields import managed_fields
from shared_svc.reconcile.names import SERVICE_MONITOR_NAMES, SERVICE_NAMES
from shared_svc.reconcile.owners import cr_refs, is_managed

# Marks the admission objects (policy binding, webhook configurations) that guard the
# namespace given as the label's value; shared-svc looks for them to report the guard.
GUARD_LABEL = "nvidia.com/shared-svc.guard"
# What shared-svc owns on its objects: (JSON pointer, path in the object).
RESTORED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("/metadata/labels", ("metadata", "labels")),
    ("/metadata/annotations", ("metadata", "annotations")),
    ("/metadata/ownerReferences", ("metadata", "ownerReferences")),
    ("/metadata/managedFields", ("metadata", "managedFields")),
    ("/spec", ("spec",)),
)
GUARDED: dict[str, tuple[str, ...]] = {
    "Service": SERVICE_NAMES,
    # The canonical one and the GPUCluster's own nvidia-dcgm-exporter-dra (section 7).
    "ServiceMonitor": SERVICE_MONITOR_NAMES,
}
RESOURCE_KINDS = {"services": "Service", "servicemonitors": "ServiceMonitor"}
# The warning of an allowed dry-run delete (the guard probe reads it: answered, not needed).
PROBE_ALLOWED = "shared-svc's delete guard allows this delete: no CR needs the object"


class BadReview(ValueError):
    """The request body is not an AdmissionReview v1 request."""


def operator_username(namespace: str, service_account: str) -> str:
    """The user name gpu-operator's requests carry (its ServiceAccount)."""
    return f"system:serviceaccount:{namespace}:{service_account}"


def is_guarded(kind: str, name: str) -> bool:
    return name in GUARDED.get(kind, ())


def managed_by_us(obj: Mapping[str, Any] | None) -> bool:
    return obj is not None and is_managed(obj)


def operator_controller_ref(obj: Mapping[str, Any] | None) -> bool:
    """The object carries a controller reference to a ClusterPolicy or GPUCluster: the
    shape of gpu-operator's whole-object writes (shared-svc never sets ``controller``)."""
    return obj is not None and any(r.get("controller") is True for r in cr_refs(obj))


def _get(obj: Mapping[str, Any], path: Sequence[str]) -> tuple[bool, Any]:
    node: Any = obj
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return False, None
        node = node[key]
    return True, node


def decide_update(
    old: Mapping[str, Any] | None,
    new: Mapping[str, Any] | None,
    *,
    kind: str,
    namespace: str,
    request_namespace: str | None,
) -> list[dict[str, Any]] | None:
    """The JSON patch that neutralises gpu-operator's UPDATE, or None: not ours to change."""
    if old is None or new is None or request_namespace != namespace:
        return None
    name = (new.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not is_guarded(kind, name):
        return None
    if not managed_by_us(old) or not operator_controller_ref(new):
        return None
    ops: list[dict[str, Any]] = []
    for pointer, path in RESTORED:
        had, value = _get(old, path)
        has, _ = _get(new, path)
        if had:
            ops.append({"op": "add", "path": pointer, "value": value})
        elif has:
            ops.append({"op": "remove", "path": pointer})
    return ops


@dataclass(frozen=True)
class DeleteVerdict:
    allowed: bool
    code: int = 200
    reason: str = ""
    message: str = ""


def decide_delete(
    *,
    kind: str,
    name: str,
    request_namespace: str | None,
    namespace: str,
    username: str,
    operator_users: Iterable[str],
    needed_by: Mapping[tuple[str, str], Sequence[str]] | None,
    dry_run: bool = False,
) -> DeleteVerdict:
    """404 for gpu-operator's delete of an object a CR still needs; allowed otherwise.

    ``needed_by`` is shared-svc's own view (its last plan): (kind, name) -> the CRs that
    need the object. ``None`` (no plan yet) allows: the guard fails open, like the
    webhook's ``failurePolicy: Ignore``. A dry run is judged as gpu-operator's (the guard
    probe), and an allowed one says why in its message (``PROBE_ALLOWED``): the probe
    tells "the guard answered: allowed" from "the API server never asked".
    """
    if request_namespace != namespace or not is_guarded(kind, name):
        return DeleteVerdict(True)
    if username not in set(operator_users) and not dry_run:
        return DeleteVerdict(True)  # shared-svc's own deletes, a user's
    if needed_by is None:
        return DeleteVerdict(True, message="shared-svc has no plan yet: allowed")
    needers = list(needed_by.get((kind, name), ()))
    if not needers:
        # the last CR that needed it let it go
        return DeleteVerdict(True, message=PROBE_ALLOWED if dry_run else "")
    return DeleteVerdict(
        False,
        code=404,
        reason="NotFound",
        message=(
            f'{kind.lower()}s "{name}" not found (shared-svc keeps it: still needed by '
            f"{', '.join(needers)})"
        ),
    )


def review(
    body: Any,
    *,
    namespace: str,
    operator_users: Iterable[str],
    needed_by: Mapping[tuple[str, str], Sequence[str]] | None,
) -> dict[str, Any]:
    """One AdmissionReview v1 request -> its response (mutating and validating alike).

    Raises ``BadReview`` (a one-line message) when the body is not an AdmissionReview.
    """
    if not isinstance(body, Mapping) or body.get("kind") != "AdmissionReview":
        raise BadReview("not an AdmissionReview")
    if body.get("apiVersion") != "admission.k8s.io/v1":
        raise BadReview(f"unsupported AdmissionReview version {body.get('apiVersion')!r}")
    request = body.get("request")
    if not isinstance(request, Mapping) or not isinstance(request.get("uid"), str):
        raise BadReview("AdmissionReview without request.uid")
    resource = request.get("resource") or {}
    kind = RESOURCE_KINDS.get(resource.get("resource", "") if isinstance(resource, Mapping) else "")
    response: dict[str, Any] = {"uid": request["uid"], "allowed": True}
    operation = request.get("operation")
    if kind is not None and not request.get("subResource"):
        if operation == "UPDATE":
            ops = decide_update(
                _mapping(request.get("oldObject")),
                _mapping(request.get("object")),
                kind=kind,
                namespace=namespace,
                request_namespace=request.get("namespace"),
            )
            if ops is not None:
                response["patchType"] = "JSONPatch"
                response["patch"] = base64.b64encode(json.dumps(ops).encode()).decode()
        elif operation == "DELETE":
            user = request.get("userInfo") or {}
            verdict = decide_delete(
                kind=kind,
                name=deleted_name(request),
                request_namespace=request.get("namespace"),
                namespace=namespace,
                username=str(user.get("username", "")) if isinstance(user, Mapping) else "",
                operator_users=operator_users,
                needed_by=needed_by,
                dry_run=request.get("dryRun") is True,
            )
            if not verdict.allowed:
                response["allowed"] = False
                response["status"] = {
                    "code": verdict.code,
                    "reason": verdict.reason,
                    "message": verdict.message,
                }
            elif verdict.message:
                response["warnings"] = [verdict.message]
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


def _mapping(value: Any) -> Mapping[str, Any] | None:
    return value if isinstance(value, Mapping) else None


def deleted_name(request: Mapping[str, Any]) -> str:
    """The name of the object a DELETE removes: ``request.name``, or, for each object of a
    delete of a collection (``request.name`` empty), ``oldObject.metadata.name``."""
    name = request.get("name")
    if isinstance(name, str) and name:
        return name
    old = _mapping(request.get("oldObject")) or {}
    meta = _mapping(old.get("metadata")) or {}
    found = meta.get("name")
    return found if isinstance(found, str) else ""


# --- who writes: the start-up Warning (ConflictingWriter is reconcile.fight's) ---


def operator_writes(objects: Iterable[Mapping[str, Any]], manager: str) -> list[str]:
    """``Kind/name`` of each object under one of our names that carries a managedFields
    entry of gpu-operator's field manager. Adoption takes those entries over, so after it
    an entry means gpu-operator wrote the object again (its whole-object PUT may have
    removed our label too: the name, not the label, says the object is ours)."""
    out = []
    for obj in objects:
        meta = obj.get("metadata") or {}
        if not is_guarded(str(obj.get("kind", "")), str(meta.get("name", ""))):
            continue
        if any(e.get("manager") == manager for e in managed_fields(dict(obj))):
            out.append(f"{obj.get('kind', '?')}/{meta.get('name', '?')}")
    return sorted(out)
