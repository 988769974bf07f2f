"""Owner references and adoption (contract section 5).

Every CR that needs an object owns it through a non-controller reference, so Kubernetes'
garbage collector removes the object only when all of them are gone, and no stack's
built-in controller can claim it as the single controller.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from shared_svc.k8s.objects import K8sObject, labels_of, owner_refs
from shared_svc.reconcile.names import CR_GROUP, MANAGED_BY_LABEL, MANAGED_BY_VALUE
from shared_svc.reconcile.specs import CLUSTER_POLICY, GPU_CLUSTER, CRSpec

OwnerRef = dict[str, Any]


def _sort_key(ref: OwnerRef) -> tuple[str, str, str, str]:
    return (
        str(ref.get("apiVersion")),
        str(ref.get("kind")),
        str(ref.get("name")),
        str(ref.get("uid")),
    )


def cr_owner_ref(cr: CRSpec) -> OwnerRef:
    return {
        "apiVersion": cr.api_version,
        "kind": cr.kind,
        "name": cr.name,
        "uid": cr.uid,
        "controller": False,
        "blockOwnerDeletion": False,
    }


def owner_refs_for(crs: Iterable[CRSpec]) -> list[OwnerRef]:
    """One reference per needing CR, sorted by (apiVersion, kind, name, uid)."""
    return sorted((cr_owner_ref(cr) for cr in crs), key=_sort_key)


def is_cr_ref(ref: OwnerRef) -> bool:
    """A reference to a ClusterPolicy or GPUCluster (any version, any uid)."""
    api_version = ref.get("apiVersion")
    group = api_version.partition("/")[0] if isinstance(api_version, str) else ""
    return group == CR_GROUP and ref.get("kind") in (CLUSTER_POLICY, GPU_CLUSTER)


def cr_refs(obj: Mapping[str, Any]) -> list[OwnerRef]:
    return [r for r in owner_refs(obj) if is_cr_ref(r)]


def foreign_refs(obj: K8sObject) -> list[OwnerRef]:
    """References we never touch, in their live order."""
    return [r for r in owner_refs(obj) if not is_cr_ref(r)]


def is_managed(obj: Mapping[str, Any]) -> bool:
    """Carries our managed-by label (the admission guard asks the same)."""
    return labels_of(obj).get(MANAGED_BY_LABEL) == MANAGED_BY_VALUE


def adoptable(obj: K8sObject, adopt: bool) -> bool:
    """An unmanaged same-named object is adopted when only our CRs (or nobody) own it."""
    return adopt and not foreign_refs(obj)


def kept_owner_refs(obj: K8sObject | None, desired: list[OwnerRef]) -> list[OwnerRef]:
    """The full list after the plan: foreign references as they are, then ours."""
    return (foreign_refs(obj) if obj is not None else []) + desired
