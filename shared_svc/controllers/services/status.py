"""The Services controller's part of ``/status``: the last plan and the contested
objects, spelt by the one JSON serializer (``k8s.objects.as_json``)."""

from __future__ import annotations

from typing import Any

from shared_svc.k8s.objects import as_json
from shared_svc.reconcile.fight import Contest
from shared_svc.reconcile.model import Plan


def plan_status(plan: Plan | None) -> dict[str, Any]:
    """What ``/status`` shows of the last plan: each managed object (with the last action
    planned for it), the conflicts, pending items, spec errors and notes."""
    if plan is None:
        return {"objects": [], "conflicts": [], "pending": [], "errors": [], "notes": []}
    actions = {(a.kind, a.name): a for a in plan.actions}
    objects = []
    for s in plan.status:
        entry = as_json(s)
        act = actions.get((s.kind, s.name))
        if act:
            entry["lastAction"] = {"action": act.action, "reason": act.reason}
        objects.append(entry)
    return {
        "objects": objects,
        "conflicts": as_json(plan.conflicts),
        "pending": as_json(plan.pending),
        "errors": as_json(plan.errors),
        "notes": list(plan.notes),
    }


def contest_status(contest: Contest, now: float) -> dict[str, Any]:
    """A contested object for ``/status``: the contest's fields but its monotonic
    deadline, which is ``secondsLeft`` from ``now``."""
    out = as_json(contest)
    del out["until"]
    out["secondsLeft"] = contest.seconds_left(now)
    return dict(out)
