"""The Kubernetes object helpers (``shared_svc.k8s``) against plain reference semantics:
the one label-selector matcher, its string form, and note truncation in bytes (issue 11)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from shared_svc.k8s.events import NOTE_LIMIT, ObjectRef, Report, note, truncate_bytes
from shared_svc.k8s.selectors import (
    Selector,
    SelectorError,
    label_selector,
    parse_selector,
    selector_from_set,
)
from shared_svc.kube.recorder import event_body
from shared_svc.upgrade.node_plan import Builder
from shared_svc.upgrade.settings import UpgradeSettings

KEYS = ["a", "b", "app", "nvidia.com/gpu", "x.io/a_b-c.d"]
VALUES = ["", "x", "y", "true", "A-1_b.c"]

keys = st.sampled_from(KEYS)
values = st.sampled_from(VALUES)
label_sets = st.dictionaries(keys, values, max_size=len(KEYS))
value_lists = st.lists(values, min_size=1, max_size=3)

expressions = st.one_of(
    st.builds(
        lambda k, op, vs: {"key": k, "operator": op, "values": vs},
        keys,
        st.sampled_from(["In", "NotIn"]),
        value_lists,
    ),
    st.builds(
        lambda k, op: {"key": k, "operator": op}, keys, st.sampled_from(["Exists", "DoesNotExist"])
    ),
)
label_selectors = st.builds(
    lambda ml, me: {
        **({"matchLabels": ml} if ml is not None else {}),
        **({"matchExpressions": me} if me is not None else {}),
    },
    st.none() | label_sets,
    st.none() | st.lists(expressions, max_size=4),
)


def reference(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """metav1.LabelSelector as the Kubernetes documentation states it."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if key not in labels or labels[key] != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, vals = expr["key"], expr["operator"], expr.get("values") or []
        has = key in labels
        if op == "In" and not (has and labels[key] in vals):
            return False
        if op == "NotIn" and has and labels[key] in vals:
            return False
        if op == "Exists" and not has:
            return False
        if op == "DoesNotExist" and has:
            return False
    return True


@given(label_selectors, label_sets)
@example({}, {"a": "x"})  # the empty selector selects everything
def test_the_matcher_agrees_with_the_reference(
    selector: dict[str, Any], labels: dict[str, str]
) -> None:
    parsed = label_selector(selector)
    assert parsed.matches(labels) is reference(selector, labels)
    # The string form (a list's labelSelector=) selects the same.
    assert parse_selector(parsed.text).matches(labels) is reference(selector, labels)


@given(label_selectors)
def test_the_string_form_round_trips(selector: dict[str, Any]) -> None:
    parsed = label_selector(selector)
    again = parse_selector(parsed.text)
    assert again.requirements == parsed.requirements
    assert again.canonical == parsed.canonical
    assert again == parsed


@given(label_sets, label_sets)
def test_a_set_selector_is_its_equality_requirements(
    selected: dict[str, str], labels: dict[str, str]
) -> None:
    selector = selector_from_set(selected)
    assert selector.matches(labels) is all(labels.get(k) == v for k, v in selected.items())
    assert parse_selector(selector.text) == selector


@given(st.text(max_size=40))
@example("a in ()")
@example("a=b\n")
@example("Nvidia.COM/x=y")
def test_any_text_parses_or_gives_a_selector_error(text: str) -> None:
    try:
        parsed = parse_selector(text)
    except SelectorError as exc:
        assert str(exc) and "\n" not in str(exc).strip("\n")
        return
    assert isinstance(parsed, Selector)
    assert parse_selector(parsed.canonical) == parsed


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.sampled_from(KEYS + VALUES + ["In", "Exists"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                ["matchLabels", "matchExpressions", "key", "operator", "values", *KEYS]
            ),
            inner,
            max_size=3,
        )
    ),
    max_leaves=12,
)


@given(json_values)
def test_any_value_is_a_selector_or_a_selector_error(value: Any) -> None:
    try:
        parsed = label_selector(value)
    except SelectorError as exc:
        assert str(exc)  # a message, never another exception
        return
    assert parse_selector(parsed.text) == parsed


@pytest.mark.parametrize(
    "bad",
    [
        None,
        {"matchExpressions": [{"key": "a", "operator": "In", "values": []}]},
        {"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]},
        {"matchExpressions": [{"key": "a", "operator": "Gt", "values": ["1"]}]},
        {"matchLabels": {"a b": "x"}},
        {"matchLabels": {"a": "x y"}},
        {"matchLabels": {"Upper.Prefix/a": "x"}},
    ],
)
def test_invalid_label_selectors_are_errors(bad: Any) -> None:
    with pytest.raises(SelectorError):
        label_selector(bad)


limits = st.integers(min_value=0, max_value=80)


@given(st.text(max_size=60), limits)
@example("é" * 20, 7)
@example("a€b", 5)
def test_truncation_fits_the_byte_limit_and_keeps_whole_characters(text: str, limit: int) -> None:
    out = truncate_bytes(text, limit)
    assert len(out.encode()) <= limit
    if len(text.encode()) <= limit:
        assert out == text
        return
    if limit < 3:
        assert out == ""
        return
    assert out.endswith("...")
    kept = out[:-3]
    assert text.startswith(kept)  # a prefix of whole characters
    # and the longest one: one more character would not fit beside the marker
    assert len(text[: len(kept) + 1].encode()) > limit - 3


@given(st.text(min_size=300, max_size=1200))
@example("€" * 1000)
def test_event_notes_stay_within_the_api_limit(text: str) -> None:
    assert len(note(text).encode()) <= NOTE_LIMIT
    ref = ObjectRef(api_version="v1", kind="Node", name="n")
    report = Report("Warning", "R", "A", ref, text, "k")
    body = event_body(report, "shared-svc-0", dt.datetime(2026, 1, 1, tzinfo=dt.UTC))
    assert len(body["note"].encode()) <= NOTE_LIMIT
    # The upgrade planner's reports, too (it cut at 1,000 characters, not bytes).
    builder = Builder(
        node={"metadata": {"name": "n", "uid": "u"}},
        settings=UpgradeSettings(),
        now=0.0,
        record=None,
        labels={},
        reports=[],
        actions=[],
    )
    builder.report("Warning", "R", "A", text, "k")
    assert len(builder.reports[0].note.encode()) <= NOTE_LIMIT
