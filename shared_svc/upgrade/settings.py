"""What configuration decides for the upgrade planner (a subset of ``shared_svc.config``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from shared_svc.k8s.selectors import Selector, parse_selector

if TYPE_CHECKING:
    from shared_svc.config import Config

Detection = Literal["off", "report", "evict"]


@dataclass(frozen=True)
class UpgradeSettings:
    driver_name: str = "gpu"
    consumer_selector: Selector = field(
        default_factory=lambda: parse_selector("nvidia.com/gpu-driver-upgrade.consumer=true")
    )
    detection: Detection = "report"
    runtime_classes: frozenset[str] = frozenset({"nvidia", "nvidia-cdi", "nvidia-legacy"})
    eviction_timeout_seconds: float = 300.0
    delete_after_timeout: bool = False
    operator_namespace: str = "gpu-operator"
    # How soon to look at a node again while pods are still leaving it.
    poll_seconds: float = 5.0

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
