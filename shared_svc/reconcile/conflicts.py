"""Deterministic winners when CRs that need the same object disagree (contract section 6).

The winner is the first CR in precedence order (oldest creationTimestamp, then apiVersion,
kind, name, uid) that sets the field; an unset value never conflicts. Because the order is
total over the CRs' identities, the result does not depend on the order of the inputs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shared_svc.k8s.events import ObjectRef, Report, note
from shared_svc.reconcile.digest import stable_digest
from shared_svc.reconcile.model import Conflict, ConflictValue
from shared_svc.reconcile.specs import CRSpec


@dataclass(frozen=True)
class Resolution:
    value: Any  # None: nobody sets the field
    conflict: Conflict | None
    loser_crs: tuple[CRSpec, ...] = ()


def resolve(obj: str, field: str, contributions: Sequence[tuple[CRSpec, Any]]) -> Resolution:
    """Pick the value of one field from ``(cr, value)`` pairs; ``None`` means unset."""
    ordered = sorted((c for c in contributions if c[1] is not None), key=lambda c: c[0].precedence)
    if not ordered:
        return Resolution(None, None)
    winner, value = ordered[0]
    losers = [(cr, v) for cr, v in ordered[1:] if v != value]
    if not losers:
        return Resolution(value, None)
    conflict = Conflict(
        object=obj,
        field=field,
        winner=ConflictValue(winner.kind, winner.name, value),
        losers=tuple(ConflictValue(cr.kind, cr.name, v) for cr, v in losers),
    )
    return Resolution(value, conflict, tuple(cr for cr, _ in losers))


def cr_event_ref(cr: CRSpec) -> ObjectRef:
    return ObjectRef(api_version=cr.api_version, kind=cr.kind, name=cr.name, uid=cr.uid or None)


def conflict_reports(resolution: Resolution) -> list[Report]:
    """One Warning per (object, field, loser), regarding the losing CR."""
    conflict = resolution.conflict
    if conflict is None:
        return []
    reason = (
        "ServiceConfigConflict"
        if conflict.object.startswith("Service/")
        else "ServiceMonitorConfigConflict"
    )
    winner = conflict.winner
    reports = []
    for cr, lost in zip(resolution.loser_crs, conflict.losers, strict=True):
        text = (
            f"{conflict.field} of {conflict.object}: {cr.label} sets {_show(lost.value)}, "
            f"{winner.kind}/{winner.name} sets {_show(winner.value)}; "
            f"{winner.kind}/{winner.name} wins (created first)"
        )
        identity = [
            conflict.object,
            conflict.field,
            cr.kind,
            cr.name,
            cr.uid,
            lost.value,
            winner.kind,
            winner.name,
            winner.value,
        ]
        reports.append(
            Report(
                type="Warning",
                reason=reason,
                action="Reconcile",
                regarding=cr_event_ref(cr),
                note=note(text),
                key=f"{reason}/{conflict.object}/{conflict.field}/{cr.label}/{stable_digest(identity)}",
            )
        )
    return reports


def _show(value: Any) -> str:
    return json.dumps(value, sort_keys=True)
