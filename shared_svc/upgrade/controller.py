"""The driver-upgrade loop: per node, on each change and on a periodic resync,
read node + pods -> ``plan_node`` -> writes -> Events.

Changes come from the node caches as events (``shared_svc.runtime.source``): an event
enqueues the node it is about when it brings a resourceVersion newer than any seen for
that node (of the two node caches, the first copy counts) and is not the echo of this
controller's own node patch. No event reads the cache, so its cost does not depend on
the number of nodes. The resync (``upgrade_resync_seconds``) enqueues every cached node,
as client-go's resync replays its cache; it and the ClusterPolicy and DaemonSet caches'
changes also review the upgrade flow's gate.

Nodes are independent: the runtime's work queue (``shared_svc.runtime``) hands each node
to one worker at a time (``upgrade_workers`` nodes at once), a change that arrives while a
node is being handled runs it once more afterwards, failures are retried per node with
the runtime's capped exponential backoff, and nothing escapes a worker. A pass reads the
node from the node cache (no GET) and sends the evictions (or deletes) of the node at
once. Every write (node patch, eviction, delete) waits for a token of one bucket
(``upgrade_writes_per_second``, ``upgrade_writes_burst``). Only the leader writes; a
follower (or dry-run) plans and reports status only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry

from shared_svc.config import Config
from shared_svc.k8s.objects import K8sObject, name_of
from shared_svc.kube.events import Emitter, EventPublisher
from shared_svc.runtime.metrics import RuntimeMetrics
from shared_svc.runtime.runnable import Controller, Result, every
from shared_svc.runtime.source import Enqueue, NewestVersions
from shared_svc.upgrade.announce import Announcer
from shared_svc.upgrade.daemonsets import DaemonSetRef, index_daemonsets, parked_label_key
from shared_svc.upgrade.executor import PlanExecutor, WritesInFlight
from shared_svc.upgrade.gate import GateCheck, check_gate
from shared_svc.upgrade.metrics import PHASES, UpgradeMetrics
from shared_svc.upgrade.planner import (
    NodeChanged,
    NodePatch,
    NodeStatus,
    PodAction,
    plan_node,
    pods_read,
)
from shared_svc.upgrade.settings import UpgradeSettings
from shared_svc.upgrade.status import gate_json, nodes_json
from shared_svc.wait.loop import repeat
from shared_svc.wait.ratelimit import ItemExponentialFailureRateLimiter

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient

    from shared_svc.kube.registry import Informers
    from shared_svc.kube.store import EventHandler
    from shared_svc.runtime.workqueue import WorkQueue

log = logging.getLogger(__name__)

CONTROLLER = "upgrade"  # the ``controller`` / ``name`` label of the runtime's metrics
# How long a node whose patch met a newer node (409) waits before its next try (seconds).
CONFLICT_RETRY_SECONDS = 0.05
SYNC_POLL_SECONDS = 0.05  # caches not synced yet: look again this soon


class UpgradeIO(Protocol):
    """What ``shared_svc.upgrade.io.KubeUpgradeIO`` provides (tests run the controller on a fake with these methods)."""

    async def run(self, stop: asyncio.Event) -> None: ...
    def synced(self) -> bool: ...
    def add_node_handler(self, handler: EventHandler) -> None: ...  # node cache events
    def node_names(self) -> set[str]: ...  # every cached node (the resync's)
    def daemonset_objects(self) -> tuple[K8sObject, ...]: ...
    def cluster_policies(self) -> tuple[K8sObject, ...]: ...
    async def get_node(self, name: str) -> K8sObject | None: ...  # from a cache, no request
    # The pods bound to the node, but those of ``skip_namespace`` (``planner.pods_read``).
    async def pods_on_node(
        self, name: str, skip_namespace: str | None = None
    ) -> list[K8sObject]: ...
    # The driver pods of ``namespace`` bound to the node (``planner.PodRead.driver_pods``).
    async def driver_pods_on_node(self, name: str, namespace: str) -> list[K8sObject]: ...
    async def patch_node(self, patch: NodePatch) -> str: ...  # the node's resourceVersion after it
    async def evict(self, action: PodAction) -> str: ...
    async def delete_pod(self, action: PodAction) -> str: ...


class UpgradeController:
    """Started by the service runner when ``upgrade_controller`` is on. Its parts: the
    plan executor (``upgrade.executor``), what it announces (``upgrade.announce``, through
    the one Event publisher) and the status serializer (``upgrade.status``)."""

    def __init__(
        self,
        api_client: ApiClient | None,
        config: Config,
        recorder: EventPublisher | Emitter,
        *,
        is_leader: Callable[[], bool] | None = None,
        registry: CollectorRegistry | None = None,
        io: UpgradeIO | None = None,
        clock: Callable[[], float] = time.time,
        informers: Informers | None = None,
    ) -> None:
        """``recorder``: the service's one Event publisher, or a bare recorder (tests), put
        in a publisher of its own that keeps the meaning of dry-run."""
        self.settings = UpgradeSettings.from_config(config)
        self._config = config
        self._is_leader = is_leader or (lambda: True)
        self._clock = clock
        self.metrics = UpgradeMetrics(registry)
        self._runtime: Controller[str] = Controller(
            CONTROLLER,
            self._reconcile_key,
            metrics=RuntimeMetrics.of(self.metrics.registry),
            rate_limiter=ItemExponentialFailureRateLimiter(
                config.backoff_base_seconds, config.backoff_max_seconds
            ),
            workers=config.upgrade_workers,
            on_beat=self._publish,
        )
        self._changed = asyncio.Event()
        self._io = io if io is not None else self._kube_io(api_client, config, informers)
        # Node events -> node names. The newest version seen per node: the two node caches
        # deliver a change one after the other, the second copy is no change. The version
        # a patch by this controller answered: its echo is no change to look at (the pass
        # that wrote it planned on what it wrote, and asked to be polled while consumers
        # leave).
        self._newest: NewestVersions[str] = NewestVersions(name_of)
        self._own = WritesInFlight(name_of, release=self._runtime.enqueue)
        self.node_events = Enqueue(self._runtime.enqueue, name_of, (self._newest, self._own))
        self._io.add_node_handler(self.node_events)
        events = (
            recorder
            if isinstance(recorder, EventPublisher)
            else EventPublisher(recorder, dry_run=config.dry_run)
        )
        # Events go out from the leader, or (dry-run) to the publisher, which logs them.
        self._announcer = Announcer(events, sends=lambda: self._writing() or config.dry_run)
        self._executor = PlanExecutor(
            self._io,
            self.metrics,
            self._announcer,
            self._own,
            poll_seconds=self.settings.poll_seconds,
        )
        self._statuses: dict[str, NodeStatus] = {}
        self._errors: dict[str, str] = {}
        self.reconciles = 0
        self._ds_snapshot: tuple[K8sObject, ...] | None = None
        self._ds_index_cache: dict[str, DaemonSetRef] = {}
        self.gate: GateCheck | None = None  # the upgrade flow's gate, once the caches synced

    def _kube_io(
        self, api_client: ApiClient | None, config: Config, informers: Informers | None
    ) -> UpgradeIO:
        from shared_svc.upgrade.io import KubeUpgradeIO, upgrade_write_limiter

        if api_client is None:
            raise ValueError("the upgrade controller needs an API client or an io")
        return KubeUpgradeIO(
            api_client,
            self.settings.driver_name,
            on_change=self._changed.set,
            informers=informers,  # caches shared with the runner's
            write_limiter=upgrade_write_limiter(config),
        )

    # --- the runnable (shared_svc.runtime.runnable.Runnable) ---

    name = CONTROLLER
    needs_leader = False  # a follower plans too (status, warm caches); only the leader writes

    @property
    def _queue(self) -> WorkQueue[str]:
        return self._runtime.queue

    def ready(self) -> bool:
        return self._io.synced()

    def alive(self) -> bool:
        return self._runtime.alive()

    def leadership_changed(self, leader: bool) -> None:
        if leader:
            self.trigger()  # what the last leader left half done

    def trigger(self) -> None:
        """Look at every known node again now (the resync, becoming leader), and the gate."""
        for name in {*self._io.node_names(), *self._statuses}:
            self._runtime.enqueue(name)
        self._changed.set()

    def status(self) -> dict[str, Any]:
        phases: Counter[str] = Counter(s.phase for s in self._statuses.values())
        return {
            "enabled": True,
            "driver": self.settings.driver_name,
            "detection": self.settings.detection,
            "dryRun": self._config.dry_run,
            "writing": self._writing(),
            "synced": self._io.synced(),
            "phases": {phase: phases.get(phase, 0) for phase in PHASES},
            "nodes": nodes_json(self._statuses),
            "errors": dict(sorted(self._errors.items())),
            "gate": None if self.gate is None else gate_json(self.gate),
        }

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop``; then the nodes in flight are finished (bounded). The caches it
        reads are the Manager's (the runner's registry: started before, stopped after);
        an io of its own (tests) runs its caches here, and one that ends unexpectedly
        ends the controller. The gate review runs beside the workers, which start once
        the caches are synced (a node is never planned without its DaemonSets)."""
        resync = self._config.upgrade_resync_seconds
        io = asyncio.ensure_future(self._io.run(stop))
        helpers = [
            # The gate: reviewed when the ClusterPolicies or DaemonSets change, on the
            # resync (``trigger``) and at the latest every resync period.
            asyncio.ensure_future(
                repeat(
                    stop,
                    self._gate_step,
                    self._poll_until_synced(resync),
                    name="upgrade-gate",
                    wake=self._changed,
                )
            ),
            asyncio.ensure_future(every(stop, lambda: resync, self.trigger, name="upgrade-resync")),
        ]
        workers = asyncio.ensure_future(
            repeat(
                stop,
                self._workers_once_synced(stop),
                self._poll_until_synced(0),
                name="upgrade-workers",
            )
        )
        try:
            await asyncio.wait([io, workers], return_when=asyncio.FIRST_COMPLETED)
            if io.done() and not stop.is_set():
                io.result()  # raises what ended the caches
                raise RuntimeError("the upgrade controller's caches ended unexpectedly")
            await workers
        finally:
            for task in (io, workers, *helpers):
                task.cancel()
            await asyncio.gather(io, workers, *helpers, return_exceptions=True)

    # --- loops ---

    def _writing(self) -> bool:
        return not self._config.dry_run and self._is_leader()

    def _poll_until_synced(self, seconds: float) -> Callable[[], float]:
        """A period that is ``SYNC_POLL_SECONDS`` while the caches are not synced."""
        return lambda: seconds if self._io.synced() else SYNC_POLL_SECONDS

    def _workers_once_synced(self, stop: asyncio.Event) -> Callable[[], Any]:
        """The workers, once every cache has synced (controller-runtime's WaitForCacheSync):
        the nodes the first lists enqueued wait in the queue until then."""

        async def step() -> None:
            if self._io.synced():
                await self._runtime.run(stop)  # until ``stop``

        return step

    async def _gate_step(self) -> None:
        if self._io.synced():  # (a failure is logged by ``repeat``; the next change tries again)
            await self._review_gate()

    async def _review_gate(self) -> None:
        """Check the active ClusterPolicy's gate; a Warning on it when freeing races the
        driver restart: logged once and sent once per finding (by the leader, or dry-run),
        as one Event series across restarts."""
        self.gate, report = check_gate(self._io.cluster_policies(), self.settings.consumer_selector)
        await self._announcer.gate(report)

    async def _reconcile_key(self, name: str) -> Result:
        """One node, for the runtime's worker: what happened, and when to look again."""
        try:
            requeue = await self.reconcile(name)
        except NodeChanged:
            # Our patch met a newer node: plan again on it soon (not a failure).
            return Result("conflict", requeue_after=CONFLICT_RETRY_SECONDS, forget=False)
        except Exception as exc:
            self._errors[name] = f"{type(exc).__name__}: {exc}"[:500]
            log.warning(
                "upgrade reconcile failed; retrying",
                extra={
                    "node": name,
                    "error": self._errors[name],
                    "failures": self._runtime.queue.num_requeues(name) + 1,
                },
            )
            return Result("error", retry=True)
        self._errors.pop(name, None)
        return Result(requeue_after=requeue)

    # --- one node ---

    async def reconcile(self, name: str) -> float | None:
        """Plan one node and carry the plan out. Returns when to look again, if sooner than a change."""
        self.reconciles += 1
        node = await self._io.get_node(name)  # the node cache's copy: no request
        if node is None:
            self._statuses.pop(name, None)
            self._executor.forget(name)  # what was said, Events about a node that is gone
            self._newest.forget(name)
            self._own.forget(name)
            return None
        objects = self._io.daemonset_objects()
        ds_index = self._ds_index(objects)
        # Only the pods the plan depends on: none for a node not being freed and without
        # a record, and not the operator's own operands (issue 22).
        read = pods_read(node, ds_index, self.settings, objects)
        pods = await self._io.pods_on_node(name, read.skip_namespace) if read.needed else []
        if read.driver_namespace is not None:  # they tell the upgrade's path (upgrade/paths.py)
            pods += await self._io.driver_pods_on_node(name, read.driver_namespace)
        plan = plan_node(node, pods, objects, self.settings, now=self._clock(), ds_index=ds_index)
        # The pass holds its plan, not the pods, while its writes go out: 64 passes of a
        # wave at once each held a node's list of whole pods (issue 22: the wave's peak).
        del pods
        self._statuses[name] = plan.status
        if self._writing():
            await self._executor.carry_out(plan)
        else:
            await self._executor.show(plan, dry_run=self._config.dry_run)
        await self._announcer.notices(plan.notices)
        return plan.requeue_after

    def _ds_index(self, objects: tuple[K8sObject, ...]) -> dict[str, DaemonSetRef]:
        """The DaemonSet index, rebuilt only when the cache hands out a new snapshot."""
        if self._ds_snapshot is not objects:
            self._ds_snapshot = objects
            self._ds_index_cache = index_daemonsets(
                objects, parked_label_key(self.settings.driver_name)
            )
        return self._ds_index_cache

    def _publish(self) -> None:
        self.metrics.publish(
            self._statuses.values(),
            gate=None if self.gate is None else self.gate.state,
            now=self._clock(),
            eviction_timeout=self.settings.eviction_timeout_seconds,
        )
