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
from shared_svc.kube.resources import Resource
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
    # 5 the Services controller's; the upgrade controller's 2 node caches, the NVIDIADrivers
    # and the NVIDIADriver CRD more
    assert len(registry.caches()) == 9


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
            "nvidiadrivers",
            "nvidiadriver-crd",
        ],
        False,
    )
    fill(upgrade.nodes[1], [])
    fill(services[4], [])  # the DCGM pods: one cache of three list+watches
    assert reported["parked-nodes"] is True and reported["pods"] is True
    assert reported["upgrading-nodes"] is False


def test_the_registry_says_when_every_cache_it_runs_has_synced_and_again_after_a_relist() -> None:
    """``on_all_synced`` (the service freezes the heap then, ``runtime.heap``): once the
    last of the caches the registry runs has synced, not before, not for a cache it does
    not run (the ServiceMonitor cache, run by its reader only while served), and again
    when a cache that re-listed has synced again."""
    calls: list[int] = []
    config = Config(upgrade_controller=True)
    registry = shared_caches.registry(API, config, on_all_synced=lambda: calls.append(1))
    services = [registry.cache(r) for r in services_caches.declare(config).values()]
    upgrade = UpgradeCaches.of(registry, "gpu")
    not_run = registry.cache(
        Resource("monitoring.coreos.com", "v1", "servicemonitors", "ServiceMonitor"), runs=False
    )
    own = [*services, *upgrade.nodes, upgrade.nvidia_drivers, upgrade.driver_crd]
    registry.runnables()  # the Manager runs them from now on
    for cache in own[:-1]:
        fill(cache, [])
    assert calls == []  # one cache still listing
    fill(own[-1], [])
    assert calls == [1]
    fill(not_run, [])
    assert calls == [1]  # not one of the caches it runs
    parts = getattr(services[4], "parts", (services[4],))
    parts[0]._set_synced(False)  # lost its watch: re-listing
    assert calls == [1]
    fill(services[4], [])
    assert calls == [1, 1]


def test_freeze_moves_what_survives_a_collection_out_of_the_collectors_scans() -> None:
    """``runtime.heap.freeze``: garbage now (a reference cycle) is collected, not frozen;
    what is alive is frozen (``gc.get_freeze_count``)."""
    import gc
    import weakref

    from shared_svc.runtime import heap

    class Node:
        other: Any = None

    kept = {"items": [{"metadata": {"name": f"n{i}"}} for i in range(100)]}
    a, b = Node(), Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    gc.disable()  # no collection but the one under test
    try:
        heap.freeze()
        assert gone() is None, "a cycle that was garbage is collected before the freeze"
        assert gc.get_freeze_count() >= 200
        frozen = {id(o) for o in gc.get_objects()}
        assert id(kept) not in frozen and id(kept["items"][0]) not in frozen
    finally:
        gc.unfreeze()
        gc.enable()
    assert id(kept) in {id(o) for o in gc.get_objects()}
