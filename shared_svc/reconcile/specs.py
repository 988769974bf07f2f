"""What we read from ClusterPolicy and GPUCluster, with each stack's own defaults.

Only the fields that matter for the Services are modelled; every other field is accepted
and ignored ("other fields of the CRs are not ours to judge", contract section 9). A spec
that fails validation yields an :class:`CRSpec` with ``error`` set (InvalidSpec) instead of
raising: :func:`parse_cr` is total over any input.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Final, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, StrictBool, StrictStr, ValidationError

from shared_svc.k8s.labels import is_label_key, is_label_value
from shared_svc.k8s.objects import K8sObject

CLUSTER_POLICY: Final = "ClusterPolicy"
GPU_CLUSTER: Final = "GPUCluster"
CRKind = Literal["ClusterPolicy", "GPUCluster"]

_DURATION = re.compile(
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)


_UNIT_SECONDS = {
    "y": 365 * 86400,
    "w": 7 * 86400,
    "d": 86400,
    "h": 3600,
    "m": 60,
    "s": 1,
    "ms": 0.001,
}
_PART = re.compile(r"([0-9]+)(ms|y|w|d|h|m|s)")


def duration_seconds(value: object) -> float | None:
    """A Prometheus duration (``1m30s``) in seconds; None for anything else."""
    if not isinstance(value, str) or not value or not _DURATION.match(value):
        return None
    return float(sum(int(n) * _UNIT_SECONDS[unit] for n, unit in _PART.findall(value)))


def _prometheus_duration(value: str) -> str:
    if not value or not _DURATION.match(value):
        raise ValueError(f"{value!r} is not a Prometheus duration (e.g. 15s, 1m30s)")
    return value


def _label_map(value: dict[str, str]) -> dict[str, str]:
    for key, val in value.items():
        if not is_label_key(key):
            raise ValueError(f"{key!r} is not a valid label key")
        if not is_label_value(val):
            raise ValueError(f"{val!r} (label {key!r}) is not a valid label value")
    return value


Duration = Annotated[StrictStr, AfterValidator(_prometheus_duration)]
LabelMap = Annotated[dict[StrictStr, StrictStr], AfterValidator(_label_map)]


class _Lenient(BaseModel):
    # Unknown fields are accepted: the CRDs have many more, and they are not ours to judge.
    model_config = ConfigDict(extra="allow", strict=True, frozen=True)


class ServiceSpec(_Lenient):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] | None = None
    internalTrafficPolicy: Literal["Cluster", "Local"] | None = None


class ServiceMonitorSpec(_Lenient):
    enabled: StrictBool | None = None
    interval: Duration | None = None
    scrapeTimeout: Duration | None = None
    honorLabels: StrictBool | None = None
    additionalLabels: LabelMap | None = None
    relabelings: list[dict[str, Any]] | None = None


class DCGMExporterSpec(_Lenient):
    enabled: StrictBool | None = None
    service: ServiceSpec | None = None
    serviceMonitor: ServiceMonitorSpec | None = None


class DCGMSpec(_Lenient):
    enabled: StrictBool | None = None


class CRSpecModel(_Lenient):
    dcgm: DCGMSpec | None = None
    dcgmExporter: DCGMExporterSpec | None = None


@dataclass(frozen=True)
class ServiceMonitorSettings:
    """The ServiceMonitor settings a CR sets (None = unset, never a conflict)."""

    interval: str | None = None
    scrape_timeout: str | None = None
    honor_labels: bool | None = None
    relabelings: tuple[dict[str, Any], ...] | None = None
    additional_labels: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class CRSpec:
    """One CR as the reconciler sees it: identity, enablement (own defaults), settings."""

    kind: CRKind
    api_version: str
    name: str
    uid: str
    created: str  # metadata.creationTimestamp (RFC 3339 sorts as text); "" when missing
    deleting: bool
    error: str | None = None  # set: InvalidSpec, the settings below are meaningless
    dcgm_on: bool = False
    exporter_on: bool = False
    service_monitor_on: bool = False
    service_type: str | None = None
    internal_traffic_policy: str | None = None
    monitor: ServiceMonitorSettings = field(default_factory=ServiceMonitorSettings)

    @property
    def valid(self) -> bool:
        return self.error is None

    @property
    def label(self) -> str:
        """How /status and reports name the CR: ``ClusterPolicy/cluster-policy``."""
        return f"{self.kind}/{self.name}"

    @property
    def precedence(self) -> tuple[str, str, str, str, str]:
        """Conflict order (section 6): oldest, then apiVersion, kind, name, uid."""
        return (self.created, self.api_version, self.kind, self.name, self.uid)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        parts.append(f"spec.{loc}: {err['msg']}" if loc else f"spec: {err['msg']}")
    return "; ".join(parts)


def parse_cr(kind: CRKind, obj: K8sObject) -> CRSpec:
    """Read a CR dict into a :class:`CRSpec`; never raises."""
    meta = obj.get("metadata")
    meta = meta if isinstance(meta, dict) else {}
    default_api = "nvidia.com/v1" if kind == CLUSTER_POLICY else "nvidia.com/v1alpha1"
    ident: dict[str, Any] = {
        "kind": kind,
        "api_version": _text(obj.get("apiVersion")) or default_api,
        "name": _text(meta.get("name")),
        "uid": _text(meta.get("uid")),
        "created": _text(meta.get("creationTimestamp")),
        "deleting": meta.get("deletionTimestamp") is not None,
    }
    raw = obj.get("spec")
    try:
        spec = CRSpecModel.model_validate({} if raw is None else raw)
    except ValidationError as exc:
        return CRSpec(**ident, error=_describe(exc))
    return CRSpec(**ident, **_effective(kind, spec))


def _effective(kind: CRKind, spec: CRSpecModel) -> dict[str, Any]:
    """Apply the stack's own defaults (contract section 2, facts 2.2)."""
    legacy = kind == CLUSTER_POLICY
    dcgm_flag = spec.dcgm.enabled if spec.dcgm else None
    # ClusterPolicy: nil => on (DCGMSpec.IsEnabled). GPUCluster: needs an explicit true.
    dcgm_on = dcgm_flag if dcgm_flag is not None else legacy
    exporter = spec.dcgmExporter
    if exporter is None:
        # A missing block: on for ClusterPolicy, no exporter for GPUCluster.
        exporter_on = legacy
    else:
        exporter_on = exporter.enabled if exporter.enabled is not None else True
    service = exporter.service if exporter and exporter.service else ServiceSpec()
    sm = exporter.serviceMonitor if exporter and exporter.serviceMonitor else ServiceMonitorSpec()
    monitor = ServiceMonitorSettings(
        interval=sm.interval,
        scrape_timeout=sm.scrapeTimeout,
        honor_labels=sm.honorLabels,
        relabelings=tuple(sm.relabelings) if sm.relabelings is not None else None,
        additional_labels=tuple(sorted((sm.additionalLabels or {}).items())),
    )
    return {
        "dcgm_on": dcgm_on,
        "exporter_on": exporter_on,
        "service_monitor_on": exporter_on and sm.enabled is True,
        "service_type": service.type,
        "internal_traffic_policy": service.internalTrafficPolicy,
        "monitor": monitor,
    }
