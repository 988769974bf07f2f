"""Each cache is declared once, with the controllers that read it (``shared_svc.controllers``:
``shared_caches.py`` for what both read, ``services/caches.py``, ``upgrade/caches.py``;
issues 21, 29): controllers that read one resource share one cache whichever asks
first, the registry's options are its own, and the registry reports every cache's sync."""

from __future__ import annotations

from typing import Any

import pytest

from shared_svc.config import Config
from shared_svc.controllers import shared_caches
from shared_svc.controllers.services import caches as services_caches
from shared_svc.controllers.upgrade.caches import UpgradeCaches
from shared_svc.kube.reflector import Cache
from testenv.caches import fill

API: Any = object()  # no request is sent: caches are only made, not run


@pytest.mark.parametrize("upgrade_first", [True, False])
def test_both_controllers_share_one_cache_per_resource_whichever_asks_first(
    upgrade_first: bool,
) -> None:
    config = Config(upgrade_controller=True, backoff_max_seconds=4.0)
    registry = shared_caches.registry(API, config)
    if upgrade_first:
        upgrade = UpgradeCaches.of(registry, "gpu")
    services = {
        name: registry.cache(resource) for name, resource in services_caches.declare(config).items()
    }
    if not upgrade_first:
        upgrade = UpgradeCaches.of(registry, "gpu")
    assert services["daemonsets"] is upgrade.daemonsets
    assert services["clusterpolicies"] is upgrade.cluster_policies
    # The registry's option, not the first reader's.
    assert {c._backoff.cap for c in upgrade.all() if isinstance(c, Cache)} == {4.0}
    assert len(registry.caches()) == 7  # 5 the Services controller's, 2 node caches more


def test_without_the_upgrade_controller_the_services_controller_caches_its_namespace() -> None:
    declared = services_caches.declare(Config(namespace="gpu-operator"))
    assert declared["daemonsets"].namespace == "gpu-operator"
    on = services_caches.declare(Config(upgrade_controller=True))
    assert on["daemonsets"] == shared_caches.ALL_DAEMONSETS


def test_the_registry_reports_the_sync_of_every_cache_by_its_name() -> None:
    """``shared_svc_cache_synced`` is the registry's, for every cache it makes (both
    controllers'), not a controller's for its own: each named once."""
    reported: dict[str, bool] = {}
    config = Config(upgrade_controller=True)
    registry = shared_caches.registry(API, config, on_synced=reported.__setitem__)
    services = [registry.cache(r) for r in services_caches.declare(config).values()]
    upgrade = UpgradeCaches.of(registry, "gpu")
    assert reported == dict.fromkeys(
        [
            "clusterpolicies",
            "gpuclusters",
            "services",
            "daemonsets",
            "pods",
            "upgrading-nodes",
            "parked-nodes",
        ],
        False,
    )
    fill(upgrade.nodes[1], [])
    fill(services[4], [])  # the DCGM pods: one cache of three list+watches
    assert reported["parked-nodes"] is True and reported["pods"] is True
    assert reported["upgrading-nodes"] is False
