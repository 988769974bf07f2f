"""The one configuration model: flags and environment map onto it.

Every field reads from the environment variable ``SHARED_SVC_<FIELD>`` (upper case),
except the three that follow Kubernetes conventions (``OPERATOR_NAMESPACE``,
``KUBECONFIG``, ``POD_NAME``). Every field is also a flag, ``--<field>`` with dashes,
generated here (``add_flags``); a flag overrides the environment, which overrides the
default (``load``). ``docs/configuration.md`` is checked against this model by a test.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import AliasChoices, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from shared_svc.errors import UsageError
from shared_svc.k8s.selectors import parse_selector
from shared_svc.reconcile.model import Settings as CoreSettings

ENV_PREFIX = "SHARED_SVC_"
# Not settings: read by the development tooling (testenv/, make demo) under the same prefix.
DEV_TOOLING_ENV = frozenset(
    {
        "SHARED_SVC_CACHE",
        "SHARED_SVC_GPU_OPERATOR_DIR",
        "SHARED_SVC_KUBE_VERSION",
        "SHARED_SVC_TESTENV_BIN",
    }
)


class Config(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="SHARED_SVC_", extra="forbid", validate_default=True, populate_by_name=True
    )

    # --- where and how the Services controller works ---
    namespace: str = Field(
        default="gpu-operator",
        validation_alias=AliasChoices("OPERATOR_NAMESPACE", "SHARED_SVC_NAMESPACE"),
        description="Operator namespace holding the DCGM Services.",
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
        description="Path to a kubeconfig (of a KUBECONFIG list, the first); unset: ~/.kube/config if it exists, else the in-cluster service account.",
    )
    api_compression: bool = Field(
        default=False,
        description="Accept gzip-compressed answers from the API server (lists over 128 KiB). Off: every request says Accept-Encoding: identity, which spares the API server's CPU (at 5,000 nodes, gzip was more than half of its CPU while shared-svc started) for about ten times the bytes on the wire (kubernetes#112296).",
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
        default=300.0,
        gt=0,
        description="Reconcile interval from the caches (the caches re-list only when a watch cannot resume).",
    )
    discovery_seconds: float = Field(
        default=60.0, gt=0, description="Re-check whether ServiceMonitor is served."
    )
    scrape_interval_seconds: float = Field(
        default=30.0,
        gt=0,
        description="Scrape interval of a ServiceMonitor that sets none (the Prometheus' own): a ServiceMonitor going away selects nothing for two scrape intervals before it is deleted.",
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
        description="Reconcile again from the caches every node in an upgrade or holding something of ours (gpu-operator requeues every 2 min).",
    )
    upgrade_workers: int = Field(
        default=64,
        ge=1,
        le=64,
        description="Nodes handled at once by the driver-upgrade controller (each sends its evictions at once).",
    )
    upgrade_writes_per_second: float = Field(
        default=200.0,
        gt=0,
        description="Write rate limit of the driver-upgrade controller (node patches, evictions, deletes): one token bucket, apart from the Services writer's.",
    )
    upgrade_writes_burst: int = Field(
        default=400, ge=1, description="Burst of the driver-upgrade controller's write rate limit."
    )

    @field_validator("upgrade_consumer_selector")
    @classmethod
    def _selector_valid(cls, value: str) -> str:
        parse_selector(value)  # SelectorError (a ValueError) names the offending part
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
            scrape_interval_seconds=self.scrape_interval_seconds,
        )


# --- flags and environment: one place for every command that reads the settings ---


def env_names(field: str) -> tuple[str, ...]:
    """The environment variables of a setting, the one read first first."""
    alias = Config.model_fields[field].validation_alias
    if isinstance(alias, AliasChoices):
        return tuple(str(choice) for choice in alias.choices)
    return (f"{ENV_PREFIX}{field.upper()}",)


def flag(field: str) -> str:
    """The command-line flag of a setting: ``--<field>`` with dashes."""
    return "--" + field.replace("_", "-")


def default_text(field: str) -> str:
    value = Config.model_fields[field].get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool | list):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _metavar(field: str) -> str:
    annotation = Config.model_fields[field].annotation
    if typing.get_origin(annotation) is Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(annotation)) + "}"
    if annotation is bool:
        return "BOOL"
    if annotation is int:
        return "N"
    if annotation is float:
        return "SECONDS" if field.endswith("_seconds") else "NUMBER"
    if typing.get_origin(annotation) is list:
        return "LIST"
    if field == "kubeconfig" or field.endswith("_file"):
        return "PATH"
    if field.endswith("_selector"):
        return "LABELS"  # a label selector (SELECTOR makes usage lines too long)
    return field.rsplit("_", 1)[-1].upper()


def add_flags(
    parser: argparse.ArgumentParser, fields: Iterable[str] | None = None
) -> argparse.ArgumentParser:
    """A flag for each setting (all of them by default), with its default and its
    environment variable in its help. Values are kept as text: ``load`` validates them
    with the model, so a bad value is one line naming the flag."""
    group = parser.add_argument_group(
        "settings", "a flag overrides its environment variable, which overrides the default"
    )
    for field in Config.model_fields if fields is None else fields:
        info = Config.model_fields[field]
        help_text = (
            f"{info.description} (default: {default_text(field)}; "
            f"env: {' or '.join(env_names(field))})"
        ).replace("%", "%%")
        extra: dict[str, Any] = {}
        if info.annotation is bool:
            extra = {"nargs": "?", "const": "true"}  # --dry-run alone means true
        group.add_argument(
            flag(field), dest=field, default=None, metavar=_metavar(field), help=help_text, **extra
        )
    return parser


def flag_values(args: argparse.Namespace, fields: Iterable[str] | None = None) -> dict[str, Any]:
    """The settings given as flags (text, as typed)."""
    names = Config.model_fields if fields is None else fields
    return {f: getattr(args, f) for f in names if getattr(args, f, None) is not None}


def _list_value(field: str, text: str) -> list[str]:
    """A list flag: JSON (as its environment variable) or comma-separated words."""
    if text.lstrip().startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(f"invalid configuration: {flag(field)} {text!r}: {exc}") from None
        if isinstance(value, list):
            return value
    return [word.strip() for word in text.split(",") if word.strip()]


def _set_env(field: str, environ: Mapping[str, str]) -> str | None:
    """The environment variable that sets ``field`` (names are case-insensitive)."""
    upper = {key.upper(): key for key in environ}
    return next((upper[n.upper()] for n in env_names(field) if n.upper() in upper), None)


def _field_of(loc: tuple[Any, ...]) -> str | None:
    if not loc:
        return None
    name = str(loc[0])
    if name in Config.model_fields:
        return name
    return next((f for f in Config.model_fields if name in env_names(f)), None)


def _problem(error: Any, flags: Mapping[str, Any], environ: Mapping[str, str]) -> str:
    message = str(error["msg"]).removeprefix("Value error, ")
    field = _field_of(tuple(error.get("loc", ())))
    if field is None:
        return message
    if field in flags:
        return f"{flag(field)} {flags[field]!r}: {message}"
    env = _set_env(field, environ)
    if env is not None:
        return f"{env}={environ[env]!r}: {message}"
    return f"{field}: {message}"


def load(flags: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Config:
    """The settings: ``flags`` (from ``flag_values``) over the environment over the
    defaults. Anything invalid is one UsageError line naming the flag or variable."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {
        f: _list_value(f, v)
        if typing.get_origin(Config.model_fields[f].annotation) is list and isinstance(v, str)
        else v
        for f, v in flags.items()
    }
    try:
        return Config(**values)
    except ValidationError as exc:
        problems = "; ".join(_problem(e, values, environ) for e in exc.errors())
        raise UsageError(f"invalid configuration: {problems}") from None
    except SettingsError as exc:  # a list variable that is not JSON
        match = re.search(r'field "(\w+)"', str(exc))
        field = match.group(1) if match else ""
        env = _set_env(field, environ) if field in Config.model_fields else None
        where = f"{env}={environ[env]!r}" if env else str(exc)
        raise UsageError(
            f'invalid configuration: {where}: not JSON (a list is written ["a","b"])'
        ) from None


def unknown_env(environ: Mapping[str, str]) -> list[str]:
    """One warning per ``SHARED_SVC_*`` variable that is no setting (likely a typo),
    naming the closest setting's variable when there is one."""
    known = sorted(
        {n for f in Config.model_fields for n in env_names(f) if n.startswith(ENV_PREFIX)}
    )
    out = []
    for key in sorted(environ):
        upper = key.upper()
        if not upper.startswith(ENV_PREFIX) or upper in known or upper in DEV_TOOLING_ENV:
            continue
        close = difflib.get_close_matches(upper, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        out.append(f"environment variable {key} is not a setting, ignored{hint}")
    return out
