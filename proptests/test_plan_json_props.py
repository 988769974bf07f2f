"""The fast JSON reader of ``plan`` (msgspec typed structs for the kept fields of a Pod)
keeps what the exact reader keeps, or leaves the member to it: the same values, the same
errors, for any Pod JSON, hostile text included (issue 22)."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from proptests.strategies import json_values, set_at
from proptests.test_pod_fields_props import PATHS
from shared_svc.commands.plan import _FAST_POD, _fast_pod, _keep
from shared_svc.commands.plan.json_stream import Fast, NotJSON, Text, load_json_stream
from shared_svc.commands.plan.manifests import InputError
from tests.realistic import api_pod

HOLE = "\x00hole"  # a string value replaced by hostile text once the pod is JSON
HOSTILE = st.one_of(
    st.integers(min_value=1, max_value=3).map(lambda n: "1" * (98 + n)),  # 99-101 digits
    st.integers(min_value=1, max_value=3).map(lambda n: "-" + "9" * (98 + n)),
    st.sampled_from(
        [
            "NaN",
            "-Infinity",
            "1e400",
            "9223372036854775808",
            "-9223372036854775809",
            "1" * 150 + ".5",
            '"\\ud800"',
            '"\\udc00x"',
            '"a\\u0000b"',
            '"\\x"',
            "01",
            "[1,]",
            '{"a":1,"a":[2]}',
            '"tab\there"',
            "tru",
        ]
    ),
    # Nesting around the gate's bound (kept fields) and the parsers' (anywhere).
    st.sampled_from([99, 100, 101, 450, 899, 950, 990, 1000, 1100]).map(
        lambda n: "[" * n + "]" * n
    ),
)
# Fields the reader drops and the kept ones, where odd values go.
DROPPED = (("metadata", "uid"), ("spec", "containers"), ("status", "phase"), ("zzz",))


FORMATS = st.fixed_dictionaries(
    {
        "separators": st.sampled_from([(",", ":"), (", ", ": ")]),
        "indent": st.sampled_from([None, 4]),
        "ensure_ascii": st.booleans(),
    }
)


def odd_text(
    draw: st.DrawFn, obj: Any, paths: Sequence[tuple[str, ...]], fmt: dict[str, Any]
) -> str:
    """``obj``'s JSON (as ``fmt`` writes it) after up to three odd values and two hostile
    tokens (``HOSTILE``, in place of a ``HOLE``) at some of ``paths``."""
    for _ in range(draw(st.integers(0, 3))):
        set_at(obj, draw(st.sampled_from(paths)), draw(json_values | st.floats()))
    for _ in range(draw(st.integers(0, 2))):
        set_at(obj, draw(st.sampled_from(paths)), HOLE)
    text = json.dumps(obj, allow_nan=True, **fmt)
    while json.dumps(HOLE) in text:
        text = text.replace(json.dumps(HOLE), draw(HOSTILE), 1)
    return text


@st.composite
def pod_texts(draw: st.DrawFn, fmt: dict[str, Any]) -> str:
    """A realistic Pod's JSON, with odd values in kept and dropped fields, duplicate keys,
    hostile tokens, as the API server or kubectl writes it (compact or indented)."""
    app = draw(st.sampled_from(["nvidia-dcgm", "nvidia-dcgm-exporter", "other"]))
    pod: Any = api_pod(app, draw(st.sampled_from(["p-0", "p-1"])), "node-0")
    text = odd_text(draw, pod, PATHS + DROPPED, fmt)
    if draw(st.booleans()):  # a duplicate key: the last one wins (or an odd one first)
        key = draw(st.sampled_from(["kind", "metadata", "spec", "status", "apiVersion"]))
        value = json.dumps(draw(json_values))
        at = draw(st.sampled_from(["first", "last"]))
        text = (
            text[:-1] + f',"{key}":{value}}}'
            if at == "last"
            else text[:1] + f'"{key}":{value},' + text[1:]
        )
    return text


def _read(text: str, fast: Fast | None) -> tuple[str, Any]:
    read = Text(io.BytesIO(text.encode("utf-8")).read).read
    try:
        return "kept", load_json_stream(read, _keep, fast)
    except (InputError, NotJSON) as exc:
        return "refused", str(exc)


@st.composite
def pod_lists(draw: st.DrawFn) -> str:
    """A List of such pods, written alike (as one writer writes them), a plain one last:
    a member is cut out where the next one begins."""
    fmt = draw(FORMATS)
    pods = draw(st.lists(pod_texts(fmt), min_size=1, max_size=3))
    pods.append(json.dumps(api_pod("nvidia-dcgm", "p-9", "node-9"), **fmt))
    comma = draw(st.sampled_from([",", ",\n", " , "]))
    return '{"apiVersion":"v1","items":[' + comma.join(pods) + '],"kind":"List"}'


def _nested_pod_text() -> str:
    """A pod whose dropped fields hold the text a member begins with, after ``},``: the
    first cut is inside it (and does not decode as one value)."""
    pod = api_pod("nvidia-dcgm", "p-0", "node-0")
    pod["spec"]["containers"] = [{}, {"apiVersion": "v1", "kind": "Pod", "metadata": {}}]
    return json.dumps(pod, separators=(",", ":"))


@given(pod_lists())
@example('{"items":[' + ",".join([json.dumps(api_pod("nvidia-dcgm", "p-0", "node-0"))] * 2) + "]}")
@example('{"items":[' + ",".join([_nested_pod_text()] * 3) + "]}")
def test_the_fast_reader_keeps_what_the_exact_reader_keeps_or_refuses_what_it_refuses(
    text: str,
) -> None:
    assert _read(text, _FAST_POD) == _read(text, None)


@given(FORMATS.flatmap(pod_texts))
def test_the_fast_reader_of_one_pod_is_its_kept_fields_or_gives_it_to_the_exact_reader(
    text: str,
) -> None:
    fast = _fast_pod(text)
    if fast is not None:
        assert fast == _keep(json.loads(text))


def test_a_realistic_pod_is_read_by_the_fast_reader() -> None:
    """So the properties above do not hold by always leaving pods to the exact reader."""
    pod = api_pod("nvidia-dcgm", "p-0", "node-0")
    for text in (json.dumps(pod, separators=(",", ":")), json.dumps(pod, indent=4)):
        assert _fast_pod(text) == _keep(pod)
