"""The record annotation: format, round trip, refusal of anything else; label selectors."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from shared_svc.k8s.selectors import SelectorError, parse_selector
from shared_svc.upgrade.record import (
    FreedPod,
    Record,
    RecordError,
    decode,
    encode,
    record_annotation_key,
)

T0 = 1_700_000_000.0


def test_round_trip_and_documented_shape() -> None:
    rec = Record.new(T0 + 0.7, parked_label=True).with_pod(FreedPod("ml", "b", "u2", T0 + 5.9))
    rec = rec.with_pod(FreedPod("ml", "a", "u1", T0, blocked=True))
    text = encode(rec)
    assert decode(text) == rec and encode(decode(text)) == text
    body = json.loads(text)
    assert (
        body["version"] == 1
        and body["since"] == "2023-11-14T22:13:20Z"
        and body["parkedLabel"] is True
    )
    assert [p["name"] for p in body["pods"]] == ["a", "b"]
    assert body["pods"][0] == {
        "namespace": "ml",
        "name": "a",
        "uid": "u1",
        "firstAttempt": "2023-11-14T22:13:20Z",
        "blocked": True,
        "deleted": False,
    }
    assert body["freedAt"] is None and body["detectedReported"] == []


def test_with_pod_replaces_same_name() -> None:
    rec = (
        Record.new(T0, parked_label=False)
        .with_pod(FreedPod("ml", "a", "u1", T0))
        .with_pod(FreedPod("ml", "a", "u2", T0 + 9))
    )
    assert [(p.uid, p.first_attempt) for p in rec.pods] == [("u2", T0 + 9)]


def test_key_per_driver() -> None:
    assert record_annotation_key("gpu") == "shared-svc.nvidia.com/gpu-driver-upgrade-freed"
    assert record_annotation_key("ofed") == "shared-svc.nvidia.com/ofed-driver-upgrade-freed"


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[]",
        '{"version": 2}',
        '{"version": 1, "since": "yesterday", "parkedLabel": true}',
        '{"version": 1, "since": "2023-11-14T22:13:20Z", "parkedLabel": "yes"}',
        '{"version": 1, "since": "2023-11-14T22:13:20Z", "parkedLabel": true, "pods": [{"name": "a"}]}',
        '{"version": 1, "since": "2023-11-14T22:13:20Z", "parkedLabel": true, "pods": {}}',
    ],
)
def test_decode_refuses_what_encode_does_not_write(text: str) -> None:
    with pytest.raises(RecordError):
        decode(text)


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [
        ("a=b", {"a": "b"}, True),
        ("a==b", {"a": "c"}, False),
        ("a!=b", {}, True),
        ("a!=b", {"a": "b"}, False),
        ("a in (x, y),b", {"a": "y", "b": ""}, True),
        ("a notin (x)", {"a": "x"}, False),
        ("!a", {}, True),
        ("!a", {"a": "1"}, False),
        ("a", {"a": "1"}, True),
        (
            "nvidia.com/gpu-driver-upgrade.consumer=true",
            {"nvidia.com/gpu-driver-upgrade.consumer": "true"},
            True,
        ),
        # Kubernetes: the empty selector selects everything (an empty consumer selector
        # declares nothing: test_upgrade_consumers.py)
        ("", {"a": "b"}, True),
    ],
)
def test_selector_matching(selector: str, labels: dict[str, str], expected: bool) -> None:
    assert parse_selector(selector).matches(labels) is expected


@pytest.mark.parametrize("bad", ["a=b,", "a in (x", "a=b)", "=b", "a=b c", "a b=c"])
def test_selector_errors(bad: str) -> None:
    with pytest.raises(SelectorError):
        parse_selector(bad)


def test_stuck_and_unprepared_are_written_only_when_set() -> None:
    """Records of earlier releases read and write back unchanged (no rewrite on upgrade)."""
    old = Record.new(T0, parked_label=True).with_pod(FreedPod("ml", "a", "u1", first_attempt=T0))
    text = encode(old)
    assert "stuck" not in text and "unpreparedReported" not in text
    assert encode(decode(text)) == text
    new = replace(old, pods=(replace(old.pods[0], stuck=True),), unprepared_reported=("m/ds",))
    decoded = decode(encode(new))
    assert decoded == new and decoded.pods[0].stuck and decoded.unprepared_reported == ("m/ds",)
    with pytest.raises(RecordError):
        decode(text.replace('"version":1', '"unpreparedReported":"m/ds","version":1'))
