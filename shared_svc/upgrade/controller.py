"""The driver-upgrade loop: per node, on each change and on a periodic resync,
read node + pods -> ``plan_node`` -> writes -> Events.

Nodes are independent: a work queue hands each node to one worker at a time (several
nodes at once), a change that arrives while a node is being handled runs it once more
afterwards, failures are retried per node with capped exponential backoff, and nothing
escapes the loop. Only the leader writes; a follower (or dry-run) plans and reports
status only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from shared_svc.aio import sleep_or_stop
from shared_svc.config import Config
from shared_svc.reconcile.model import K8sObject, Report
from shared_svc.upgrade.daemonsets import DaemonSetRef, index_daemonsets, parked_label_key
from shared_svc.upgrade.gate import GateCheck, check_gate
from shared_svc.upgrade.metrics import PHASES, UpgradeMetrics
from shared_svc.upgrade.planner import (
    NodeChanged,
    NodePatch,
    NodePlan,
    NodeStatus,
    PodAction,
    plan_node,
)
from shared_svc.upgrade.settings import UpgradeSettings

log = logging.getLogger(__name__)

# How long a node waits before its next try after a failure, at most (seconds).
CONFLICT_RETRY_SECONDS = 0.05


class Recorder(Protocol):
    async def emit(self, report: Report) -> bool: ...


class UpgradeIO(Protocol):
    """What ``shared_svc.upgrade.io.KubeUpgradeIO`` provides (a fake runs the benchmark)."""

    async def run(self, stop: asyncio.Event) -> None: ...
    def synced(self) -> bool: ...
    def node_versions(self) -> dict[str, str]: ...
    def daemonset_objects(self) -> tuple[K8sObject, ...]: ...
    def cluster_policies(self) -> tuple[K8sObject, ...]: ...
    async def get_node(self, name: str) -> K8sObject | None: ...
    async def pods_on_node(self, name: str) -> list[K8sObject]: ...
    async def patch_node(self, patch: NodePatch) -> None: ...
    async def evict(self, action: PodAction) -> str: ...
    async def delete_pod(self, action: PodAction) -> str: ...


DRAIN_SECONDS = 30.0  # how long shutdown waits for the nodes in flight


class NodeQueue:
    """A de-duplicating work queue of node names (controller-runtime's semantics)."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._queued: set[str] = set()
        self._active: set[str] = set()
        self._dirty: set[str] = set()
        self._timers: dict[str, tuple[float, asyncio.TimerHandle]] = {}
        self.idle = asyncio.Event()  # set while no worker is reconciling a node
        self.idle.set()

    def __len__(self) -> int:
        return len(self._queued)

    def add(self, name: str) -> None:
        if name in self._active:
            self._dirty.add(name)
        elif name not in self._queued:
            self._queued.add(name)
            self._queue.put_nowait(name)

    def add_after(self, name: str, delay: float) -> None:
        """Add later; a pending earlier timer for the same node wins."""
        loop = asyncio.get_running_loop()
        due = loop.time() + max(0.0, delay)
        current = self._timers.get(name)
        if current is not None and current[0] <= due:
            return
        if current is not None:
            current[1].cancel()
        self._timers[name] = (due, loop.call_at(due, self._fire, name))

    def _fire(self, name: str) -> None:
        self._timers.pop(name, None)
        self.add(name)

    async def get(self) -> str:
        name = await self._queue.get()
        self._queued.discard(name)
        self._active.add(name)
        self.idle.clear()
        return name

    def done(self, name: str) -> None:
        self._active.discard(name)
        if not self._active:
            self.idle.set()
        if name in self._dirty:
            self._dirty.discard(name)
            self.add(name)

    def close(self) -> None:
        for _, handle in self._timers.values():
            handle.cancel()
        self._timers.clear()


class UpgradeController:
    """Started by the service runner when ``upgrade_controller`` is on."""

    def __init__(
        self,
        api_client: Any,
        config: Config,
        recorder: Recorder,
        *,
        is_leader: Callable[[], bool] | None = None,
        registry: CollectorRegistry | None = None,
        io: UpgradeIO | None = None,
        clock: Callable[[], float] = time.time,
        informers: Any = None,
    ) -> None:
        self.settings = UpgradeSettings.from_config(config)
        self._config = config
        self._recorder = recorder
        self._is_leader = is_leader or (lambda: True)
        self._clock = clock
        self.metrics = UpgradeMetrics(registry)
        self._queue = NodeQueue()
        self._changed = asyncio.Event()
        if io is None:
            from shared_svc.upgrade.io import KubeUpgradeIO

            io = KubeUpgradeIO(
                api_client,
                self.settings.driver_name,
                on_change=self._changed.set,
                resync_seconds=config.upgrade_resync_seconds,
                informers=informers,  # kube.cache.Informers: caches shared with the runner's
            )
        self._io = io
        self._seen: dict[str, str] = {}
        self._statuses: dict[str, NodeStatus] = {}
        self._errors: dict[str, str] = {}
        self._failures: Counter[str] = Counter()
        self._dry_reported: set[str] = set()  # dry-run/follower: each Report logged once
        self._notices_logged: set[str] = set()  # plan.notices: each logged once per process
        self._notices_sent: set[str] = set()  # ... and sent once as an Event
        # What was logged at INFO for a node's last plan; a repeat is logged at DEBUG.
        self._said: dict[str, dict[str, str]] = {}
        self.reconciles = 0
        self.heartbeat = time.monotonic()  # the runner's liveness check reads it
        self._ds_snapshot: tuple[K8sObject, ...] | None = None
        self._ds_index_cache: dict[str, DaemonSetRef] = {}
        self.gate: GateCheck | None = None  # the upgrade flow's gate, once the caches synced
        self._gate_logged: set[str] = set()  # gate Warnings: logged once, sent once (per process)
        self._gate_sent: set[str] = set()

    # --- the public face for the runner ---

    def notify(self) -> None:
        """Something changed (the IO's caches call this): look at the nodes again."""
        self._changed.set()

    def trigger(self) -> None:
        """Look at every known node again now (e.g. on becoming leader), and the gate."""
        for name in {*self._seen, *self._statuses}:
            self._queue.add(name)
        self._changed.set()

    def status(self) -> dict[str, Any]:
        phases: Counter[str] = Counter(s.phase for s in self._statuses.values())
        return {
            "enabled": True,
            "driver": self.settings.driver_name,
            "detection": self.settings.detection,
            "dry_run": self._config.dry_run,
            "writing": self._writing(),
            "synced": self._io.synced(),
            "phases": {phase: phases.get(phase, 0) for phase in PHASES},
            "nodes": {name: self._statuses[name].as_dict() for name in sorted(self._statuses)},
            "errors": dict(sorted(self._errors.items())),
            "gate": None if self.gate is None else self.gate.as_dict(),
        }

    async def run(self, stop: asyncio.Event) -> None:
        tasks = [
            asyncio.create_task(self._guard("io", self._io.run, stop)),
            asyncio.create_task(self._guard("scan", self._scan_loop, stop)),
            asyncio.create_task(self._guard("resync", self._resync_loop, stop)),
            asyncio.create_task(self._guard("heartbeat", self._beat_loop, stop)),
        ]
        tasks += [
            asyncio.create_task(self._guard(f"worker-{i}", self._worker, stop))
            for i in range(self._config.upgrade_workers)
        ]
        try:
            await stop.wait()
            # As the Services controller does: finish the nodes in flight before stopping, so
            # a SIGTERM never cuts a node's writes in half (bounded: a stuck call is cut).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._queue.idle.wait(), DRAIN_SECONDS)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._queue.close()

    # --- loops ---

    async def _guard(
        self, name: str, loop: Callable[[asyncio.Event], Any], stop: asyncio.Event
    ) -> None:
        """Never crash: a loop that fails is logged and started again after a pause."""
        delay = 0.1
        while not stop.is_set():
            try:
                await loop(stop)
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("upgrade controller loop failed; restarting it", extra={"loop": name})
                await sleep_or_stop(stop, delay)
                delay = min(delay * 2, self._config.backoff_max_seconds)

    def _writing(self) -> bool:
        return not self._config.dry_run and self._is_leader()

    async def _scan_loop(self, stop: asyncio.Event) -> None:
        """Turn cache changes into node names: new or changed resourceVersion, or gone."""
        while not stop.is_set():
            await _wait_or_stop(stop, self._changed)
            self._changed.clear()
            if not self._io.synced():
                await sleep_or_stop(stop, 0.05)
                self._changed.set()
                continue
            versions = self._io.node_versions()
            for name, version in versions.items():
                if self._seen.get(name) != version:
                    self._queue.add(name)
            for name in set(self._seen) - set(versions):
                self._queue.add(name)  # label vanished (or node deleted): look once more
            self._seen = versions
            self.metrics.queue_depth.set(len(self._queue))
            await self._review_gate()

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

    async def _beat_loop(self, stop: asyncio.Event) -> None:
        """Liveness and the per-phase gauges (summed here, not on every reconcile: O(nodes))."""
        while not stop.is_set():
            self.heartbeat = time.monotonic()
            self._publish()
            await sleep_or_stop(stop, 1.0)

    async def _resync_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await sleep_or_stop(stop, self._config.upgrade_resync_seconds)
            self.trigger()

    async def _worker(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            name = await self._queue.get()
            started = time.perf_counter()
            try:
                requeue = await self.reconcile(name)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._failed(name, exc)
            else:
                self._failures.pop(name, None)
                self._errors.pop(name, None)
                self.metrics.reconcile_total.labels(result="ok").inc()
                if requeue is not None:
                    self._queue.add_after(name, requeue)
            finally:
                self.metrics.reconcile_time.observe(time.perf_counter() - started)
                self._queue.done(name)
                self.metrics.queue_depth.set(len(self._queue))

    def _failed(self, name: str, exc: Exception) -> None:
        if isinstance(exc, NodeChanged):
            self.metrics.reconcile_total.labels(result="conflict").inc()
            self._queue.add_after(name, CONFLICT_RETRY_SECONDS)
            return
        self._failures[name] += 1
        n = self._failures[name]
        delay = min(
            self._config.backoff_max_seconds, self._config.backoff_base_seconds * 2 ** min(n, 30)
        )
        self._errors[name] = f"{type(exc).__name__}: {exc}"[:500]
        self.metrics.reconcile_total.labels(result="error").inc()
        log.warning(
            "upgrade reconcile failed; retrying",
            extra={"node": name, "error": self._errors[name], "retry_in": round(delay, 3)},
        )
        self._queue.add_after(name, delay)

    # --- one node ---

    async def reconcile(self, name: str) -> float | None:
        """Plan one node and carry the plan out. Returns when to look again, if sooner than a change."""
        self.reconciles += 1
        node = await self._io.get_node(name)
        if node is None:
            self._statuses.pop(name, None)
            self._said.pop(name, None)
            return None
        pods = await self._io.pods_on_node(name)
        objects = self._io.daemonset_objects()
        plan = plan_node(
            node, pods, objects, self.settings, now=self._clock(), ds_index=self._ds_index(objects)
        )
        self._statuses[name] = plan.status
        if self._writing():
            await self._carry_out(plan)
            for report in plan.reports:
                await self._recorder.emit(report)
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
                await self._io.patch_node(plan.patch)
            except NodeChanged:
                self.metrics.node_patches.labels(outcome="conflict").inc()
                raise
            self.metrics.node_patches.labels(outcome="ok").inc()
            if plan.status.phase in ("restoring", "aborting"):
                self.metrics.restores.labels(
                    cause="done" if plan.status.phase == "restoring" else "aborted"
                ).inc()
        said: dict[str, str] = {}
        try:
            for action in plan.pod_actions:
                if action.verb == "evict":
                    outcome = await self._io.evict(action)
                    self.metrics.evictions.labels(outcome=outcome).inc()
                else:
                    outcome = await self._io.delete_pod(action)
                    self.metrics.deletions.inc()
                self._say(
                    said,
                    plan.node,
                    f"{action.key}/{action.uid}",
                    _outcome_line(action, outcome, self.settings.poll_seconds),
                    pod=action.key,
                    why=action.why,
                )
        finally:
            self._said[plan.node] = said

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


async def _wait_or_stop(stop: asyncio.Event, event: asyncio.Event) -> None:
    waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(event.wait())]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
