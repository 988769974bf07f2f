"""kube.store.interned_maps: what a cache without a projection keeps (issue 33)."""

from __future__ import annotations

import copy
import json
from typing import Any

from shared_svc.kube.store import interned_maps


def _parsed(name: str) -> dict[str, Any]:
    # Parsed apart, as two list items are: equal strings, distinct objects.
    text = json.dumps(
        {
            "metadata": {
                "name": name,
                "labels": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB", "n": 1},
                "annotations": {"nfd.node.kubernetes.io/master.version": "v0.15.4"},
            },
            "spec": {"x": ["y"]},
        }
    )
    parsed: dict[str, Any] = json.loads(text)
    return parsed


def test_two_nodes_hold_one_copy_of_each_label_string_and_stay_equal_and_unchanged() -> None:
    a, b = _parsed("node-a"), _parsed("node-b")
    before = copy.deepcopy(a)
    ka, kb = interned_maps(a), interned_maps(b)
    assert a == before and ka == before  # equal, and the input is not changed
    (key_a, value_a), (key_b, value_b) = (
        next(iter(k["metadata"]["labels"].items())) for k in (ka, kb)
    )
    assert key_a is key_b and value_a is value_b
    note_a, note_b = (
        k["metadata"]["annotations"]["nfd.node.kubernetes.io/master.version"] for k in (ka, kb)
    )
    assert note_a is note_b
    assert ka["metadata"]["labels"]["n"] == 1  # a value of another type kept as it is


def test_an_object_without_metadata_maps_is_kept_as_it_is() -> None:
    odd = {"metadata": {"name": "x", "labels": ["not", "a", "map"]}}
    assert interned_maps(odd) == odd
    assert interned_maps({"metadata": "text"}) == {"metadata": "text"}
