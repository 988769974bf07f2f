"""The Services controller's reconcile loop: steady state writes nothing, the periodic resync
reconciles from the caches without re-listing, changes are coalesced without a wait, and
`run` and `plan` build one world from the same objects."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from shared_svc.config import Config
from shared_svc.controllers.services.reconciler import KEY
from shared_svc.runtime.controller import Result, controller_for
from shared_svc.runtime.workqueue import WorkQueue
from testenv import ControlPlane
from testenv.caches import fill
from tests.kube import eventually
from tests.parts import managed, services_controller
from tests.svc import (
    Kube,
    apiserver_write_count,
    cp_body,
    gc_body,
    running,
    service_config,
    settle,
    successful_reconciles,
)


class LoopProbe:
    """The Services controller's loop (the runtime's queue and worker, run by a Manager as
    the service runs it, on caches listed in this process), with its reconciles and its
    coalescing waits (delayed adds of the one key) logged in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, coalesce_seconds: float) -> None:
        self.log: list[str] = []
        self.ctrl = services_controller(
            Config(coalesce_seconds=coalesce_seconds, resync_seconds=3600)
        )
        add_after = WorkQueue.add_after

        def delayed(queue: WorkQueue[str], key: str, delay: float) -> None:
            if delay > 0:
                self.log.append("sleep")  # a wait before the next reconcile
            add_after(queue, key, delay)

        async def reconcile(key: str) -> Result:
            self.log.append("reconcile")
            await asyncio.sleep(0)  # changes may arrive while it runs
            return Result()

        monkeypatch.setattr(WorkQueue, "add_after", delayed)
        monkeypatch.setattr(self.ctrl, "reconcile", reconcile)
        self.runtime = controller_for(self.ctrl)
        self._running = managed([self.runtime])

    async def start(self) -> LoopProbe:
        self.manager = await self._running.__aenter__()
        return self

    def change(self) -> None:
        self.log.append("change")
        self.runtime.enqueue(KEY)

    async def idle(self, seconds: float) -> None:
        await asyncio.sleep(seconds)  # a wait in the test's own time, not an assertion

    async def until(self, reconciles: int) -> None:
        for _ in range(500):
            if self.log.count("reconcile") >= reconciles:
                return
            await self.idle(0.01)
        raise AssertionError(f"{reconciles} reconcile(s) expected: {self.log}")

    async def close(self) -> None:
        await self._running.__aexit__(None, None, None)


async def test_a_lone_change_is_reconciled_without_a_coalescing_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A spacing of an hour: any coalescing wait before the first reconcile would hold it back.
    probe = await LoopProbe(monkeypatch, coalesce_seconds=3600).start()
    await probe.idle(0.05)
    probe.change()
    await probe.until(1)
    assert probe.log == ["change", "reconcile"]
    await probe.close()


async def test_a_change_after_the_spacing_is_reconciled_without_a_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    probe = await LoopProbe(monkeypatch, coalesce_seconds=0.05).start()
    probe.change()
    await probe.until(1)
    await probe.idle(0.2)  # idle for longer than the spacing
    probe.log.clear()
    probe.change()
    await probe.until(1)
    assert probe.log == ["change", "reconcile"]
    await probe.close()


async def test_a_burst_of_changes_becomes_few_reconciles(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = await LoopProbe(monkeypatch, coalesce_seconds=0.05).start()
    await probe.idle(0.05)
    for _ in range(50):
        probe.change()
        await asyncio.sleep(0)  # the loop runs between two changes
    await probe.until(2)
    await probe.idle(0.2)  # whatever was still pending has run
    first = probe.log.index("reconcile")
    assert "sleep" not in probe.log[:first], probe.log  # the first one without a wait
    assert "sleep" in probe.log, probe.log  # the rest of the burst was gathered
    assert 2 <= probe.log.count("reconcile") <= 3, probe.log
    last_change = len(probe.log) - 1 - probe.log[::-1].index("change")
    assert "reconcile" in probe.log[last_change:], probe.log  # the last change is served
    await probe.close()


def test_run_and_plan_build_one_world_from_the_same_objects(tmp_path: Any) -> None:
    import json

    from shared_svc.commands.plan import load_world

    ns = "gpu-operator"

    def obj(kind: str, name: str, namespaced: bool = True) -> dict[str, Any]:
        meta = {"name": name, "namespace": ns} if namespaced else {"name": name}
        return {"apiVersion": "v1", "kind": kind, "metadata": meta}

    pod = obj("Pod", "p")  # a DCGM pod: the pod cache's selectors bring it
    pod["metadata"]["labels"] = {"app": "nvidia-dcgm-exporter"}
    by_plural = {
        "clusterpolicies": [obj("ClusterPolicy", "cluster-policy", namespaced=False)],
        "gpuclusters": [obj("GPUCluster", "gpu-cluster", namespaced=False)],
        "daemonsets": [obj("DaemonSet", "nvidia-dcgm-exporter")],
        "pods": [{**pod, "spec": {"nodeName": "n"}, "status": {"conditions": []}}],
        "services": [obj("Service", "nvidia-dcgm"), obj("Service", "other")],
        "servicemonitors": [obj("ServiceMonitor", "nvidia-dcgm-exporter")],
    }
    ctrl = services_controller(Config(namespace=ns), objects=by_plural)
    ctrl.discovery.served = True  # the ServiceMonitor API is served: its cache listed
    fill(ctrl.discovery.cache, by_plural["servicemonitors"])
    path = tmp_path / "all.json"
    items = [o for objects in by_plural.values() for o in objects]
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
    world = ctrl.snapshot()
    assert world == load_world([str(path)], ns)
    assert [o["metadata"]["name"] for o in world.services] == ["nvidia-dcgm", "other"]
    assert len(world.service_monitors) == 1


@pytest.mark.apiserver
async def test_steady_state_writes_nothing(control_plane: ControlPlane, kube: Kube) -> None:
    """Hours of steady state, compressed: many periodic reconciles from the caches, and
    re-lists (what an API-server restart or a 410 brings), write nothing."""
    monitor = {"enabled": True, "interval": "30s"}
    await kube.create_cr(cp_body(dcgmExporter={"serviceMonitor": monitor}))
    await kube.create_cr(gc_body(dcgmExporter={"enabled": True, "service": {"type": "NodePort"}}))
    config = service_config(control_plane, kube.ns, resync_seconds=0.25)
    async with running(config) as svc:
        await settle(svc)
        await asyncio.sleep(0.5)
        ctrl = svc.controller
        assert ctrl is not None
        writes_before = apiserver_write_count(control_plane)
        reconciles = successful_reconciles(svc)
        relists = {n: i.relists for n, i in ctrl.caches.items()}
        for _ in range(5):
            for cache in ctrl.caches.values():
                await cache.relist()
            await asyncio.sleep(0.5)
        await asyncio.sleep(2.5)
        assert apiserver_write_count(control_plane) == writes_before
        assert successful_reconciles(svc) >= reconciles + 10
        # Five forced re-lists of each cache: one list per list+watch it holds.
        assert all(
            i.relists == relists[n] + 5 * len(getattr(i, "parts", (i,)))
            for n, i in ctrl.caches.items()
        )


@pytest.mark.apiserver
async def test_the_periodic_resync_reconciles_from_the_caches_without_relisting(
    control_plane: ControlPlane, kube: Kube
) -> None:
    """client-go's resync: the controller reconciles every ``resync_seconds`` from its
    caches; a cache whose watch is healthy is never re-listed for it (a re-list of 8,000
    pods costs seconds of CPU), and changes still arrive through the watches."""
    await kube.create_cr(cp_body())
    async with running(service_config(control_plane, kube.ns, resync_seconds=0.3)) as svc:
        await settle(svc)
        ctrl = svc.controller
        assert ctrl is not None
        relists = {n: i.relists for n, i in ctrl.caches.items()}
        reconciles = successful_reconciles(svc)
        await kube.core.create_namespaced_service(
            kube.ns, {"metadata": {"name": "other"}, "spec": {"ports": [{"port": 1}]}}
        )
        services = ctrl.caches["services"]
        await eventually(lambda: _true(services.get("other", kube.ns) is not None), timeout=15)
        await asyncio.sleep(3)  # ten resync periods
        assert successful_reconciles(svc) >= reconciles + 5, "the resync still reconciles"
        assert {n: i.relists for n, i in ctrl.caches.items()} == relists


async def _true(value: bool) -> bool:
    return value
