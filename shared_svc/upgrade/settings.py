"""What configuration decides for the upgrade planner (a subset of ``shared_svc.config``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from shared_svc.config import Config
from shared_svc.k8s.selectors import Selector, parse_selector

Detection = Literal["off", "report", "evict"]


def _default(name: str) -> Any:
    """The default of one ``Config`` field: defaults are written there only."""
    return Config.model_fields[name].get_default(call_default_factory=True)


@dataclass(frozen=True)
class UpgradeSettings:
    driver_name: str = _default("upgrade_driver_name")
    consumer_selector: Selector = field(
        default_factory=lambda: parse_selector(_default("upgrade_consumer_selector"))
    )
    detection: Detection = field(default=_default("upgrade_detection"))
    runtime_classes: frozenset[str] = frozenset(_default("upgrade_runtime_classes"))
    eviction_timeout_seconds: float = _default("upgrade_eviction_timeout_seconds")
    delete_after_timeout: bool = _default("upgrade_delete_after_timeout")
    operator_namespace: str = _default("namespace")
    # How soon to look at a node again while pods are still leaving it.
    poll_seconds: float = _default("upgrade_poll_seconds")

    @staticmethod
    def from_config(config: Config) -> UpgradeSettings:
        """``Config`` has checked the consumer selector (a bad one is a one-line error)."""
        return UpgradeSettings(
            driver_name=config.upgrade_driver_name,
            consumer_selector=parse_selector(config.upgrade_consumer_selector),
            detection=config.upgrade_detection,
            runtime_classes=frozenset(config.upgrade_runtime_classes),
            eviction_timeout_seconds=config.upgrade_eviction_timeout_seconds,
            delete_after_timeout=config.upgrade_delete_after_timeout,
            operator_namespace=config.namespace,
            poll_seconds=config.upgrade_poll_seconds,
        )
