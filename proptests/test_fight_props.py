"""ConflictingWriter's fight verdict and the Warning dedup, over recorded history (issue 11):
the count, the window, the reset on a change of our own intent, the field named, and
Events that are neither repeated nor lost."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from shared_svc.k8s.events import ObjectRef, Report
from shared_svc.k8s.managed_fields import managers_of_field
from shared_svc.reconcile.fight import (
    IGNORED_MANAGERS,
    FieldWriter,
    FightHistory,
    FightVerdict,
    conflicting_writer,
    contest_of,
    fight_report,
    fight_verdict,
    left_alone,
    next_active,
    other_writers,
    warnings_to_emit,
)

KIND, NAME = "Service", "nvidia-dcgm"
FIELDS = ("spec.selector", "spec.type", 'metadata.annotations["prometheus.io/scrape"]')
INTENT = {"kind": "Service", "spec": {"selector": {"app": "nvidia-dcgm"}}}
OTHER_INTENT = {"kind": "Service", "spec": {"selector": {"app": "legacy"}}}

thresholds = st.integers(min_value=1, max_value=6)
windows = st.integers(min_value=1, max_value=1_000).map(float)
field_sets = st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3, unique=True).map(tuple)


def strike(
    history: FightHistory,
    now: float,
    *,
    threshold: int,
    window: float,
    fields: Sequence[str] = FIELDS[:1],
    intent: Any = INTENT,
    applied: Any = INTENT,
    live: bool = True,
    kind: str = KIND,
    name: str = NAME,
) -> tuple[FightHistory, FightVerdict | None]:
    """One reconcile that finds ``fields`` of the object drifted and re-applies ``intent``."""
    return fight_verdict(
        history,
        kind,
        name,
        apply_body=intent,
        last_applied=applied,
        live_present=live,
        changed_fields=tuple(fields),
        now=now,
        threshold=threshold,
        window=window,
    )


def times_from(gaps: Sequence[int], start: float = 1_000.0) -> list[float]:
    out, t = [], start
    for g in gaps:
        t += g
        out.append(t)
    return out


@given(thresholds, windows, st.data())
def test_fewer_than_threshold_repeats_never_give_a_verdict(
    threshold: int, window: float, data: st.DataObject
) -> None:
    n = data.draw(st.integers(min_value=0, max_value=threshold - 1))
    gaps = data.draw(st.lists(st.integers(0, 2_000), min_size=n, max_size=n))
    fields = data.draw(field_sets)
    history = FightHistory()
    for now in times_from(gaps):
        history, verdict = strike(history, now, threshold=threshold, window=window, fields=fields)
        assert verdict is None


@given(thresholds, windows, field_sets, st.data())
def test_threshold_repeats_of_the_same_intent_within_the_window_give_one_verdict(
    threshold: int, window: float, fields: tuple[str, ...], data: st.DataObject
) -> None:
    # threshold strikes, the last within ``window`` of the first (at most exactly that)
    gap = st.integers(0, int(window) // threshold)
    times = times_from(data.draw(st.lists(gap, min_size=threshold, max_size=threshold)))
    history = FightHistory()
    verdicts = []
    for now in times:
        history, verdict = strike(history, now, threshold=threshold, window=window, fields=fields)
        verdicts.append(verdict)
    assert verdicts[:-1] == [None] * (threshold - 1)
    assert verdicts[-1] == FightVerdict(KIND, NAME, fields[0], threshold)
    # Once given, the count starts over: the next strike alone is no fight (unless 1 is).
    _, again = strike(history, times[-1], threshold=threshold, window=window, fields=fields)
    assert (again is not None) == (threshold == 1)


@given(
    st.integers(min_value=2, max_value=6),
    windows,
    st.integers(min_value=1, max_value=5),
    st.sampled_from(["intent", "gone", "in-sync"]),
)
def test_a_change_of_our_own_intent_resets_the_count(
    threshold: int, window: float, before: int, why: str
) -> None:
    before = min(before, threshold - 1)
    history, now = FightHistory(), 0.0
    for _ in range(before):
        history, verdict = strike(history, now, threshold=threshold, window=window)
        assert verdict is None
    # The reset: our intent changed, the object is gone, or nothing is left to correct.
    if why == "intent":
        history, verdict = strike(
            history, now, threshold=threshold, window=window, intent=OTHER_INTENT
        )
    else:
        history, verdict = strike(
            history,
            now,
            threshold=threshold,
            window=window,
            live=why != "gone",
            fields=() if why == "in-sync" else FIELDS[:1],
        )
    assert verdict is None
    assert not [k for k in history.strikes if k[:2] == (KIND, NAME)]
    # Without the reset these would add up to ``before + threshold - 1 >= threshold``.
    for _ in range(threshold - 1):
        history, verdict = strike(history, now, threshold=threshold, window=window)
        assert verdict is None


@given(
    st.integers(min_value=2, max_value=6),
    windows,
    st.lists(st.integers(min_value=1, max_value=500), min_size=1, max_size=12),
    field_sets,
)
def test_repeats_spaced_further_than_the_window_never_accumulate(
    threshold: int, window: float, extra: list[int], fields: tuple[str, ...]
) -> None:
    history, now = FightHistory(), 0.0
    for e in extra:
        now += window + e
        history, verdict = strike(history, now, threshold=threshold, window=window, fields=fields)
        assert verdict is None
        assert all(len(times) == 1 for times in history.strikes.values())


strikes_of = st.lists(st.integers(min_value=0, max_value=1_000).map(float), max_size=6).map(
    lambda ts: tuple(sorted(ts))
)


@given(
    st.dictionaries(st.sampled_from(FIELDS), strikes_of),
    thresholds,
    windows,
    field_sets,
    st.integers(min_value=1_000, max_value=1_500).map(float),
)
def test_the_verdict_names_a_changed_field_with_the_highest_count(
    recorded: dict[str, tuple[float, ...]],
    threshold: int,
    window: float,
    fields: tuple[str, ...],
    now: float,
) -> None:
    history = FightHistory({(KIND, NAME, f): ts for f, ts in recorded.items()})
    counts = {f: sum(1 for t in recorded.get(f, ()) if now - t <= window) + 1 for f in fields}
    new, verdict = strike(history, now, threshold=threshold, window=window, fields=fields)
    worst = max(counts.values())
    if worst < threshold:
        assert verdict is None
        assert {f: len(new.strikes[(KIND, NAME, f)]) for f in fields} == counts
    else:
        assert verdict is not None
        assert verdict.field in fields and verdict.count == counts[verdict.field] == worst
        assert verdict.field == next(f for f in fields if counts[f] == worst)
        assert not [f for f in fields if (KIND, NAME, f) in new.strikes]
    # The history keeps nothing the window has left behind.
    assert all(now - t <= window for ts in new.strikes.values() for t in ts)


@given(
    st.integers(min_value=2, max_value=6),
    windows,
    st.sampled_from([(KIND, "other"), ("ServiceMonitor", NAME)]),
    st.booleans(),
)
def test_another_objects_strikes_are_its_own(
    threshold: int, window: float, other: tuple[str, str], reset: bool
) -> None:
    """Per object: ``Service/nvidia-dcgm-exporter`` and the ServiceMonitor of that name too."""
    ours = FightHistory()
    for _ in range(threshold - 1):
        ours, _ = strike(ours, 0.0, threshold=threshold, window=window)
    kind, name = other
    after, verdict = strike(
        ours,
        0.0,
        threshold=threshold,
        window=window,
        kind=kind,
        name=name,
        intent=OTHER_INTENT if reset else INTENT,
    )
    assert verdict is None
    assert {k: v for k, v in after.strikes.items() if k[:2] == (KIND, NAME)} == dict(ours.strikes)


@given(
    st.sampled_from(FIELDS),
    st.integers(min_value=1, max_value=9),
    st.lists(st.sampled_from(["gpu-operator / Update", "kubectl / Apply"]), min_size=1),
)
def test_the_report_names_the_field_the_count_and_the_writers(
    field: str, count: int, writers: list[str]
) -> None:
    live = {"apiVersion": "v1", "metadata": {"namespace": "gpu", "uid": "u1"}}
    report = fight_report(FightVerdict(KIND, NAME, field, count), live, writers, 300.0)
    assert report.reason == "ConflictingWriter" and report.type == "Warning"
    assert report.key == f"ConflictingWriter/{KIND}/{NAME}/{field}"
    assert f"{field} of {KIND}/{NAME}" in report.note and f"{count} times" in report.note
    assert all(w in report.note for w in writers)
    assert (report.regarding.namespace, report.regarding.uid) == ("gpu", "u1")


# --- Warning dedup ---

KEYS = ("a", "b", "c", "d")


def occurrence(key: str, after_write: bool = False) -> Report:
    return Report(
        type="Warning",
        reason="R",
        action="Reconcile",
        regarding=ObjectRef(api_version="v1", kind="Service", name="nvidia-dcgm"),
        note=key,
        key=key,
        after_write=(KIND, NAME) if after_write else None,
    )


# Each reconcile: the plan's reports (key, is an after-write announcement) and the keys
# whose Event write fails this time.
reconciles = st.lists(
    st.tuples(
        st.lists(st.tuples(st.sampled_from(KEYS), st.booleans())),
        st.sets(st.sampled_from(KEYS)),
    ),
    max_size=10,
)


def run(steps: list[tuple[list[tuple[str, bool]], set[str]]]) -> list[dict[str, Any]]:
    """The shell's loop over the two functions; what happened at each reconcile."""
    active: frozenset[str] = frozenset()
    out = []
    for reports_spec, failing in steps:
        reports = [occurrence(k, aw) for k, aw in reports_spec]
        emitted = warnings_to_emit(active, reports)
        written = {r.key for r in emitted} - failing
        new = next_active(active, reports, written)
        out.append(
            {
                "occurrences": {k for k, aw in reports_spec if not aw},
                "active_before": active,
                "emitted": [r.key for r in emitted],
                "announcements": {k for k, aw in reports_spec if aw},
                "written": written,
                "active_after": new,
            }
        )
        active = new
    return out


@given(reconciles)
def test_dedup_never_emits_an_active_key_again(
    steps: list[tuple[list[tuple[str, bool]], set[str]]],
) -> None:
    for step in run(steps):
        assert not set(step["emitted"]) & step["active_before"]


@given(reconciles)
def test_dedup_retries_a_key_whose_event_was_not_written(
    steps: list[tuple[list[tuple[str, bool]], set[str]]],
) -> None:
    history = run(steps)
    for before, after in pairwise(history):
        for key in set(before["emitted"]) - before["written"]:
            if key in after["occurrences"]:
                assert key in after["emitted"]


@given(reconciles)
def test_dedup_emits_each_occurrence_once_while_it_lasts(
    steps: list[tuple[list[tuple[str, bool]], set[str]]],
) -> None:
    history = run(steps)
    for before, after in pairwise(history):
        # Written and still there: not again. Gone from the plan: forgotten, so a return
        # is emitted again (the Event series grows).
        for key in before["written"] & after["occurrences"]:
            assert key not in after["emitted"]
        for key in before["active_after"] - after["occurrences"]:
            assert key not in after["active_after"]
    for step in history:
        # Nothing dropped: every occurrence is active already or emitted now; an
        # announcement (after_write) is the write's business, never the dedup's.
        assert step["occurrences"] <= step["active_before"] | set(step["emitted"])
        assert step["active_after"] <= step["occurrences"]
        assert not (set(step["emitted"]) - step["occurrences"])


# --- the backoff after a fight (the contest) ---

managers = st.sampled_from(["gpu-operator", "helm", "kubectl"])


@given(
    st.lists(managers, max_size=2),
    st.lists(st.tuples(managers, st.sampled_from(["Update", "Apply"])), max_size=3),
    st.floats(0, 1e6),
    st.floats(0, 1e4),
    st.floats(0, 2e4),
)
def test_a_contest_names_the_owners_or_else_the_writers_and_leaves_the_object_alone_for_the_backoff(
    owners: list[str],
    writers: list[tuple[str, str]],
    now: float,
    backoff: float,
    later: float,
) -> None:
    verdict = FightVerdict(KIND, NAME, "spec.selector", 3)
    named = [FieldWriter(m, (op,)) for m, op in writers]
    contest = contest_of(verdict, owners, named, now=now, backoff=backoff, since="t")
    assert contest.managers == (tuple(owners) or tuple(m for m, _ in writers))
    assert contest.object == f"{KIND}/{NAME}" and contest.field == "spec.selector"
    assert left_alone(contest, now + later) == (now + backoff > now + later)
    assert not left_alone(None, now)
    assert contest.seconds_left(now + later) >= 0


# --- the other writers (managedFields) and the rule whole ---

SELECTOR_FIELDS = {"f:spec": {"f:selector": {}}}
entries = st.fixed_dictionaries(
    {
        "manager": st.sampled_from(["gpu-operator", "helm", "kubectl", *IGNORED_MANAGERS]),
        "operation": st.sampled_from(["Update", "Apply"]),
        "time": st.sampled_from(["2026-11-30T10:00:00Z", "2026-11-30T10:00:09Z"]),
        "fieldsV1": st.sampled_from([SELECTOR_FIELDS, {"f:metadata": {"f:labels": {}}}]),
    }
)


def live_with(fields: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": KIND,
        "metadata": {"name": NAME, "namespace": "gpu", "uid": "u1", "managedFields": fields},
    }


@given(st.lists(entries, max_size=6), st.lists(managers, max_size=2, unique=True))
def test_the_other_writers_are_the_owners_with_their_operations_or_the_latest_updaters(
    fields: list[dict[str, Any]], owners: list[str]
) -> None:
    writers = other_writers(live_with(fields), owners)
    assert writers, "someone is always named, if only 'unknown'"
    assert not {w.manager for w in writers} & set(IGNORED_MANAGERS)
    theirs = [e for e in fields if e["manager"] not in IGNORED_MANAGERS]
    if owners:
        assert [w.manager for w in writers] == owners
        for w in writers:
            assert set(w.operations) == {
                e["operation"] for e in theirs if e["manager"] == w.manager
            }
        return
    updates = [e for e in theirs if e["operation"] == "Update"]
    if not updates:
        assert [w.label for w in writers] == ["unknown"]
        return
    latest = max(e["time"] for e in updates)
    assert {w.manager for w in writers} == {e["manager"] for e in updates if e["time"] == latest}
    assert all(w.label == f"{w.manager} / Update" for w in writers)


def correct(
    history: FightHistory,
    live: dict[str, Any] | None,
    now: float,
    *,
    last_applied: Any = INTENT,
    threshold: int,
    window: float,
    backoff: float,
) -> tuple[FightHistory, Any]:
    """One more re-apply of ``INTENT`` to ``spec.selector`` (the rule whole)."""
    return conflicting_writer(
        history,
        KIND,
        NAME,
        apply_body=INTENT,
        last_applied=last_applied,
        live=live,
        changed_fields=("spec.selector",),
        now=now,
        since="t",
        threshold=threshold,
        window=window,
        backoff=backoff,
    )


@given(
    thresholds,
    st.lists(entries, max_size=6),
    st.floats(0, 1e6),
    st.floats(1, 1e4),
)
def test_the_rule_whole_backs_off_from_the_fields_writers_and_warns_naming_them(
    threshold: int, fields: list[dict[str, Any]], start: float, backoff: float
) -> None:
    live = live_with(fields)
    history, fights = FightHistory(), []
    for i in range(threshold):
        history, fight = correct(
            history, live, start + i, threshold=threshold, window=threshold + 1.0, backoff=backoff
        )
        fights.append(fight)
    assert fights[:-1] == [None] * (threshold - 1), "a fight only at the threshold"
    fight = fights[-1]
    assert fight is not None
    owners = managers_of_field(live, "spec.selector")  # k8s.managed_fields' own properties
    writers = other_writers(live, owners)
    assert fight.contest.managers == (tuple(owners) or tuple(w.manager for w in writers))
    assert fight.contest.writers == tuple(w.label for w in writers)
    assert all(label in fight.report.note for label in fight.contest.writers)
    assert fight.report.reason == "ConflictingWriter"
    assert left_alone(fight.contest, start + threshold - 1 + backoff / 2)
    assert not left_alone(fight.contest, start + threshold - 1 + backoff)
    # Gone, or our intent changed: never a fight.
    for live_now, applied in ((None, INTENT), (live, OTHER_INTENT)):
        _, none = correct(
            history,
            live_now,
            start + threshold,
            last_applied=applied,
            threshold=1,
            window=1.0,
            backoff=backoff,
        )
        assert none is None
