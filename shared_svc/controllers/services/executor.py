"""The Services controller's executor: a plan's actions, in order, as writes, each followed
by the Events it carries (``Action.announces``: sent once the write succeeded, never
without it); the ConflictingWriter backoff (``reconcile.fight``).

The first failure stops the plan (the order keeps coverage). A write that meets a
concurrent change of its object raises :class:`ObjectChanged`: the controller plans
again from the cache. A write this replica may no longer send (the Lease lost during
the plan) is refused by the Writer (``kube.writer.NotWriting``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from shared_svc.config import Config
from shared_svc.controllers.services.metrics import ServicesMetrics
from shared_svc.controllers.services.status import contest_status
from shared_svc.kube.recorder import EventPublisher
from shared_svc.kube.writer import Writer, concurrent_change, describe_error
from shared_svc.reconcile.fight import Contest, FightHistory, conflicting_writer, left_alone
from shared_svc.reconcile.model import Action, Plan

log = logging.getLogger("shared_svc.controller")

WRITES = ("create", "update", "delete")


class ObjectChanged(Exception):
    """A write met a concurrent change of its object (``kube.writer.concurrent_change``)."""

    def __init__(self, kind: str, name: str, cause: BaseException) -> None:
        self.object = f"{kind}/{name}"
        self.error = describe_error(cause)
        super().__init__(f"{self.object}: {self.error}")


def _utc() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class Executor:
    def __init__(
        self,
        config: Config,
        *,
        writer: Writer,
        events: EventPublisher,
        metrics: ServicesMetrics,
        rediscover: asyncio.Event,
    ) -> None:
        self._config = config
        self._writer = writer
        self._events = events
        self._metrics = metrics
        self._rediscover = rediscover  # a 404 on the ServiceMonitor path: look now
        # ConflictingWriter: what we applied last, and how often the same drift came back.
        self._applied: dict[tuple[str, str], dict[str, Any]] = {}
        self._corrections = FightHistory()
        self.contested: dict[tuple[str, str], Contest] = {}

    async def execute(self, plan: Plan) -> int:
        """Runs the plan's writes in order; returns how many requests were sent."""
        now = time.monotonic()
        writes = 0
        for action in plan.actions:
            key = (action.kind, action.name)
            if action.action not in WRITES:
                continue
            if left_alone(self.contested.get(key), now):
                continue  # reported as ConflictingWriter: leave it alone for a while
            self.contested.pop(key, None)
            if action.action == "update" and await self._is_fight(action):
                continue
            writes += await self._write(action)
            log.info(
                "wrote",
                extra={
                    "action": action.action,
                    "kind": action.kind,
                    "object": action.name,
                    "reason": action.reason,
                },
            )
            # Announced right after its own write: a later failure must not lose it (the
            # next plan will not repeat a write that already happened). A failed write
            # raised above: its announcements wait for the write of the next plan.
            for report in action.announces:
                await self._events.emit(report)
        return writes

    async def _write(self, action: Action) -> int:
        """The requests of one action: a delete, or a JSON patch and/or an apply."""
        ns, key, sent = self._config.namespace, (action.kind, action.name), 0
        try:
            if action.action == "delete":
                preconditions = dict(action.preconditions or {})
                await self._writer.delete(action.kind, ns, action.name, preconditions)
                self._metrics.writes.labels("delete", action.kind).inc()
                self._applied.pop(key, None)
                return 1
            if action.json_patch:
                await self._writer.json_patch(action.kind, ns, action.name, list(action.json_patch))
                self._metrics.writes.labels("patch", action.kind).inc()
                sent += 1
            if action.apply is not None:
                await self._writer.apply(action.apply)
                self._metrics.writes.labels("apply", action.kind).inc()
                sent += 1
                self._applied[key] = action.apply
        except ApiException as exc:
            if concurrent_change(exc):
                raise ObjectChanged(action.kind, action.name, exc) from exc
            if exc.status in (403, 404) and action.kind == "ServiceMonitor":
                # The ServiceMonitor API may be gone ("404 page not found") or going
                # (403: "not allowed while custom resource definition is terminating").
                # Look now, not at the next discovery pass.
                self._rediscover.set()
            raise
        return sent

    async def _is_fight(self, action: Action) -> bool:
        """True when another writer keeps undoing the same intent: report once, back off
        (the rule whole is ``reconcile.fight.conflicting_writer``)."""
        cfg, key = self._config, (action.kind, action.name)
        self._corrections, fight = conflicting_writer(
            self._corrections,
            action.kind,
            action.name,
            apply_body=action.apply,
            last_applied=self._applied.get(key),
            live=action.live,
            changed_fields=action.changed_fields,
            now=time.monotonic(),
            since=_utc(),
            threshold=cfg.conflicting_writer_threshold,
            window=cfg.conflicting_writer_window_seconds,
            backoff=cfg.conflicting_writer_backoff_seconds,
        )
        if fight is None:
            return False
        self.contested[key] = fight.contest
        self._metrics.conflicting_writer.inc()
        await self._events.emit(fight.report)
        return True

    def contested_status(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [contest_status(c, now) for c in self.contested.values()]
