"""``kube.untrusted.json_depth`` (bytes operations only, on every page of a re-list) is the
nesting depth of the JSON value, whatever its strings hold: quotes, backslashes, brackets,
escapes of any of them (issue 12: a re-list of 8,000 pods spent a quarter of its CPU in
this check)."""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from shared_svc.kube.untrusted import json_depth

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


def regex_depth(raw: bytes) -> int:
    """The earlier implementation: strings removed by a regular expression."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKET)
    return max(accumulate(1 if b in b"[{" else -1 for b in brackets), default=0)


def depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    return 0


tricky = st.text(alphabet='"\\[]{}/ab\u00e9\n\t\u2028', max_size=12)
values = st.recursive(
    st.none() | st.booleans() | st.integers() | tricky,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(tricky, inner, max_size=4),
    max_leaves=30,
)


@given(values, st.booleans(), st.booleans())
def test_json_depth_is_the_nesting_depth(value: Any, ascii_only: bool, compact: bool) -> None:
    raw = json.dumps(
        value, ensure_ascii=ascii_only, separators=(",", ":") if compact else None
    ).encode()
    assert json_depth(raw) == depth(value) == regex_depth(raw)


def test_escapes_next_to_quotes_and_brackets() -> None:
    for value in (
        ["\\"],
        {"\\": ["\\\\", '"', '\\"']},
        ['\\"[', ["]\\\\"]],
        "[[[[",
        [[[]], {"a": [[["x"]]]}],
    ):
        raw = json.dumps(value).encode()
        assert json_depth(raw) == depth(value), raw


_QUOTE_OR_BRACKET = bytes(b for b in range(256) if b not in b'"[]{}')


def running_sum_depth(raw: bytes) -> int:
    """The implementation before issue 22's passes: strings cut by splitting on every
    quote, then the running sum of the brackets left."""
    bare = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _QUOTE_OR_BRACKET)
    brackets = b"".join(bare.split(b'"')[::2])
    return max(accumulate(1 if b in b"[{" else -1 for b in brackets), default=0)


@given(st.binary() | st.text(alphabet='"\\[]{}ax', max_size=40).map(str.encode))
def test_json_depth_of_any_text_is_what_the_running_sum_gave(raw: bytes) -> None:
    """Not JSON too (unpaired brackets or quotes, stray escapes): the depth decides whether
    a text is pruned before it is parsed, so a text ``json.loads`` refuses must be refused
    with the same error as before."""
    assert json_depth(raw) == running_sum_depth(raw)
