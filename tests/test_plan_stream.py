"""YAML read as a stream by ``plan`` (``load_documents(text, keep=...)``): a ``kind: List``'s
items one at a time, each kept as ``keep`` returns it; the same values and the same bounds
as the document built whole."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from shared_svc import manifests
from shared_svc.manifests import MAX_ALIAS_NODES, MAX_DEPTH, InputError, load_documents
from shared_svc.reconcile.selectors import pod_fields
from tests.realistic import pod_list


def same(x: Any) -> Any:
    return x


def outcome(text: str, keep: Callable[[Any], Any] | None) -> tuple[str, Any]:
    try:
        return "ok", load_documents(text, keep=keep)
    except InputError as exc:
        return "refused", str(exc)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


CASES = {
    "a list": "kind: List\napiVersion: v1\nitems:\n- {kind: Pod, a: 1}\n- kind: Pod\n  b: [1, 2]\n",
    "items first, more keys after": "items: [{a: 1}, {b: 2}]\nkind: List\nmetadata: {x: 1}\n",
    "empty items": "kind: List\nitems: []\n",
    "items null": "kind: List\nitems:\n",
    "items a mapping": "kind: List\nitems: {a: 1}\n",
    "items twice, the last wins": "items: [{a: 1}]\nkind: List\nitems: [{b: 2}]\n",
    "items twice, a list last": "items: {a: 1}\nitems: [{b: 2}]\n",
    "items twice, a mapping last": "items: [{b: 2}]\nitems: {a: 1}\n",
    "quoted items key": "'items': [{a: 1}]\n",
    "tagged items": "items: !!seq [{a: 1}]\n",
    "anchored items": "items: &i [{a: 1}]\nagain: *i\n",
    "an alias across items": "items:\n- &p {a: 1, b: [1, 2]}\n- *p\n- {c: *p}\n",
    "an anchor before items": "base: &b {a: 1}\nitems:\n- *b\n- {<<: *b, c: 2}\n",
    "merge keys in an item": "items:\n- {<<: [{a: 1}, {b: 2}], b: 3}\n",
    "a merge key at the top": "<<: {items: [{z: 1}], kind: X}\nitems: [{a: 1}]\n",
    "a merge key at the top, no items": "<<: {items: [{z: 1}], kind: X}\n",
    "many documents": "kind: Pod\na: 1\n---\nitems: [{a: 1}]\n---\n---\n[1, 2]\n--- 3\n",
    "an empty document": "",
    "a scalar document": "just text\n",
    "a tagged document": "!!map {items: [{a: 1}]}\n",
    "an anchored document": "&d {items: [{a: 1}]}\n",
    "odd scalars in items": "items:\n- [0x1f, 0o17, 1_000, .5, ~, yes, 2024-01-01, '2024-01-01']\n",
    "the depth bound in an item": f"items:\n- {nested(MAX_DEPTH - 2)}\n",
    "past the depth bound in an item": f"items:\n- {nested(MAX_DEPTH - 1)}\n",
    "past the depth bound, flow": f"{{items: [{nested(MAX_DEPTH - 1)}]}}\n",
    "a recursive alias in an item": "items:\n- &a [*a]\n",
    "a billion laughs across items": "items:\n- &a [x, x, x, x, x, x, x, x, x, x]\n"
    + "".join(f"- &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(6)),
    "a long integer in an item": "items:\n- {n: " + "9" * 5000 + "}\n",
    "a 65-bit integer in an item": "items:\n- {n: 36893488147419103232}\n",
    "binary in an item": "items:\n- {b: !!binary aGk=}\n",
    "a set in an item": "items:\n- !!set {a, b}\n",
    "a custom tag in an item": "items:\n- !custom 1\n",
    "a list key in an item": "items:\n- {? [a]\n   : 1}\n",
    "an int key in an item": "items:\n- {1: a}\n",
    "a bad item and a bad key before": "a: !!binary aGk=\nitems:\n- {1: a}\n",
    "a bad item, then invalid YAML": "items:\n- {1: a}\n- [b\n",
    "invalid YAML in an item": "items:\n- {a: [b}\n",
    "a bad later document": "items: [{a: 1}]\n---\n{1: a}\n",
    "infinity in an item": "items:\n- [.inf]\n",
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_streamed_reads_as_the_whole_document(name: str) -> None:
    text = CASES[name]
    whole = outcome(text, None)
    assert outcome(text, same) == whole
    with pytest.MonkeyPatch.context() as patch:  # PyYAML alone (its own syntax messages)
        patch.setattr(manifests, "_FastLoader", None)
        patch.setattr(manifests, "_NoAliasLoader", None)
        assert outcome(text, same) == outcome(text, None)


def test_the_bounds_hold_when_streamed() -> None:
    refusals = {
        "past the depth bound in an item": f"nested deeper than {MAX_DEPTH} levels",
        "a recursive alias in an item": "recursive YAML alias *a",
        "a billion laughs across items": f"expand to more than {MAX_ALIAS_NODES} nodes",
        "a long integer in an item": "an integer of 5000 digits",
        "a 65-bit integer in an item": "document 1: items[0].n: an integer out of range",
        "binary in an item": "!!binary is not a JSON value",
    }
    for name, fragment in refusals.items():
        kind, message = outcome(CASES[name], same)
        assert kind == "refused" and fragment in message, (name, message)


def test_keep_applies_to_each_item_and_to_documents_that_are_no_list() -> None:
    text = (
        "kind: PodList\nitems:\n- {kind: Pod, n: 1}\n- {kind: Pod, n: 2}\n"
        "---\n{kind: Pod, n: 3}\n---\n"
    )
    kept = load_documents(text, keep=lambda obj: {"kept": obj["n"]} if "n" in obj else obj)
    assert kept == [{"kind": "PodList", "items": [{"kept": 1}, {"kept": 2}]}, {"kept": 3}, None]


def _alive_items(text: str) -> int:
    """The most items built whole that were alive at once while ``text`` was read."""
    alive = most = 0

    class Item(dict):  # type: ignore[type-arg]
        def __del__(self) -> None:
            nonlocal alive
            alive -= 1

    def keep(item: Any) -> Any:
        nonlocal alive, most
        whole = Item(item)
        alive += 1
        most = max(most, alive)
        return {"name": whole["metadata"]["name"]}

    documents = load_documents(text, keep=keep)
    assert len(documents[0]["items"]) == 50
    return most


def test_a_big_list_is_never_held_whole() -> None:
    """A List of realistic pods: one item at a time is built whole, and the peak memory
    of the read is a fraction of the document built whole."""
    text = yaml.dump(pod_list(46), Dumper=yaml.CSafeDumper)
    assert _alive_items(text) == 1
    tracemalloc.start()
    try:
        load_documents(text, keep=pod_fields)
        streamed = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        load_documents(text)
        whole = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert streamed * 3 < whole, (streamed, whole)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(st.text(max_size=6), json_values, max_size=3),
    st.lists(json_values, max_size=5),
    st.booleans(),
)
def test_any_list_reads_the_same_streamed(
    extra: dict[str, Any], items: list[Any], flow: bool
) -> None:
    document = {**extra, "kind": "List", "items": items}
    text = yaml.safe_dump_all([document, extra or None], default_flow_style=flow)
    assert outcome(text, same) == outcome(text, None)
    assert load_documents(text, keep=same)[0] == document
