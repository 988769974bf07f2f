"""Each cache is declared once (``shared_svc.controllers.services.caches``, issue 21): controllers that read one
resource share one cache whichever asks first, and the registry's options are its own."""

from __future__ import annotations

from typing import Any

import pytest

from shared_svc.config import Config
from shared_svc.controllers.services import caches
from shared_svc.controllers.upgrade.io import KubeUpgradeIO, upgrade_write_limiter

API: Any = object()  # no request is sent: caches are only made, not run


def _upgrade_io(registry: Any) -> KubeUpgradeIO:
    return KubeUpgradeIO(
        API,
        "gpu",
        on_change=lambda: None,
        informers=registry,
        write_limiter=upgrade_write_limiter(Config()),
    )


@pytest.mark.parametrize("upgrade_first", [True, False])
def test_both_controllers_share_one_cache_per_resource_whichever_asks_first(
    upgrade_first: bool,
) -> None:
    config = Config(upgrade_controller=True, backoff_max_seconds=4.0)
    registry = caches.registry(API, config)
    declared = caches.declare(config)
    if upgrade_first:
        io = _upgrade_io(registry)
    services = {
        name: registry.informer(resource, on_change=lambda: None)
        for name, resource in (
            ("daemonsets", declared.daemonsets),
            ("clusterpolicies", declared.cluster_policies),
        )
    }
    if not upgrade_first:
        io = _upgrade_io(registry)
    assert services["daemonsets"] is io._daemonsets
    assert services["clusterpolicies"] is io._cluster_policies
    # The registry's option, not the first reader's.
    assert {i._backoff.cap for i in io._informers} == {4.0}


def test_without_the_upgrade_controller_the_services_controller_caches_its_namespace() -> None:
    declared = caches.declare(Config(namespace="gpu-operator"))
    assert declared.daemonsets.namespace == "gpu-operator"
    assert caches.declare(Config(upgrade_controller=True)).daemonsets == caches.ALL_DAEMONSETS
