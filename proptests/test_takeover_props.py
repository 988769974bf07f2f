"""The managedFields transfer of adoption moves exactly our paths into our Apply entry:
nothing lost, nothing invented, the rest left with its manager (issue 10, item 1)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from shared_svc.reconcile.takeover import FIELD_MANAGER, FieldPath, take_over


def entry(manager: str, operation: str, fields: dict[str, Any]) -> dict[str, Any]:
    return {
        "manager": manager,
        "operation": operation,
        "apiVersion": "v1",
        "time": "2026-11-30T10:00:00Z",
        "fieldsType": "FieldsV1",
        "fieldsV1": fields,
    }


def _fix(tree: dict[str, Any]) -> dict[str, Any]:
    return {k: ({} if k == "." else _fix(v)) for k, v in tree.items()}


def _level(keys: list[str], children: Any, size: int) -> Any:
    return st.dictionaries(st.sampled_from(keys), children, max_size=size)


# fieldsV1 trees shaped like an object's: top-level fields, their fields, their fields.
trees = _level(
    ["f:metadata", "f:spec", "f:x"],
    _level(
        ["f:labels", "f:type", "f:ports", "f:selector", "f:app", "."],
        _level(["f:app", "f:x", "."], st.just({}), 3),
        4,
    ),
    3,
).map(_fix)
entries = st.lists(
    st.tuples(st.sampled_from(["gpu-operator", FIELD_MANAGER, "kubectl"]), st.booleans(), trees),
    max_size=4,
)
# Paths like the ones we take over, over the same keys as the trees, so they meet often.
path_sets = st.lists(
    st.sampled_from(
        [
            ("f:spec",),
            ("f:spec", "f:type"),
            ("f:spec", "f:ports"),
            ("f:spec", "f:selector"),
            ("f:metadata", "f:labels"),
            ("f:metadata", "f:labels", "f:app"),
            ("f:x", "f:type", "f:app"),
        ]
    ),
    max_size=4,
)


def leaves(tree: Any, prefix: FieldPath = ()) -> Iterator[FieldPath]:
    for key, child in tree.items():
        if key == ".":
            yield prefix
        elif child == {}:
            yield (*prefix, key)
        else:
            yield from leaves(child, (*prefix, key))


def _under(path: FieldPath, paths: list[FieldPath]) -> bool:
    return any(path[: len(p)] == p for p in paths)


def _splittable(tree: dict[str, Any], path: FieldPath) -> bool:
    """The function leaves a path alone when an ancestor is owned as a whole (a leaf)."""
    node: Any = tree
    for key in path[:-1]:
        node = node.get(key)
        if not isinstance(node, dict) or not node:
            return False
    return True


@given(entries, path_sets)
# One manager owns spec whole, another spec.type: the whole stays whole when both move.
@example(
    [("a", False, {"f:spec": {}}), ("b", True, {"f:spec": {"f:type": {}}})],
    [("f:spec", "f:type"), ("f:spec",)],
)
# A parent emptied by the move is pruned, not left as an empty set (= owns the parent).
@example([("a", False, {"f:spec": {"f:type": {}}, "f:x": {}})], [("f:spec", "f:type")])
def test_transfer_moves_exactly_our_paths(raw: list[Any], paths: list[FieldPath]) -> None:
    # The API server stores one entry per manager and operation, and none empty.
    unique = {(m, "Apply" if apply else "Update"): fields for m, apply, fields in raw if fields}
    managed = [entry(m, op, fields) for (m, op), fields in unique.items()]
    live = {"apiVersion": "v1", "metadata": {"managedFields": copy.deepcopy(managed)}}
    new = take_over(live, paths)
    assert live["metadata"]["managedFields"] == managed, "the live object is not modified"
    ours_before = next(
        (e for e in managed if e["manager"] == FIELD_MANAGER and e["operation"] == "Apply"), None
    )
    others = [e for e in managed if e is not ours_before]

    def moving(e: dict[str, Any]) -> set[FieldPath]:
        return {
            leaf
            for leaf in leaves(e["fieldsV1"])
            if any(_under(leaf, [p]) and _splittable(e["fieldsV1"], p) for p in paths)
        }

    moved = set().union(*(moving(e) for e in others))
    if new is None:
        assert not moved
        return
    new_ours = [e for e in new if e["manager"] == FIELD_MANAGER and e["operation"] == "Apply"]
    assert len(new_ours) == 1
    before = set(leaves(ours_before["fieldsV1"])) if ours_before else set()
    assert set(leaves(new_ours[0]["fieldsV1"])) == before | moved
    kept = [e for e in new if e is not new_ours[0]]
    expected = [e for e in others if set(leaves(e["fieldsV1"])) - moving(e)]
    assert [e["manager"] for e in kept] == [e["manager"] for e in expected]
    for old, now in zip(expected, kept, strict=True):
        # Equal sets also mean no emptied parent was left behind (it would read as a leaf).
        assert set(leaves(now["fieldsV1"])) == set(leaves(old["fieldsV1"])) - moving(old)
