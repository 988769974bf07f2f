"""The fixed vocabulary of the contract: object names, labels, annotations, API versions."""

from __future__ import annotations

from typing import Final, Literal

Component = Literal["dcgm", "exporter"]

DCGM: Final = "nvidia-dcgm"
DCGM_DRA: Final = "nvidia-dcgm-dra"
EXPORTER: Final = "nvidia-dcgm-exporter"
EXPORTER_DRA: Final = "nvidia-dcgm-exporter-dra"
SERVICE_NAMES: Final = (DCGM, DCGM_DRA, EXPORTER, EXPORTER_DRA)
STABLE_NAMES: Final = (DCGM, EXPORTER)
# The canonical ServiceMonitor shares its name with the canonical scrape Service (section 7);
# the GPUCluster stack's own, adopted and kept like the Services (amended section 7), with
# the DRA alias. Each exporter Service names the one of them that selects it in
# MONITOR_LABEL (monitoring.py).
SERVICE_MONITOR: Final = EXPORTER
SERVICE_MONITOR_DRA: Final = EXPORTER_DRA
SERVICE_MONITOR_NAMES: Final = (SERVICE_MONITOR, SERVICE_MONITOR_DRA)

COMPONENT_OF: Final[dict[str, Component]] = {
    DCGM: "dcgm",
    DCGM_DRA: "dcgm",
    EXPORTER: "exporter",
    EXPORTER_DRA: "exporter",
}
# Implementation ``app`` labels: the legacy stack's pods, then the DRA stack's pods.
LEGACY_APP: Final[dict[Component, str]] = {"dcgm": DCGM, "exporter": EXPORTER}
DRA_APP: Final[dict[Component, str]] = {"dcgm": DCGM_DRA, "exporter": EXPORTER_DRA}
COMMON_LABEL: Final[dict[Component, str]] = {
    "dcgm": "nvidia.com/gpu-operator.dcgm",
    "exporter": "nvidia.com/gpu-operator.dcgm-exporter",
}

APP_LABEL: Final = "app"
MANAGED_BY_LABEL: Final = "app.kubernetes.io/managed-by"
MANAGED_BY_VALUE: Final = "shared-svc"
# gpu-operator's GPUCluster clean-up deletes everything carrying this label: never ours.
STATE_LABEL: Final = "nvidia.com/gpu-operator.state"
SCRAPE_ANNOTATION: Final = "prometheus.io/scrape"
INTENT_HASH_ANNOTATION: Final = "shared-svc.nvidia.com/intent-hash"
# On an exporter Service with scrape "true": the name of shared-svc's ServiceMonitor that
# selects it (each ServiceMonitor selects exactly the Services naming it).
MONITOR_LABEL: Final = "shared-svc.nvidia.com/service-monitor"
RESERVED_LABELS: Final = (APP_LABEL, MANAGED_BY_LABEL, STATE_LABEL)
# On a ServiceMonitor of ours going away: when it was made to select nothing (RFC 3339).
DRAINED_ANNOTATION: Final = "shared-svc.nvidia.com/drained-at"

SERVICE_API: Final = "v1"
SERVICE_MONITOR_API: Final = "monitoring.coreos.com/v1"
CR_GROUP: Final = "nvidia.com"
GPU_CLUSTER_NAME: Final = "gpu-cluster"

DCGM_PORT: Final = {"name": "dcgm", "port": 5555, "targetPort": 5555, "protocol": "TCP"}
EXPORTER_PORT: Final = {"name": "gpu-metrics", "port": 9400, "targetPort": 9400, "protocol": "TCP"}
