"""YAML read as a stream by ``plan`` (``load_documents(text, keep=...)``): a ``kind: List``'s
items one at a time, each kept as ``keep`` returns it; the same values and the same bounds
as the document built whole."""

from __future__ import annotations

import io
import json
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from shared_svc.commands.plan import _keep, _shape, json_stream, manifests, yaml_stream, yaml_text
from shared_svc.commands.plan.json_stream import Text
from shared_svc.commands.plan.manifests import MAX_ALIAS_NODES, MAX_DEPTH, InputError
from shared_svc.commands.plan.yaml_stream import ALL, load_yaml_stream
from shared_svc.commands.plan.yaml_text import load_documents
from shared_svc.reconcile.selection import pod_fields
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
        patch.setattr(yaml_text, "_FastLoader", None)
        patch.setattr(yaml_text, "_NoAliasLoader", None)
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


# ---------------------------------------------------------------- a kubectl List, any size


def every_kind(kind: Any) -> Any:
    return ALL


def read_list(
    text: str, keep: Callable[[Any], Any], shape: Any, max_bytes: int | None = None
) -> tuple[str, Any]:
    """``load_yaml_stream`` on ``text`` with the whole-file bound at ``max_bytes``; by
    default one byte less than the text: it cannot be read whole."""
    if max_bytes is None:
        max_bytes = len(text.encode()) - 1
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(manifests, "MAX_BYTES", max_bytes)
        try:
            return "ok", load_yaml_stream(Text(io.BytesIO(text.encode()).read), keep, shape)
        except InputError as exc:
            return "refused", str(exc)


def no_bounded_item(*args: Any) -> Any:
    raise AssertionError("a member read the bounded way")


def fast_only(patch: pytest.MonkeyPatch) -> None:
    """Every member read by rapidyaml: neither alone nor the whole text the bounded way."""
    patch.setattr(yaml_stream, "_bounded_item", no_bounded_item)
    patch.setattr(yaml_stream, "load_documents", no_bounded_item)


LISTS = {
    "odd scalars": "kind: List\nitems:\n- [0x1f, 0o17, 1_000, .5, ~, yes, On, 2024-01-01, '1', \"\\u00e9\\t\"]\n",
    "an odd pod": "apiVersion: v1\nitems:\n- kind: Pod\n  metadata: {name: yes, labels: {a: 0x1f, b: 2024-01-01, '1': ~}}\n"
    "  spec: {nodeName: n, containers: [{name: c}]}\n  status: {conditions: [{type: Ready, status: 'True', x: 1}, 5]}\n"
    "- kind: Pod\n  metadata: [not, a, mapping]\n  spec: 7\n  status: {conditions: {a: 1}}\n"
    "kind: List\nmetadata:\n  resourceVersion: ''\n",
    "block scalars and flow": "items:\n- a: |\n    two\n    lines\n  b: >-\n    folded\n    text\n  c: {d: [1, {e: f}]}\n-\n- x\n",
    "keys repeated": "items:\n- {kind: Pod, kind: Pod, metadata: {name: a, name: b}}\n",
    "no members": "apiVersion: v1\nitems:\nkind: List\n",
}


@pytest.mark.parametrize("name", sorted(LISTS))
def test_a_list_is_read_member_by_member_as_the_whole_document(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = LISTS[name]
    fast_only(monkeypatch)
    for keep, shape in ((same, every_kind), (_keep, _shape)):
        whole = outcome(text, keep)
        assert whole[0] == "ok"
        assert read_list(text, keep, shape, 1 << 30) == whole  # the text could be read whole
        assert read_list(text, keep, shape) == whole  # it could not


def test_a_realistic_list_keeps_of_each_pod_what_planning_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    text = yaml.dump(pod_list(12), Dumper=yaml.CSafeDumper)
    fast_only(monkeypatch)
    assert read_list(text, _keep, _shape) == ("ok", load_documents(text, keep=_keep))
    assert read_list(text, same, every_kind) == ("ok", load_documents(text))
    pods = [i for i in read_list(text, _keep, _shape)[1][0]["items"] if i["kind"] == "Pod"]
    assert pods and all(sorted(pod["metadata"]) == ["labels", "name", "namespace"] for pod in pods)


@pytest.mark.parametrize("name", sorted(CASES))
def test_any_yaml_reads_as_the_whole_document_while_it_can_be_read_whole(name: str) -> None:
    text = CASES[name]
    assert read_list(text, same, every_kind, 1 << 30) == outcome(text, same)


HOSTILE_MEMBERS = {
    "nested too deep": (f"- {nested(MAX_DEPTH - 1)}\n", f"nested deeper than {MAX_DEPTH} levels"),
    "a recursive alias": ("- &a [*a]\n", "recursive YAML alias *a at line 6"),
    "a long integer": ("- {n: " + "9" * 5000 + "}\n", "an integer of 5000 digits"),
    "binary": ("- {b: !!binary aGk=}\n", "!!binary is not a JSON value"),
    "a NaN label": (
        "- {kind: Pod, metadata: {labels: {a: .nan}}}\n",
        "items[3].metadata.labels.a: nan is not",
    ),
    "an int label key": (
        "- {kind: Pod, metadata: {labels: {1: a}}}\n",
        "items[3].metadata.labels: the key 1",
    ),
    "a bad character": ('- {a: "\x07"}\n', "invalid YAML: ReaderError"),
    "invalid YAML": ("- {a: [b}\n", "invalid YAML at line 6: did not find expected"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_MEMBERS))
def test_a_hostile_member_of_a_list_too_big_to_read_whole_is_one_line(name: str) -> None:
    member, fragment = HOSTILE_MEMBERS[name]
    text = "kind: List\nitems:\n- {a: 1}\n- [x]\n- {kind: Pod}\n" + member + "- {b: 2}\n"
    kind, message = read_list(text, _keep, _shape)
    assert kind == "refused" and fragment in message and "\n" not in message, message


def test_aliases_of_all_members_share_the_budget_of_a_file() -> None:
    def laughs(prefix: str) -> str:  # a member of some 12,000 nodes once expanded
        return (
            f"- {{{prefix}0: &{prefix}0 [x, x, x, x, x, x, x, x, x, x]"
            + "".join(
                f", {prefix}{i + 1}: &{prefix}{i + 1} [{', '.join([f'*{prefix}{i}'] * 10)}]"
                for i in range(3)
            )
            + "}\n"
        )

    one = "kind: List\nitems:\n" + laughs("a")
    assert read_list(one, same, every_kind)[0] == "ok"
    many = "kind: List\nitems:\n" + "".join(laughs(p) for p in "abcdefghi")
    kind, message = read_list(many, same, every_kind)
    assert kind == "refused" and f"expand to more than {MAX_ALIAS_NODES} nodes" in message


def test_the_size_bounds_hold_for_a_list() -> None:
    member = "- {kind: Pod, metadata: {name: p}}\n"
    text = "kind: List\nitems:\n" + member * 200
    assert read_list(text, _keep, _shape, 100)[0] == "ok"  # streamed past the whole-file bound
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(json_stream, "MAX_STREAM_BYTES", 1000)
        assert read_list(text, _keep, _shape, 100) == ("refused", "larger than 1000 bytes")
    big = "kind: List\nitems:\n- a: |\n" + "    x\n" * 100
    assert read_list(big, _keep, _shape, 300) == ("refused", "a value larger than 300 bytes")
    other = "a: 1\n" * 100  # not a List: read whole, at most MAX_BYTES
    kind, message = read_list(other, _keep, _shape, 100)
    assert kind == "refused" and message.startswith("larger than 100 bytes and not one YAML List")
    assert read_list(other, _keep, _shape, 1000) == outcome(other, _keep)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.dictionaries(st.text(max_size=6), json_values, max_size=4), min_size=1, max_size=4),
    st.lists(st.dictionaries(st.text(max_size=6), json_values, max_size=3), max_size=3),
)
def test_any_pods_read_as_a_list_keep_what_planning_reads(
    pods: list[dict[str, Any]], extra: list[dict[str, Any]]
) -> None:
    """Pods with any values in any field, as PyYAML writes them: the fields each keeps,
    read by rapidyaml member by member, are those ``pod_fields`` keeps of the whole pod."""
    items = []
    for index, pod in enumerate(pods):
        labels = extra[index % len(extra)] if extra else {}
        meta = {"name": f"p{index}", "labels": labels, "managedFields": pod}
        items.append(
            {"kind": "Pod", "metadata": meta, "spec": pod, "status": {"conditions": [pod]}}
        )
    listing = {"apiVersion": "v1", "kind": "List", "items": [*items, *pods]}
    text = yaml.safe_dump(json.loads(json.dumps(listing)))  # no shared parts: no aliases
    assert read_list(text, _keep, _shape) == outcome(text, _keep)


@pytest.mark.parametrize("size", [1, 2, 7, 64])
def test_a_list_cut_anywhere_across_chunks_reads_the_same(size: int) -> None:
    text = yaml.dump(pod_list(4), Dumper=yaml.CSafeDumper) + "# \u00e9\u4e16 after\n"
    text = text.replace("nvidia-dcgm-00000", "nvidia-dcgm-\u00e9\u4e16")  # multibyte
    data = text.encode()
    expected = load_documents(text, keep=_keep)
    stream = io.BytesIO(data)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(manifests, "MAX_BYTES", len(data) - 1)  # never read whole
        fast_only(patch)
        assert load_yaml_stream(Text(lambda _: stream.read(size)), _keep, _shape) == expected
