"""Carrying out one node's plan (the leader), or showing it (dry-run, a follower).

The leader writes the node patch, sends the node's evictions (or deletes) at once, writes
the record of the deletes that were accepted, then sends the reports that ride the patch
(``Announcer.written``), whatever became of the pod actions, before a failure is raised.
A plan that is not carried out is the same on every poll: its lines are logged at INFO
once, and at DEBUG while they repeat (``Said``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from shared_svc.controllers.upgrade.announce import Announcer
from shared_svc.controllers.upgrade.metrics import UpgradeMetrics
from shared_svc.runtime.source import WritesInFlight
from shared_svc.upgrade.node_plan import NodeChanged, NodePatch, NodePlan, PodAction, deleted_patch

if TYPE_CHECKING:
    from shared_svc.controllers.upgrade.io import UpgradeIO

log = logging.getLogger("shared_svc.upgrade.controller")  # the controller's log


class Said:
    """What was logged at INFO for each node's last plan; a line repeated by the next plan
    is logged at DEBUG. A line the last plan did not say is said at INFO again."""

    def __init__(self) -> None:
        self._said: dict[str, dict[str, str]] = {}

    def plan(self, node: str) -> _Lines:
        return _Lines(self._said.get(node, {}), node)

    def done(self, lines: _Lines) -> None:
        self._said[lines.node] = lines.said

    def forget(self, node: str) -> None:
        self._said.pop(node, None)


class _Lines:
    def __init__(self, previous: dict[str, str], node: str) -> None:
        self._previous = previous
        self.node = node
        self.said: dict[str, str] = {}

    def say(self, what: str, line: str, **extra: Any) -> None:
        """Log ``line`` at INFO the first time ``what`` says it about the node, then at DEBUG."""
        self.said[what] = line
        level = logging.DEBUG if self._previous.get(what) == line else logging.INFO
        log.log(level, line, extra={"node": self.node, **extra})


class PlanExecutor:
    def __init__(
        self,
        io: UpgradeIO,
        metrics: UpgradeMetrics,
        announcer: Announcer,
        own: WritesInFlight[str],
        *,
        poll_seconds: float,
    ) -> None:
        self._io = io
        self._metrics = metrics
        self._announcer = announcer
        self._own = own  # the versions our node patches answered (their echo is no change)
        self._poll_seconds = poll_seconds
        self.said = Said()

    def forget(self, node: str) -> None:
        self.said.forget(node)
        self._announcer.forget(node)

    async def carry_out(self, plan: NodePlan) -> None:
        if plan.patch is not None:
            await self._patch(plan)
        lines = self.said.plan(plan.node)
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
            self._count(action, outcome)
            lines.say(
                f"{action.key}/{action.uid}",
                outcome_line(action, outcome, self._poll_seconds),
                pod=action.key,
                why=action.why,
            )
        self.said.done(lines)
        failure = failure or await self._record_deletes(plan, outcomes)
        # The reports ride with the node patch just written (its record says they are
        # sent): sent whatever became of the pod actions, before a failure is raised.
        await self._announcer.written(plan.node, plan.reports)
        if failure is not None:
            raise failure

    async def _patch(self, plan: NodePlan) -> None:
        assert plan.patch is not None
        try:
            await self._write(plan.patch)
        except NodeChanged:
            self._metrics.node_patches.labels(outcome="conflict").inc()
            raise
        self._metrics.node_patches.labels(outcome="ok").inc()
        if plan.status.phase in ("restoring", "aborting"):
            cause = "done" if plan.status.phase == "restoring" else "aborted"
            self._metrics.restores.labels(cause=cause).inc()

    async def _write(self, patch: NodePatch) -> None:
        """One node patch; its echo is known (``WritesInFlight``) whatever comes first."""
        self._own.writing(patch.node)
        try:
            version = await self._io.patch_node(patch)
        except BaseException:
            self._own.failed(patch.node)
            raise
        self._own.wrote(patch.node, version)

    def _count(self, action: PodAction, outcome: str) -> None:
        if action.verb == "evict":
            self._metrics.evictions.labels(outcome=outcome).inc()
        else:
            self._metrics.deletions.inc()

    async def _record_deletes(
        self, plan: NodePlan, outcomes: list[str | BaseException]
    ) -> BaseException | None:
        """The record says deleted once it is true: written after the accepted deletes."""
        deleted = {
            action.uid
            for action, outcome in zip(plan.pod_actions, outcomes, strict=True)
            if action.verb == "delete" and outcome == "evicted"
        }
        if (after := deleted_patch(plan, deleted)) is None:
            return None
        try:
            await self._write(after)
        except Exception as exc:
            return exc
        self._metrics.node_patches.labels(outcome="ok").inc()
        return None

    async def show(self, plan: NodePlan, *, dry_run: bool) -> None:
        """Dry-run or follower: say once what would be written, and (dry-run) hand its
        reports to the publisher, which logs each once instead of sending it."""
        lines = self.said.plan(plan.node)
        who = "dry run" if dry_run else "standby (not the leader)"
        for write in plan.writes:
            if isinstance(write, PodAction):
                lines.say(
                    write.key, f"{who}: would {write.verb} GPU consumer {write.key} ({write.why})"
                )
            else:
                lines.say("patch", f"{who}: would patch node: {patch_summary(write)}")
                log.debug("%s: node patch %s", who, write.body(), extra={"node": plan.node})
        self.said.done(lines)
        if dry_run:
            await self._announcer.dry_run(plan.reports)


def outcome_line(action: PodAction, outcome: str, poll_seconds: float) -> str:
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


def patch_summary(patch: NodePatch) -> str:
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
