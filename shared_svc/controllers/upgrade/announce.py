"""What the upgrade controller announces, through the one Event publisher
(``shared_svc.kube.recorder.EventPublisher``) and its ``once`` / ``level`` dedup:

- the gate Warnings, one per policy source (each an episode: sent once while the finding
  lasts, again when it comes back after it was fixed), logged as a WARNING once per episode by every replica and
  sent by the leader (or, dry-run, logged by the publisher as the Event it would send);
- the plan's notices (reports no record write keeps from repeating): logged and sent once
  per process;
- dry-run: the reports of a plan it does not carry out, each handed to the (dry-run)
  publisher once, which logs it instead of writing;
- the reports that ride a node patch: sent after the patch, and one whose Event could
  not be written is sent again on the node's next pass (its record will not plan it again).

The WARNING lines are deduplicated by the same mechanism: a second publisher whose
"recorder" writes the log line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from shared_svc.k8s.events import Report
from shared_svc.kube.recorder import EventPublisher

log = logging.getLogger("shared_svc.upgrade.controller")  # the controller's log

# Event publisher scopes
GATE_SCOPE = "upgrade/gate"
NOTICES_SCOPE = "upgrade/notices"
DRY_RUN_SCOPE = "upgrade/dry-run-reports"


class _WarningLine:
    """An emitter that logs a report as one WARNING line (it cannot fail)."""

    async def emit(self, report: Report) -> bool:
        extra = {"event": report.reason}
        if report.regarding.kind == "Node":
            extra["node"] = report.regarding.name
        log.warning("%s: %s", report.reason, report.note, extra=extra)
        return True


class Announcer:
    def __init__(self, events: EventPublisher, *, sends: Callable[[], bool]) -> None:
        """``sends``: whether Events go to the publisher now (the leader, or dry-run)."""
        self._events = events
        self._sends = sends
        self._lines = EventPublisher(_WarningLine())  # each WARNING line once, the same way
        self._unsent: dict[str, list[Report]] = {}  # node -> reports written, not yet sent

    async def gate(self, reports: tuple[Report, ...]) -> None:
        """The gate's findings now, one per policy source whose gate does not hold (none:
        fixed, or no flow to gate)."""
        await self._lines.level(GATE_SCOPE, reports)
        if not self._sends():  # a fix is forgotten by every replica; a new finding is not sent
            sent = self._events.sent(GATE_SCOPE)
            reports = tuple(r for r in reports if r.key in sent)
        await self._events.level(GATE_SCOPE, reports)

    async def notices(self, reports: Iterable[Report]) -> None:
        for report in reports:
            await self._lines.once(NOTICES_SCOPE, report)
            if self._sends():
                await self._events.once(NOTICES_SCOPE, report)

    async def dry_run(self, reports: Iterable[Report]) -> None:
        for report in reports:
            await self._events.once(DRY_RUN_SCOPE, report)

    async def written(self, node: str, reports: Iterable[Report]) -> None:
        """Reports whose record write is done, with those of the node not sent before."""
        due = {r.key: r for r in (*self._unsent.pop(node, ()), *reports)}
        unsent = [r for r in due.values() if not await self._events.emit(r)]
        if unsent:
            self._unsent[node] = unsent

    def forget(self, node: str) -> None:
        """The node is gone (or not ours): no Events about it are due any more."""
        self._unsent.pop(node, None)
