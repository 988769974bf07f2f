"""The driver-upgrade controller: per node, on each change and on a periodic resync,
read node + pods -> ``plan_node`` -> writes -> Events.

What it reads, declared (``runtime.controller.Controller.watch``): the two node caches
(``caches.py``), each event keyed by the node it is about, let through when it brings a
resourceVersion newer than any seen for that node (of the two node caches, the first
copy counts) and is not the echo of this controller's own node patch. No event reads the
cache, so its cost does not depend on the number of nodes. The resync
(``upgrade_resync_seconds``) enqueues the cached nodes a pass can still change
(``upgrade/resync.py``: not those at rest, ``upgrade-done`` with nothing of ours, as
gpu-operator leaves a fleet), as client-go's resync replays its cache. The runtime adds
the handlers, waits for every cache to sync, then starts the workers; the upgrade flow's gate is reviewed by a Runnable of its own
(``gate_review.py``), run by the Manager beside this controller (:meth:`runnables`).

Nodes are independent: the runtime's work queue hands each node to one worker at a time
(``upgrade_workers`` nodes at once), a change that arrives while a node is being handled
runs it once more afterwards, failures are retried per node with the runtime's capped
exponential backoff, and nothing escapes a worker. A pass reads the node from the node
cache (no GET) and sends the evictions (or deletes) of the node at once. Every write
(node patch, eviction, delete) waits for a token of one bucket
(``upgrade_writes_per_second``, ``upgrade_writes_burst``). Only the leader writes; a
follower (or dry-run) plans and reports status only.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from shared_svc.config import Config
from shared_svc.controllers.upgrade.announce import Announcer
from shared_svc.controllers.upgrade.caches import UpgradeCaches
from shared_svc.controllers.upgrade.executor import PlanExecutor
from shared_svc.controllers.upgrade.gate_review import GateReview
from shared_svc.controllers.upgrade.io import UpgradeIO
from shared_svc.controllers.upgrade.metrics import PHASES, UpgradeMetrics
from shared_svc.controllers.upgrade.status import gate_json, nodes_json
from shared_svc.k8s.objects import K8sObject, name_of
from shared_svc.kube.recorder import Emitter, EventPublisher, publisher_of
from shared_svc.kube.registry import CacheRegistry
from shared_svc.kube.writer import WriteMode, write_mode
from shared_svc.runtime.controller import Controller, Options, Result
from shared_svc.runtime.instrumentation import RuntimeMetrics
from shared_svc.runtime.manager import Runnable
from shared_svc.runtime.source import Enqueue, NewestVersions, WritesInFlight, all_synced
from shared_svc.upgrade.daemonsets import DaemonSetRef, index_daemonsets, parked_label_key
from shared_svc.upgrade.node_plan import NodeChanged, NodeStatus
from shared_svc.upgrade.planner import plan_node
from shared_svc.upgrade.pods import pods_read
from shared_svc.upgrade.policy import GPU_OPERATOR_DRIVER
from shared_svc.upgrade.resync import resync_keys
from shared_svc.upgrade.settings import UpgradeSettings
from shared_svc.wait.ratelimit import ItemExponentialFailureRateLimiter

log = logging.getLogger("shared_svc.upgrade.controller")  # the name its log lines have always had

CONTROLLER = "upgrade"  # the ``controller`` / ``name`` label of the runtime's metrics
# How long a node whose patch met a newer node (409) waits before its next try (seconds).
CONFLICT_RETRY_SECONDS = 0.05


class UpgradeReconciler:
    """Started by the service runner when ``upgrade_controller`` is on; the runtime's
    Controller is built from it (``runtime.controller.controller_for``). Its parts: what it
    reads (``caches.UpgradeCaches``, from the process's registry), its API calls
    (``io.UpgradeIO``), the plan executor (``executor``), what it announces
    (``announce``, through the one Event publisher), the gate review (``gate_review``)
    and the status serializer (``status``)."""

    name = CONTROLLER

    def __init__(
        self,
        config: Config,
        recorder: EventPublisher | Emitter,
        *,
        caches: CacheRegistry,
        io: UpgradeIO,
        is_leader: Callable[[], bool] | None = None,
        metrics: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``recorder``: the service's one Event publisher, or a bare recorder (tests), put
        in a publisher of its own that keeps the meaning of dry-run."""
        self.settings = UpgradeSettings.from_config(config)
        self._config = config
        self._is_leader = is_leader or (lambda: True)
        self._clock = clock
        self.metrics = UpgradeMetrics(metrics)
        self.caches = UpgradeCaches.of(caches, self.settings.driver_name)
        self._io = io
        self.options = self._options(config)
        # The newest version seen per node: the two node caches deliver a change one
        # after the other, the second copy is no change. The version a patch by this
        # reconciler answered: its echo is no change to look at (the pass that wrote it
        # planned on what it wrote, and asked to be polled while consumers leave); an
        # event held while the patch is in flight is released to the queue (``setup``).
        self._newest: NewestVersions[str] = NewestVersions(name_of)
        self._own: WritesInFlight[str] = WritesInFlight(name_of)
        self.node_events: tuple[Enqueue[str], ...] = ()  # the node caches' handlers
        self._failures: Callable[[str], int] = lambda _: 0  # the queue's retry count
        events = publisher_of(recorder, dry_run=config.dry_run)
        # Events go out from the leader: to the API, or (dry-run) to the publisher, which
        # logs them.
        self._announcer = Announcer(events, sends=lambda: self._mode() != "standby")
        self._executor = PlanExecutor(
            self._io,
            self.metrics,
            self._announcer,
            self._own,
            poll_seconds=self.settings.poll_seconds,
        )
        self.gate_review = GateReview(
            self.caches.policy_caches(),
            self.caches.cached_nodes,
            self.settings.consumer_selector,
            self._announcer,
            seconds=lambda: config.upgrade_resync_seconds,
        )
        # gpu-operator's policy sources decide which nodes a flow moves (upgrade/policy.py)
        # for its own driver name only.
        self._gpu_operator_flow = self.settings.driver_name == GPU_OPERATOR_DRIVER
        self._statuses: dict[str, NodeStatus] = {}  # shown; each change told to the metrics
        self._errors: dict[str, str] = {}
        self.reconciles = 0
        self._ds_snapshot: tuple[K8sObject, ...] | None = None
        self._ds_index_cache: dict[str, DaemonSetRef] = {}

    # --- how the runtime runs it (``runtime.controller.Reconciler``) ---

    def _options(self, config: Config) -> Options:
        """``upgrade_workers`` nodes at once, retried with the capped backoff; each beat
        publishes the gauges. A follower plans too (status, warm caches); only the leader
        writes."""
        return Options(
            metrics=RuntimeMetrics.of(self.metrics.registry),
            rate_limiter=ItemExponentialFailureRateLimiter(
                config.backoff_base_seconds, config.backoff_max_seconds
            ),
            workers=config.upgrade_workers,
            on_beat=self._publish,
        )

    def setup(self, controller: Controller[str]) -> None:
        """Node events -> node names, through the newest-version and echo filters; the
        DaemonSets waited for (a change keys no node); the resync over the nodes a pass can
        still change; the gate review's changed sources plan every node again."""
        self.node_events = tuple(
            controller.watch(cache, name_of, self._newest, self._own) for cache in self.caches.nodes
        )
        controller.reads(self.caches.daemonsets)
        controller.resync(lambda: self._config.upgrade_resync_seconds, self._known_nodes)
        self._own.release = controller.enqueue
        self.gate_review.on_sources = controller.enqueue_all
        self._failures = controller.failures

    def parts(self) -> list[Runnable]:
        """The gate review (a Runnable of the service's Manager, after the registry's
        caches, before the controller)."""
        return [self.gate_review]

    def ready(self) -> bool:
        return True  # once its caches are synced (the runtime's part of ready)

    def _known_nodes(self) -> set[str]:
        return resync_keys(self.caches.cached_nodes(), self._statuses, self.settings.driver_name)

    def status(self) -> dict[str, Any]:
        phases: Counter[str] = Counter(s.phase for s in self._statuses.values())
        gate = self.gate_review.gate
        return {
            "enabled": True,
            "driver": self.settings.driver_name,
            "detection": self.settings.detection,
            "dryRun": self._config.dry_run,
            "writing": self._mode() == "write",
            "synced": all_synced(self.caches.read()),
            "phases": {phase: phases.get(phase, 0) for phase in PHASES},
            "nodes": nodes_json(self._statuses),
            "errors": dict(sorted(self._errors.items())),
            "gate": None if gate is None else gate_json(gate),
        }

    def _mode(self) -> WriteMode:
        return write_mode(leader=self._is_leader(), dry_run=self._config.dry_run)

    async def reconcile(self, name: str) -> Result:
        """One node: what happened, and when to look again (sooner than a change)."""
        self.reconciles += 1
        try:
            requeue = await self._pass(name)
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
                    "failures": self._failures(name) + 1,
                },
            )
            return Result("error", retry=True)
        self._errors.pop(name, None)
        return Result(requeue_after=requeue)

    # --- one node ---

    async def _pass(self, name: str) -> float | None:
        """Plan one node and carry the plan out. Returns when to look again, if sooner than a change."""
        node = self.caches.get_node(name)  # the node cache's copy: no request
        if node is None:
            if (shown := self._statuses.pop(name, None)) is not None:
                self.metrics.changed(shown, None)
            self._executor.forget(name)  # what was said, Events about a node that is gone
            self._newest.forget(name)
            self._own.forget(name)
            return None
        objects = self.caches.daemonsets.items()  # the same tuple until the DaemonSets change
        ds_index = self._ds_index(objects)
        # Only the pods the plan depends on: none for a node not being freed and without
        # a record, and not the operator's own operands (issue 22).
        flow = self.gate_review.flow(node) if self._gpu_operator_flow else None
        read = pods_read(node, ds_index, self.settings, objects, flow)
        pods = await self._io.pods_on_node(name, read.skip_namespace) if read.needed else []
        if read.driver_namespace is not None:  # they tell the upgrade's path (upgrade/paths.py)
            pods += await self._io.driver_pods_on_node(name, read.driver_namespace)
        plan = plan_node(
            node, pods, objects, self.settings, now=self._clock(), ds_index=ds_index, flow=flow
        )
        # The pass holds its plan, not the pods, while its writes go out: 64 passes of a
        # wave at once each held a node's list of whole pods (issue 22: the wave's peak).
        del pods
        if (shown := self._statuses.get(name)) != plan.status:
            self._statuses[name] = plan.status
            self.metrics.changed(shown, plan.status)
        if (mode := self._mode()) == "write":
            await self._executor.carry_out(plan)
        else:
            await self._executor.show(plan, dry_run=mode == "dry-run")
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
            gate=self.gate_review.gate,
            now=self._clock(),
            eviction_timeout=self.settings.eviction_timeout_seconds,
        )
