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

from shared_svc.aio import sleep_or_stop, wait_any
from shared_svc.config import Config
from shared_svc.k8s.events import Report
from shared_svc.k8s.objects import K8sObject, camel_keys, name_of
from shared_svc.runtime.metrics import RuntimeMetrics
from shared_svc.runtime.runnable import Controller, Result, every
from shared_svc.runtime.source import Enqueue, NewestVersions, OwnWrites
from shared_svc.upgrade.daemonsets import DaemonSetRef, index_daemonsets, parked_label_key
from shared_svc.upgrade.gate import GateCheck, check_gate
from shared_svc.upgrade.metrics import PHASES, UpgradeMetrics
from shared_svc.upgrade.planner import (
    NodeChanged,
    NodePatch,
    NodePlan,
    NodeStatus,
    PodAction,
    deleted_patch,
    plan_node,
)
from shared_svc.upgrade.settings import UpgradeSettings
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


class Recorder(Protocol):
    async def emit(self, report: Report) -> bool: ...


class UpgradeIO(Protocol):
    """What ``shared_svc.upgrade.io.KubeUpgradeIO`` provides (tests run the controller on a fake with these methods)."""

    async def run(self, stop: asyncio.Event) -> None: ...
    def synced(self) -> bool: ...
    def add_node_handler(self, handler: EventHandler) -> None: ...  # node cache events
    def node_names(self) -> set[str]: ...  # every cached node (the resync's)
    def daemonset_objects(self) -> tuple[K8sObject, ...]: ...
    def cluster_policies(self) -> tuple[K8sObject, ...]: ...
    async def get_node(self, name: str) -> K8sObject | None: ...  # from a cache, no request
    async def pods_on_node(self, name: str) -> list[K8sObject]: ...
    async def patch_node(self, patch: NodePatch) -> str: ...  # the node's resourceVersion after it
    async def evict(self, action: PodAction) -> str: ...
    async def delete_pod(self, action: PodAction) -> str: ...


class UpgradeController:
    """Started by the service runner when ``upgrade_controller`` is on."""

    def __init__(
        self,
        api_client: ApiClient | None,
        config: Config,
        recorder: Recorder,
        *,
        is_leader: Callable[[], bool] | None = None,
        registry: CollectorRegistry | None = None,
        io: UpgradeIO | None = None,
        clock: Callable[[], float] = time.time,
        informers: Informers | None = None,
    ) -> None:
        self.settings = UpgradeSettings.from_config(config)
        self._config = config
        self._recorder = recorder
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
        if io is None:
            from shared_svc.upgrade.io import KubeUpgradeIO, upgrade_write_limiter

            if api_client is None:
                raise ValueError("the upgrade controller needs an API client or an io")
            io = KubeUpgradeIO(
                api_client,
                self.settings.driver_name,
                on_change=self._changed.set,
                informers=informers,  # caches shared with the runner's
                write_limiter=upgrade_write_limiter(config),
            )
        self._io = io
        # Node events -> node names. The newest version seen per node: the two node caches
        # deliver a change one after the other, the second copy is no change. The version
        # a patch by this controller answered: its echo is no change to look at (the pass
        # that wrote it planned on what it wrote, and asked to be polled while consumers
        # leave).
        self._newest: NewestVersions[str] = NewestVersions(name_of)
        self._own: OwnWrites[str] = OwnWrites(name_of)
        self.node_events = Enqueue(self._runtime.enqueue, name_of, (self._newest, self._own))
        io.add_node_handler(self.node_events)
        self._statuses: dict[str, NodeStatus] = {}
        self._errors: dict[str, str] = {}
        self._dry_reported: set[str] = set()  # dry-run/follower: each Report logged once
        self._unsent: dict[str, list[Report]] = {}  # node -> reports written, not yet sent
        self._notices_logged: set[str] = set()  # plan.notices: each logged once per process
        self._notices_sent: set[str] = set()  # ... and sent once as an Event
        # What was logged at INFO for a node's last plan; a repeat is logged at DEBUG.
        self._said: dict[str, dict[str, str]] = {}
        self.reconciles = 0
        self._ds_snapshot: tuple[K8sObject, ...] | None = None
        self._ds_index_cache: dict[str, DaemonSetRef] = {}
        self.gate: GateCheck | None = None  # the upgrade flow's gate, once the caches synced
        self._gate_logged: set[str] = set()  # gate Warnings: logged once, sent once (per process)
        self._gate_sent: set[str] = set()

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
            "nodes": {
                name: camel_keys(self._statuses[name].as_dict()) for name in sorted(self._statuses)
            },
            "errors": dict(sorted(self._errors.items())),
            "gate": None if self.gate is None else camel_keys(self.gate.as_dict()),
        }

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop``; then the nodes in flight are finished (bounded). The caches and
        the gate review run beside the workers, which start once the caches are synced (a
        node is never planned without its DaemonSets); a cache that ends unexpectedly ends
        the controller (the runner exits non-zero and Kubernetes restarts the pod)."""
        io = asyncio.ensure_future(self._io.run(stop))
        helpers = [
            asyncio.ensure_future(self._gate_loop(stop)),
            asyncio.ensure_future(
                every(
                    stop,
                    lambda: self._config.upgrade_resync_seconds,
                    self.trigger,
                    name="upgrade-resync",
                )
            ),
        ]
        workers = asyncio.ensure_future(self._run_when_synced(stop))
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

    async def _run_when_synced(self, stop: asyncio.Event) -> None:
        """The workers, once every cache has synced (controller-runtime's WaitForCacheSync):
        the nodes the first lists enqueued wait in the queue until then."""
        while not self._io.synced() and not stop.is_set():
            await sleep_or_stop(stop, 0.05)
        await self._runtime.run(stop)

    async def _gate_loop(self, stop: asyncio.Event) -> None:
        """Review the gate when the ClusterPolicies or DaemonSets change (``_changed``), on
        the resync (``trigger``) and at the latest every resync period. A review that fails
        is logged and the next change tries again."""
        while not stop.is_set():
            await wait_any(self._changed, stop, self._config.upgrade_resync_seconds)
            if stop.is_set():
                return
            self._changed.clear()
            if not self._io.synced():
                await sleep_or_stop(stop, 0.05)
                self._changed.set()
                continue
            try:
                await self._review_gate()
            except Exception:
                log.exception("upgrade gate review failed; trying again on the next change")

    async def _review_gate(self) -> None:
        """Check the active ClusterPolicy's gate; a Warning on it when freeing races the
        driver restart: logged once and sent once per finding (by the leader, or dry-run),
        as one Event series across restarts."""
        self.gate, report = check_gate(self._io.cluster_policies(), self.settings.consumer_selector)
        if report is None:
            # Fixed (or no flow): a finding that comes back later is reported again.
            self._gate_logged.clear()
            self._gate_sent.clear()
            return
        if report.key not in self._gate_logged:
            self._gate_logged.add(report.key)
            log.warning("%s: %s", report.reason, report.note, extra={"event": report.reason})
        sends = self._writing() or self._config.dry_run
        if sends and report.key not in self._gate_sent and await self._recorder.emit(report):
            self._gate_sent.add(report.key)

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
            self._said.pop(name, None)
            self._unsent.pop(name, None)  # Events about a node that is gone (or not ours)
            self._newest.forget(name)
            self._own.forget(name)
            return None
        pods = await self._io.pods_on_node(name)
        objects = self._io.daemonset_objects()
        plan = plan_node(
            node, pods, objects, self.settings, now=self._clock(), ds_index=self._ds_index(objects)
        )
        self._statuses[name] = plan.status
        if self._writing():
            await self._carry_out(plan)
        else:
            await self._show(plan)
        await self._notice(plan)
        return plan.requeue_after

    async def _notice(self, plan: NodePlan) -> None:
        """Reports no record write keeps from repeating: logged once, sent once (per process)."""
        for report in plan.notices:
            if report.key not in self._notices_logged:
                self._notices_logged.add(report.key)
                log.warning(
                    "%s: %s",
                    report.reason,
                    report.note,
                    extra={"node": plan.node, "event": report.reason},
                )
            sends = self._writing() or self._config.dry_run
            if sends and report.key not in self._notices_sent and await self._recorder.emit(report):
                self._notices_sent.add(report.key)

    def _say(self, said: dict[str, str], node: str, what: str, line: str, **extra: Any) -> None:
        """Log ``line`` at INFO the first time ``what`` says it about the node, then at DEBUG."""
        previous = self._said.get(node, {}).get(what)
        said[what] = line
        level = logging.DEBUG if previous == line else logging.INFO
        log.log(level, line, extra={"node": node, **extra})

    def _ds_index(self, objects: tuple[K8sObject, ...]) -> dict[str, DaemonSetRef]:
        """The DaemonSet index, rebuilt only when the cache hands out a new snapshot."""
        if self._ds_snapshot is not objects:
            self._ds_snapshot = objects
            self._ds_index_cache = index_daemonsets(
                objects, parked_label_key(self.settings.driver_name)
            )
        return self._ds_index_cache

    async def _carry_out(self, plan: NodePlan) -> None:
        if plan.patch is not None:
            try:
                self._own.wrote(plan.node, await self._io.patch_node(plan.patch))
            except NodeChanged:
                self.metrics.node_patches.labels(outcome="conflict").inc()
                raise
            self.metrics.node_patches.labels(outcome="ok").inc()
            if plan.status.phase in ("restoring", "aborting"):
                self.metrics.restores.labels(
                    cause="done" if plan.status.phase == "restoring" else "aborted"
                ).inc()
        said: dict[str, str] = {}
        # The evictions (or deletes) of one node are independent: sent at once, each
        # outcome counted and logged in plan order; the first failure is raised after.
        outcomes = await asyncio.gather(
            *(
                self._io.evict(action) if action.verb == "evict" else self._io.delete_pod(action)
                for action in plan.pod_actions
            ),
            return_exceptions=True,
        )
        failure: BaseException | None = None
        for action, outcome in zip(plan.pod_actions, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                failure = failure or outcome
                continue
            if action.verb == "evict":
                self.metrics.evictions.labels(outcome=outcome).inc()
            else:
                self.metrics.deletions.inc()
            self._say(
                said,
                plan.node,
                f"{action.key}/{action.uid}",
                _outcome_line(action, outcome, self.settings.poll_seconds),
                pod=action.key,
                why=action.why,
            )
        self._said[plan.node] = said
        deleted = {
            action.uid
            for action, outcome in zip(plan.pod_actions, outcomes, strict=True)
            if action.verb == "delete" and outcome == "evicted"
        }
        if (after := deleted_patch(plan, deleted)) is not None:
            try:
                # the record says deleted once it is true
                self._own.wrote(plan.node, await self._io.patch_node(after))
            except Exception as exc:
                failure = failure or exc
            else:
                self.metrics.node_patches.labels(outcome="ok").inc()
        # The reports ride with the node patch just written (its record says they are
        # sent): sent whatever became of the pod actions, before a failure is raised.
        await self._report(plan.node, plan.reports)
        if failure is not None:
            raise failure

    async def _report(self, node: str, reports: tuple[Report, ...]) -> None:
        """Send reports whose record write is done; one that fails is sent again on the
        node's next pass (its record will not plan it again)."""
        due = {r.key: r for r in (*self._unsent.pop(node, ()), *reports)}
        unsent = [r for r in due.values() if not await self._recorder.emit(r)]
        if unsent:
            self._unsent[node] = unsent

    async def _show(self, plan: NodePlan) -> None:
        """Dry-run or follower: say once what would be written, and (dry-run) report it.

        A plan that is not carried out is the same on every poll: its lines are logged at
        INFO once, and at DEBUG (with the whole node patch) while they repeat.
        """
        said: dict[str, str] = {}
        who = "dry run" if self._config.dry_run else "standby (not the leader)"
        for write in plan.writes:
            if isinstance(write, PodAction):
                self._say(
                    said,
                    plan.node,
                    write.key,
                    f"{who}: would {write.verb} GPU consumer {write.key} ({write.why})",
                )
            else:
                self._say(
                    said, plan.node, "patch", f"{who}: would patch node: {_patch_summary(write)}"
                )
                log.debug("%s: node patch %s", who, write.body(), extra={"node": plan.node})
        self._said[plan.node] = said
        if not self._config.dry_run:
            return
        for report in plan.reports:
            if report.key not in self._dry_reported:
                self._dry_reported.add(report.key)
                await self._recorder.emit(report)

    def _publish(self) -> None:
        phases: Counter[str] = Counter(s.phase for s in self._statuses.values())
        for phase in PHASES:
            self.metrics.nodes.labels(phase=phase).set(phases.get(phase, 0))
        self.metrics.pending_pods.set(sum(len(s.pending) for s in self._statuses.values()))
        self.metrics.blocked_pods.set(sum(len(s.blocked) for s in self._statuses.values()))


def _outcome_line(action: PodAction, outcome: str, poll_seconds: float) -> str:
    """One log line saying what happened to one pod action."""
    if outcome == "gone":
        return f"GPU consumer {action.key} already gone (or replaced): nothing to {action.verb}"
    if action.verb == "delete":
        return f"deleted GPU consumer {action.key} after the eviction timeout (its PodDisruptionBudget ignored)"
    if outcome == "blocked":
        return (
            f"eviction of GPU consumer {action.key} refused (429, a PodDisruptionBudget): "
            f"retrying every {poll_seconds:g}s until the eviction timeout"
        )
    return f"evicted GPU consumer {action.key} ({action.why})"


def _patch_summary(patch: NodePatch) -> str:
    """What a node patch does, in words (stable across polls: the record's times are left out)."""
    parts = [
        f"label {key}={value}" if value is not None else f"remove label {key}"
        for key, value in patch.labels
    ]
    parts += [
        f"write record {key}" if value is not None else f"remove record {key}"
        for key, value in patch.annotations
    ]
    return ", ".join(parts)
