"""The shell's two rules over history, as pure functions: ConflictingWriter and Warning dedup.

ConflictingWriter (contract section 5, "detects the fight ... reports it and backs off"):
another writer keeps undoing our intent. A fight is the same intent re-applied to the same
field ``threshold`` times within ``window`` seconds. Only a change of our own intent (or
the object going away, or nothing left to correct) resets the count: a reconcile that
finds the object right between two strikes of the other writer proves nothing.

Warning dedup: an occurrence (a report not tied to a write) that was active in the last
plan is not emitted again; one whose Event could not be written stays out of the active
set, so the next reconcile retries it; one that goes away and comes back is emitted again
(its Event series grows).

Plain data in, plain data out: no clock (``now`` is an argument), no I/O. The whole
ConflictingWriter rule is :func:`conflicting_writer` (the verdict, who the other writers
are from ``managedFields``, the contest and its Warning); the shell only keeps the history
and the contests between reconciles, skips what :func:`left_alone` says, and emits.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from shared_svc.k8s.events import ObjectRef, Report, note, still_sent, unsent
from shared_svc.k8s.managed_fields import FIELD_MANAGER, managed_fields, managers_of_field

FieldKey = tuple[str, str, str]  # (kind, name, dotted field)


@dataclass(frozen=True)
class FightHistory:
    """Per (kind, name, field): when our unchanged intent was re-applied to it, oldest first.

    Times are the shell's monotonic seconds; only times within the window are kept.
    """

    strikes: Mapping[FieldKey, tuple[float, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class FightVerdict:
    """Another writer fights us over ``field`` of ``kind/name``: ``count`` re-applies in the window."""

    kind: str
    name: str
    field: str
    count: int


def fight_verdict(
    history: FightHistory,
    kind: str,
    name: str,
    *,
    apply_body: Any,
    last_applied: Any,
    live_present: bool,
    changed_fields: Sequence[str],
    now: float,
    threshold: int,
    window: float,
) -> tuple[FightHistory, FightVerdict | None]:
    """Count one more correction of ``kind/name`` and say whether it is a fight.

    ``apply_body`` is the intent about to be applied, ``last_applied`` the one we applied
    last (``None``: never), ``changed_fields`` the fields whose live value differs from it.
    A strike older than ``window`` no longer counts. The verdict names the first changed
    field with the most strikes; once given, the strikes of those fields start over.
    """
    obj = (kind, name)
    # Drop what can never count again (older than the window at any later ``now``).
    strikes = {
        k: kept
        for k, times in history.strikes.items()
        if (kept := tuple(t for t in times if now - t <= window))
    }
    if not live_present or last_applied != apply_body or not changed_fields:
        # Our intent changed (or there is nothing to fight over): the count starts over.
        return FightHistory({k: v for k, v in strikes.items() if k[:2] != obj}), None
    counts = []
    for f in changed_fields:
        times = (*strikes.get((kind, name, f), ()), now)
        strikes[(kind, name, f)] = times
        counts.append(len(times))
    worst = max(counts)
    if worst < threshold:
        return FightHistory(strikes), None
    contested = changed_fields[counts.index(worst)]
    for f in changed_fields:
        strikes.pop((kind, name, f), None)
    return FightHistory(strikes), FightVerdict(kind, name, contested, worst)


# Managers that are never "the other writer": ours, and the API server's own first entry.
IGNORED_MANAGERS = (FIELD_MANAGER, "before-first-apply")


@dataclass(frozen=True)
class FieldWriter:
    """Another writer of the object: a field manager and its operations ("Update", ...)."""

    manager: str
    operations: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """``manager / Operation`` as the Warning and ``/status`` name it."""
        return f"{self.manager} / {', '.join(self.operations)}" if self.operations else self.manager


UNKNOWN_WRITER = FieldWriter("unknown")


def other_writers(obj: Mapping[str, Any], owners: Sequence[str]) -> tuple[FieldWriter, ...]:
    """The other writers: the managers that own the contested field now (``owners``), with
    their operations; else (a whole-object PUT removed our field, so nobody owns it) the
    managers of the most recent Update entries other than ours; else ``unknown``."""
    entries = [e for e in managed_fields(dict(obj)) if e.get("manager") not in IGNORED_MANAGERS]
    if owners:
        ops = {
            m: sorted({str(e.get("operation", "?")) for e in entries if e.get("manager") == m})
            for m in owners
        }
        return tuple(FieldWriter(m, tuple(ops[m])) for m in owners)
    updates = [e for e in entries if e.get("operation") == "Update"]
    if not updates:
        return (UNKNOWN_WRITER,)
    latest = max(str(e.get("time") or "") for e in updates)
    out: list[FieldWriter] = []
    for e in updates:
        writer = FieldWriter(str(e.get("manager", "?")), ("Update",))
        if str(e.get("time") or "") == latest and writer not in out:
            out.append(writer)
    return tuple(out)


def name_writers(obj: Mapping[str, Any], owners: Sequence[str]) -> list[str]:
    """The other writers as ``manager / Operation`` (:func:`other_writers`)."""
    return [w.label for w in other_writers(obj, owners)]


@dataclass(frozen=True)
class Contest:
    """An object shared-svc leaves alone after a fight over ``field``, until ``until``
    (the shell's monotonic seconds); ``since`` is when it was found (UTC, for /status)."""

    object: str
    field: str
    managers: tuple[str, ...]
    writers: tuple[str, ...]  # "manager / Operation"
    until: float
    since: str

    def seconds_left(self, now: float) -> int:
        """Whole seconds until the object is no longer left alone (never below 0)."""
        return max(0, round(self.until - now))


def contest_of(
    verdict: FightVerdict,
    owners: Sequence[str],
    writers: Sequence[FieldWriter],
    *,
    now: float,
    backoff: float,
    since: str,
) -> Contest:
    """The contest a verdict opens: the field's owners, or (a whole-object PUT removed the
    field, so nobody owns it) the managers of the latest writers, for ``backoff`` seconds."""
    managers = tuple(owners) or tuple(w.manager for w in writers)
    return Contest(
        object=f"{verdict.kind}/{verdict.name}",
        field=verdict.field,
        managers=managers,
        writers=tuple(w.label for w in writers),
        until=now + backoff,
        since=since,
    )


def left_alone(contest: Contest | None, now: float) -> bool:
    """Whether an action on the object waits out its contest (the backoff after a fight)."""
    return contest is not None and contest.until > now


def fight_report(
    verdict: FightVerdict,
    live: Mapping[str, Any],
    writers: Sequence[str],
    backoff_seconds: float,
) -> Report:
    """The ConflictingWriter Warning about the live object, naming the other writers."""
    meta = live.get("metadata") or {}
    what = f"{verdict.kind}/{verdict.name}"
    return Report(
        type="Warning",
        reason="ConflictingWriter",
        action="Reconcile",
        regarding=ObjectRef(
            api_version=live.get("apiVersion", "v1"),
            kind=verdict.kind,
            name=verdict.name,
            namespace=meta.get("namespace"),
            uid=meta.get("uid"),
        ),
        note=note(
            f"field manager {', '.join(writers)} keeps changing {verdict.field} of {what}; "
            f"shared-svc re-applied it {verdict.count} times and now leaves the object alone for "
            f"{int(backoff_seconds)}s. Install the admission guard "
            "(docs/install.md) so gpu-operator's updates change nothing."
        ),
        key=f"ConflictingWriter/{what}/{verdict.field}",
    )


@dataclass(frozen=True)
class Fight:
    """A fight found: the contest to keep (the backoff) and the Warning to send once."""

    contest: Contest
    report: Report


def conflicting_writer(
    history: FightHistory,
    kind: str,
    name: str,
    *,
    apply_body: Any,
    last_applied: Any,
    live: Mapping[str, Any] | None,
    changed_fields: Sequence[str],
    now: float,
    since: str,
    threshold: int,
    window: float,
    backoff: float,
) -> tuple[FightHistory, Fight | None]:
    """The ConflictingWriter rule whole: count one more correction of ``kind/name``
    (:func:`fight_verdict`); on a verdict, the other writers of the contested field
    (``managedFields`` of ``live``), the contest that leaves the object alone for
    ``backoff`` seconds from ``now``, and the Warning naming them."""
    history, verdict = fight_verdict(
        history,
        kind,
        name,
        apply_body=apply_body,
        last_applied=last_applied,
        live_present=live is not None,
        changed_fields=changed_fields,
        now=now,
        threshold=threshold,
        window=window,
    )
    if verdict is None or live is None:
        return history, None
    owners = managers_of_field(dict(live), verdict.field)
    writers = other_writers(live, owners)
    contest = contest_of(verdict, owners, writers, now=now, backoff=backoff, since=since)
    return history, Fight(contest, fight_report(verdict, live, contest.writers, backoff))


def occurrences(reports: Iterable[Report]) -> tuple[Report, ...]:
    """The reports not tied to a write: true while the plan has them (level-triggered)."""
    return tuple(r for r in reports if r.after_write is None)


def warnings_to_emit(
    active_keys: AbstractSet[str], reports: Iterable[Report]
) -> tuple[Report, ...]:
    """The occurrences (reports not tied to a write) of a plan that are not active already."""
    return unsent(active_keys, occurrences(reports))


def next_active(
    active_keys: AbstractSet[str], reports: Iterable[Report], written: AbstractSet[str]
) -> frozenset[str]:
    """The keys active after this plan: its occurrences already active, or written now.

    An occurrence whose Event could not be written stays out, so it is emitted again next
    time; one the plan no longer has drops out, so it is emitted again when it comes back.
    (The Event publisher, ``kube.recorder.EventPublisher.level``, applies the same rule,
    ``k8s.events.unsent`` / ``still_sent``, to every level-triggered scope.)
    """
    return still_sent(active_keys, occurrences(reports), written)
