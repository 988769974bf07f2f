"""The one configuration model: flags and environment map onto it.

Every field reads from the environment variable ``SHARED_SVC_<FIELD>`` (upper case),
except the namespace, which follows gpu-operator's ``OPERATOR_NAMESPACE``. Flags of
``shared-svc run`` override the environment. ``docs/configuration.md`` is checked
against this model by a test.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared_svc.reconcile.model import Settings as CoreSettings

_LABEL_SELECTOR_CHARS = set(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./=!, ()"
)


class Config(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="SHARED_SVC_", extra="forbid", validate_default=True, populate_by_name=True
    )

    # --- where and how the Services controller works ---
    namespace: str = Field(
        default="gpu-operator",
        validation_alias=AliasChoices("OPERATOR_NAMESPACE", "SHARED_SVC_NAMESPACE"),
        description="Operator namespace holding the DCGM Services (env OPERATOR_NAMESPACE).",
        min_length=1,
        max_length=63,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
    )
    selector_mode: Literal["auto", "app"] = Field(
        default="auto",
        description="auto: move stable names to the common labels when the gate holds; app: never.",
    )
    adopt: bool = Field(
        default=True, description="Adopt same-named Services/ServiceMonitors left by gpu-operator."
    )
    services_controller: bool = Field(
        default=True, description="Run the shared DCGM Services controller."
    )
    dry_run: bool = Field(
        default=False, description="Compute and report, write nothing (Events included)."
    )

    # --- API access ---
    kubeconfig: str | None = Field(
        default=None,
        validation_alias=AliasChoices("KUBECONFIG", "SHARED_SVC_KUBECONFIG"),
        description="Path to a kubeconfig; unset means in-cluster configuration.",
    )
    pod_name: str = Field(
        default="shared-svc",
        validation_alias=AliasChoices("POD_NAME", "SHARED_SVC_POD_NAME"),
        description="This replica's name: Events' reportingInstance and the Lease holder identity.",
    )

    # --- HTTP endpoints ---
    bind_address: str = Field(default="0.0.0.0", description="Address of the HTTP endpoints.")
    port: int = Field(
        default=8080,
        ge=0,
        le=65535,
        description="Port of /livez /healthz /readyz /status /metrics (0: any free port).",
    )

    # --- leader election ---
    leader_election: bool = Field(
        default=True, description="Elect one writing replica through a Lease."
    )
    lease_name: str = Field(
        default="shared-svc", description="Name of the coordination.k8s.io Lease."
    )
    lease_duration_seconds: float = Field(default=15.0, gt=0, description="Lease duration.")
    renew_deadline_seconds: float = Field(
        default=10.0, gt=0, description="Leader gives up if it cannot renew within this."
    )
    retry_period_seconds: float = Field(
        default=2.0, gt=0, description="Interval of Lease acquire/renew attempts."
    )

    # --- loop timing ---
    resync_seconds: float = Field(
        default=300.0, gt=0, description="Full re-list and reconcile interval."
    )
    discovery_seconds: float = Field(
        default=60.0, gt=0, description="Re-check whether ServiceMonitor is served."
    )
    coalesce_seconds: float = Field(
        default=0.2,
        ge=0,
        description="Least spacing between a reconcile and the next one an event starts: an event while idle is served at once, a burst becomes few reconciles.",
    )
    backoff_base_seconds: float = Field(
        default=0.005, gt=0, description="First retry delay after a failed reconcile."
    )
    backoff_max_seconds: float = Field(default=300.0, gt=0, description="Largest retry delay.")
    writes_per_second: float = Field(default=10.0, gt=0, description="Overall write rate limit.")
    writes_burst: int = Field(default=100, ge=1, description="Write rate limit burst.")
    conflicting_writer_threshold: int = Field(
        default=3,
        ge=1,
        description="Re-applies of the same drifted field that mean another writer is fighting.",
    )
    conflicting_writer_window_seconds: float = Field(
        default=600.0, gt=0, description="Window in which those re-applies are counted."
    )
    conflicting_writer_backoff_seconds: float = Field(
        default=300.0, gt=0, description="How long to leave a contested object alone once reported."
    )

    # --- admission guard (docs/install.md) ---
    webhook_cert_file: str | None = Field(
        default=None,
        description="TLS certificate (PEM) of the admission webhook server; unset: no webhook server.",
    )
    webhook_key_file: str | None = Field(
        default=None, description="TLS private key (PEM) of the admission webhook server."
    )
    webhook_port: int = Field(
        default=8443,
        ge=0,
        le=65535,
        description="Port of the admission webhook (0: any free port).",
    )
    operator_service_account: str = Field(
        default="gpu-operator",
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="gpu-operator's ServiceAccount in the namespace: whose deletes the guard answers 404.",
    )
    operator_field_manager: str = Field(
        default="gpu-operator",
        min_length=1,
        description="gpu-operator's field manager: its managedFields entries on our objects mean it writes them.",
    )

    # --- logging ---
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", description="Log level."
    )

    # --- driver-upgrade controller (off by default: it evicts pods) ---
    upgrade_controller: bool = Field(
        default=False, description="Run the driver-upgrade consumer controller."
    )
    upgrade_driver_name: str = Field(
        default="gpu",
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="Driver name in nvidia.com/<driver>-driver-upgrade-state (gpu; ofed for the network operator).",
    )
    upgrade_consumer_selector: str = Field(
        default="nvidia.com/gpu-driver-upgrade.consumer=true",
        description="Label selector of declared consumer pods (authoritative).",
    )
    upgrade_detection: Literal["off", "report", "evict"] = Field(
        default="report", description="What to do with detected (undeclared) GPU consumers."
    )
    upgrade_runtime_classes: list[str] = Field(
        default_factory=lambda: ["nvidia", "nvidia-cdi", "nvidia-legacy"],
        description="Runtime classes that make a pod a detected consumer.",
    )
    upgrade_eviction_timeout_seconds: float = Field(
        default=300.0,
        gt=0,
        description="How long evictions may be refused (PDB) before a Warning Event.",
    )
    upgrade_delete_after_timeout: bool = Field(
        default=False,
        description="After the eviction timeout, delete the pod (ignores PodDisruptionBudgets).",
    )

    upgrade_poll_seconds: float = Field(
        default=5.0,
        gt=0,
        description="How often a node is looked at again while its consumers are leaving.",
    )
    upgrade_resync_seconds: float = Field(
        default=120.0,
        gt=0,
        description="Re-list upgrading nodes and reconcile each (gpu-operator requeues every 2 min).",
    )
    upgrade_workers: int = Field(
        default=4,
        ge=1,
        le=64,
        description="Nodes handled at once by the driver-upgrade controller.",
    )

    @field_validator("upgrade_consumer_selector")
    @classmethod
    def _selector_chars(cls, value: str) -> str:
        bad = set(value) - _LABEL_SELECTOR_CHARS
        if bad:
            raise ValueError(f"invalid characters in label selector: {''.join(sorted(bad))!r}")
        return value

    @model_validator(mode="after")
    def _webhook_pair(self) -> Config:
        if (self.webhook_cert_file is None) != (self.webhook_key_file is None):
            raise ValueError(
                "webhook_cert_file and webhook_key_file go together: set both or neither"
            )
        return self

    def core_settings(self, *, service_monitor_served: bool) -> CoreSettings:
        return CoreSettings(
            namespace=self.namespace,
            selector_mode=self.selector_mode,
            adopt=self.adopt,
            service_monitor_served=service_monitor_served,
        )
