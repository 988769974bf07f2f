"""Where objects live on the API server: the one way to build API paths.

:class:`GVR` (group, version, resource) builds the path of a collection, of one object
and of its subresources; :class:`Resource` is a GVR as a cache watches it (namespace,
selectors, projection, metadata only). Which resources shared-svc caches, and how, is
declared once outside ``kube/``: ``shared_svc.controllers.services.caches``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote

from shared_svc.k8s.objects import K8sObject
from shared_svc.kube.decode import ALL, SKIP, Closed, Decoder

# Media types of answers (``Accept``): whole objects, or the API server's own
# PartialObjectMetadata (one object, or each object of a watch) and its list.
JSON = "application/json"
METADATA = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"


def _segment(text: str) -> str:
    return quote(text, safe="")


@dataclass(frozen=True)
class GVR:
    """A resource of an API group version; group ``""`` is the core API (``/api/v1``)."""

    group: str
    version: str
    plural: str

    @property
    def group_version(self) -> str:
        """``/api/v1`` or ``/apis/<group>/<version>``."""
        return f"/api/{self.version}" if not self.group else f"/apis/{self.group}/{self.version}"

    def collection(self, namespace: str | None = None) -> str:
        """All objects (of ``namespace``, when given)."""
        where = f"/namespaces/{_segment(namespace)}" if namespace else ""
        return f"{self.group_version}{where}/{self.plural}"

    def item(self, name: str, namespace: str | None = None, subresource: str | None = None) -> str:
        """One object (``namespace`` for a namespaced one), or one of its subresources."""
        path = f"{self.collection(namespace)}/{_segment(name)}"
        return f"{path}/{subresource}" if subresource else path


SERVICES = GVR("", "v1", "services")
PODS = GVR("", "v1", "pods")
NODES = GVR("", "v1", "nodes")
SECRETS = GVR("", "v1", "secrets")
DAEMONSETS = GVR("apps", "v1", "daemonsets")
LEASES = GVR("coordination.k8s.io", "v1", "leases")
EVENTS = GVR("events.k8s.io", "v1", "events")
SERVICE_MONITORS = GVR("monitoring.coreos.com", "v1", "servicemonitors")
CUSTOM_RESOURCE_DEFINITIONS = GVR("apiextensions.k8s.io", "v1", "customresourcedefinitions")
MUTATING_POLICY_BINDINGS = GVR(
    "admissionregistration.k8s.io", "v1", "mutatingadmissionpolicybindings"
)
MUTATING_WEBHOOKS = GVR("admissionregistration.k8s.io", "v1", "mutatingwebhookconfigurations")
VALIDATING_WEBHOOKS = GVR("admissionregistration.k8s.io", "v1", "validatingwebhookconfigurations")


@dataclass(frozen=True)
class Resource:
    """A kind as a cache watches it: where it lives and what of each object is kept."""

    group: str
    version: str
    plural: str
    kind: str
    namespace: str | None = None  # None: cluster-scoped, or all namespaces
    label_selector: str | None = None
    field_selector: str | None = None
    crd_name: str | None = None  # set for custom resources
    # What of each object is kept (a pure function; None: the whole object).
    project: Callable[[K8sObject], K8sObject] | None = None
    # Ask the API server for PartialObjectMetadata (the Accept header of lists and
    # watches): only metadata is sent, parsed and kept (``metadata_view``), then ``project``.
    metadata_only: bool = False
    # The union of these label selectors (instead of ``label_selector``): one list+watch
    # each, merged into one store (``kube.union.UnionCache``). Disjoint selectors keep
    # each object once.
    any_of: tuple[str, ...] = ()
    # Decodes list pages and watch events into the fields ``project`` (or
    # ``metadata_view``) reads, the rest skipped (``kube.decode``); None: ``json.loads``.
    # One instance per shape (a module constant): declarations compare by it.
    decoder: Decoder | None = None
    # What the cache is called (the ``resource`` label of ``shared_svc_cache_synced``,
    # ``/status``): the plural unless two caches of one kind need two names.
    name: str | None = None

    @property
    def cache_name(self) -> str:
        return self.name or self.plural

    @property
    def gvr(self) -> GVR:
        return GVR(self.group, self.version, self.plural)

    @property
    def api_version(self) -> str:
        """``v1`` or ``<group>/<version>``, as objects carry it."""
        return f"{self.group}/{self.version}" if self.group else self.version

    def kept(self, obj: K8sObject) -> K8sObject:
        """What a cache keeps of ``obj`` (a list item or a watch event's object).

        A metadata-only resource keeps ``metadata_view``; ``project``, when set, is
        applied after. A list item lacks ``kind``/``apiVersion``: the resource's are set."""
        if self.metadata_only:
            obj = metadata_view(obj, self.api_version, self.kind)
        else:
            obj.setdefault("apiVersion", self.api_version)
            obj.setdefault("kind", self.kind)
        return self.project(obj) if self.project else obj

    @property
    def path(self) -> str:
        return self.gvr.collection(self.namespace)

    def describe(self) -> str:
        where = f" in {self.namespace}" if self.namespace else ""
        which = f" ({self.label_selector})" if self.label_selector else ""
        return f"{self.kind}{where}{which}"


def metadata_view(obj: K8sObject, api_version: str, kind: str) -> K8sObject:
    """``obj`` as a metadata-only cache keeps it: ``{apiVersion, kind, metadata}`` with
    ``metadata.managedFields`` dropped (nothing reads it; a node's runs to kilobytes).

    The API server sends such objects as ``PartialObjectMetadata``
    (``meta.k8s.io/v1``); they are kept under the resource's own ``kind`` and
    ``apiVersion`` (``Node``, ``v1``), so readers see the Node they would have read, less
    its spec and status. Pure: a whole object gives the same view (the property tests
    plan over both)."""
    meta = obj.get("metadata")
    kept = {k: v for k, v in meta.items() if k != "managedFields"} if isinstance(meta, dict) else {}
    return {"apiVersion": api_version, "kind": kind, "metadata": kept}


# Every field of ObjectMeta (k8s.io/apimachinery meta/v1): a metadata view keeps all but
# managedFields, so a metadata-only cache decodes these and skips that one; a text whose
# metadata holds another key is read the exact way.
OBJECT_META = (
    "name",
    "generateName",
    "namespace",
    "selfLink",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "labels",
    "annotations",
    "ownerReferences",
    "finalizers",
)
METADATA_DECODER = Decoder(
    {
        "apiVersion": ALL,
        "kind": ALL,
        "metadata": Closed({**dict.fromkeys(OBJECT_META, ALL), "managedFields": SKIP}),
    }
)
"""The decoder of a ``metadata_only`` resource (what :func:`metadata_view` reads)."""
