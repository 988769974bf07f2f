"""The caches' msgspec decoders keep every bound of the exact reader (``kube.untrusted``):
a hostile list page or watch event is refused, or kept with its too-deep part cut, as
before, and msgspec's own nesting limit is never what decides (issue 22)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from proptests.test_cache_decode_props import NODES, PODS, event_outcome, exact, page_outcome
from shared_svc.controllers.services.caches import POD_DECODER
from shared_svc.kube import untrusted
from shared_svc.kube.resources import METADATA_DECODER
from shared_svc.kube.untrusted import MAX_DEPTH, PRUNED
from tests.realistic import api_pod


def _page(pod: dict[str, Any], hole: bytes = b"") -> bytes:
    """A list page of ``pod`` whose dropped ``spec.containers`` is ``hole`` (raw JSON)."""
    if hole:
        pod["spec"]["containers"] = "HOLE"
    text = json.dumps({"metadata": {"resourceVersion": "5"}, "items": [pod]}).encode()
    return text.replace(b'"HOLE"', hole)


def _nested(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


POD = api_pod("nvidia-dcgm", "p-0", "node-0")


def test_a_realistic_page_is_decoded_by_msgspec_not_by_json_loads() -> None:
    page = POD_DECODER.page(_page(dict(POD)))
    assert page is not None
    assert set(page["items"][0]["spec"]) == {"nodeName"}  # containers skipped, not built


@pytest.mark.parametrize(
    "hole",
    [
        b"1" * 5000,  # json.loads refuses it (Python's int digits limit); msgspec would skip it
        b'"\xff\xfe"',  # not UTF-8: json.loads refuses it; msgspec does not check skipped strings
        b"NaN",  # json.loads reads it, msgspec refuses: read the exact way
        b'"\\ud800"',  # a lone surrogate: idem
    ],
    ids=["long-integer", "not-utf8", "nan", "lone-surrogate"],
)
def test_a_hostile_value_in_a_dropped_field_is_refused_or_kept_as_by_the_exact_reader(
    hole: bytes,
) -> None:
    raw = _page(dict(POD, spec=dict(POD["spec"])), hole)
    assert POD_DECODER.page(raw) is None
    assert page_outcome(raw, PODS) == page_outcome(raw, exact(PODS))


def test_a_number_out_of_msgspecs_range_in_a_dropped_field_is_skipped_as_it_is_dropped() -> None:
    raw = _page(dict(POD, spec=dict(POD["spec"])), b"1e400")
    assert POD_DECODER.page(raw) is not None
    assert page_outcome(raw, PODS) == page_outcome(raw, exact(PODS))


def test_a_long_integer_stops_the_list_with_the_exact_readers_error() -> None:
    raw = _page(dict(POD, spec=dict(POD["spec"])), b"1" * 5000)
    outcome = page_outcome(raw, PODS)
    assert outcome[:2] == ("refused", ValueError) and "4300 digits" in outcome[2]


@pytest.mark.parametrize("levels", [MAX_DEPTH - 5, MAX_DEPTH + 5, 990, 5000])
def test_deep_nesting_in_a_dropped_field_is_skipped_as_the_exact_reader_drops_it(
    levels: int,
) -> None:
    """Cut or skipped, a field nobody reads is not kept: the object is kept whole and not
    reported as cut, by both readers."""
    raw = _page(dict(POD, spec=dict(POD["spec"])), _nested(levels))
    token, listed = page_outcome(raw, PODS)
    assert (token, listed) == page_outcome(raw, exact(PODS))
    assert listed.pruned == set()
    assert listed.items[("gpu-operator", "p-0")]["spec"] == {"nodeName": "node-0"}


@pytest.mark.parametrize("levels", [MAX_DEPTH - 5, MAX_DEPTH + 5, 990, 5000])
def test_deep_nesting_in_a_kept_field_is_cut_and_reported_as_by_the_exact_reader(
    levels: int,
) -> None:
    """A label value nested deep (no API server serves one; a hostile text may): msgspec
    builds it, the bound refuses what it built, the exact reader cuts it and the object is
    reported as cut."""
    pod = dict(POD, metadata=dict(POD["metadata"], labels={"app": "HOLE"}))
    text = json.dumps({"metadata": {"resourceVersion": "5"}, "items": [pod]}).encode()
    raw = text.replace(b'"HOLE"', _nested(levels))
    token, listed = page_outcome(raw, PODS)
    assert (token, listed) == page_outcome(raw, exact(PODS))
    cut = levels + 4 > MAX_DEPTH + 2  # the page, its items, the pod, its metadata, the labels
    assert listed.pruned == ({("gpu-operator", "p-0")} if cut else set())
    assert (PRUNED in str(listed.items[("gpu-operator", "p-0")])) is cut


def test_a_realistic_page_is_not_scanned_for_its_depth(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path bounds what it built, not the text (the bytes-level scan was most of
    a pod's decoding)."""

    scans: list[bytes] = []
    monkeypatch.setattr(untrusted, "json_depth", lambda raw: scans.append(raw) or 0)
    pods = [dict(POD, metadata=dict(POD["metadata"], name=f"p-{i}")) for i in range(3)]
    raw = json.dumps({"metadata": {"resourceVersion": "5"}, "items": pods}).encode()
    _, listed = page_outcome(raw, PODS)
    assert len(listed.items) == 3 and scans == []
    page_outcome(raw, exact(PODS))  # the exact reader scans a page of more brackets than the bound
    assert scans == [raw]


@pytest.mark.parametrize("levels", [990, 5000, 100_000])
def test_msgspec_nesting_past_its_recursion_limit_is_left_to_the_exact_reader(
    levels: int,
) -> None:
    """msgspec's limit is Python's recursion limit, skipped fields included: a RecursionError
    is an answer None, never a traceback (the caller never hands it such a text)."""
    assert POD_DECODER.page(_page(dict(POD, spec=dict(POD["spec"])), _nested(levels))) is None


def test_an_error_event_raises_as_before() -> None:
    raw = b'{"type":"ERROR","object":{"kind":"Status","code":500,"reason":"InternalError"}}'
    assert POD_DECODER.event(raw) is None
    assert event_outcome(raw, PODS) == event_outcome(raw, exact(PODS))
    assert event_outcome(raw, PODS)[:2] == ("raised", 500)


NODE = {
    "kind": "PartialObjectMetadata",
    "apiVersion": "meta.k8s.io/v1",
    "metadata": {
        "name": "node-0",
        "resourceVersion": "9",
        "labels": {"a": "b"},
        "managedFields": [{"manager": "kubelet", "fieldsV1": {"f:status": {}}}],
    },
}


def test_a_metadata_only_node_is_decoded_without_building_its_managed_fields() -> None:
    raw = json.dumps({"type": "MODIFIED", "object": NODE}).encode()
    event = METADATA_DECODER.event(raw)
    assert event is not None
    assert isinstance(event["object"]["metadata"]["managedFields"], msgspec.Raw)
    assert event_outcome(raw, NODES) == event_outcome(raw, exact(NODES))
    assert "managedFields" not in event_outcome(raw, NODES)[3]["metadata"]


def test_a_metadata_key_outside_object_meta_is_read_the_exact_way() -> None:
    node = {**NODE, "metadata": {**NODE["metadata"], "zzz": 1}}
    raw = json.dumps({"type": "MODIFIED", "object": node}).encode()
    assert METADATA_DECODER.event(raw) is None
    assert event_outcome(raw, NODES)[3]["metadata"]["zzz"] == 1
