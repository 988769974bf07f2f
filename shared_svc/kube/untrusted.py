"""The guard in front of the caches: the API server's JSON, nested to any depth.

Fields nobody here judges must not stop a cache. An object nested deeper than
:data:`MAX_DEPTH` (an unknown field a CRD preserves) is kept with the too-deep subtrees
replaced by :data:`PRUNED`, so its known fields still count; dropping a ClusterPolicy
would read as "deleted" (docs/decisions.md).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from itertools import accumulate
from typing import Any

from shared_svc.k8s.limits import MAX_DEPTH as MAX_DEPTH
from shared_svc.k8s.limits import TOO_DEEP

PRUNED = f"<pruned by shared-svc: {TOO_DEEP}>"
"""What replaces a subtree nested deeper than :data:`MAX_DEPTH` (``k8s.limits``)."""

_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
_NOT_QUOTE_OR_BRACKET = bytes(b for b in range(256) if b not in b'"[]{}')
_SQUARE = bytes.maketrans(b"{}", b"[]")
_MAX_PASSES = 4 * MAX_DEPTH  # deeper (a hostile text): the running sum, one pass
_STEP = [0] * 256
for _b in b"[{":
    _STEP[_b] = 1
for _b in b"]}":
    _STEP[_b] = -1


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text (no recursion).

    Escaped backslashes, then escaped quotes, are dropped (JSON pairs backslashes from
    the left, as ``replace`` does), so every remaining quote opens or closes a string;
    of the quotes and brackets left, the brackets outside strings count. Bytes-level
    C operations only: it runs on every page of a re-list and every watch event. Each
    pass drops every innermost pair of brackets (``[]`` or ``{}`` alike), one level:
    when they are all gone the passes are the depth; a text whose brackets do not pair
    (not JSON) is counted by the running sum."""
    bare = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_QUOTE_OR_BRACKET)
    # Two adjacent quotes have no bracket between them: dropping them changes no other
    # bracket's side of a string (the quotes before it stay even or odd). Nearly every
    # quote goes so; of the few left (strings holding brackets), every other part.
    bare = bare.replace(b'""', b"")
    brackets = b"".join(bare.split(b'"')[::2]) if b'"' in bare else bare
    rest, passes = brackets.translate(_SQUARE), 0
    while rest and passes <= _MAX_PASSES:
        inner = rest.replace(b"[]", b"")
        if len(inner) == len(rest):
            break
        rest, passes = inner, passes + 1
    if not rest:
        return passes
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def _prune(raw: bytes, limit: int) -> bytes:
    """``raw`` with every array or object below ``limit`` levels replaced by PRUNED."""
    out: list[bytes] = []
    depth, cut_from, copied = 0, -1, 0
    for match in _TOKEN.finditer(raw):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            if depth == limit + 1:
                cut_from = match.start()
        elif token in (b"]", b"}"):
            depth -= 1
            if depth == limit and cut_from >= 0:
                out += [raw[copied:cut_from], json.dumps(PRUNED).encode()]
                copied, cut_from = match.end(), -1
    out.append(raw[copied:])
    return b"".join(out)


def loads(
    raw: bytes, *, envelope: int = 0, fast: Callable[[bytes], Any] | None = None
) -> tuple[Any, bool]:
    """``json.loads``, but an object nested deeper than MAX_DEPTH keeps its shallower
    fields and gets PRUNED in place of the too-deep subtrees (``envelope``: container
    levels around the objects, 1 for a watch event, 2 for a list). Returns the value and
    whether anything was pruned.

    ``fast`` (``kube.decode.Decoder``: the fields a cache reads, the rest skipped) is
    tried first, on any text: msgspec skips the unread fields within its own recursion
    guard (deeper: a RecursionError, answered None), and what it built is taken when it
    is nested within the bound (:func:`within_depth`, a walk of the few kept fields,
    not of the text). Then nothing a cache keeps was cut: a too-deep subtree in a field
    nobody reads is skipped, as it is dropped after the exact reader cuts it (issue 22:
    the bytes-level depth check was 70 % of a pod's decoding). Where it answers None or
    built something too deep, the text is read the exact way (the same value or the
    same error)."""
    limit = MAX_DEPTH + envelope
    if fast is not None:
        value = fast(raw)
        if value is not None and within_depth(value, limit):
            return value, False
    if raw.count(b"{") + raw.count(b"[") <= limit or json_depth(raw) <= limit:
        return json.loads(raw), False
    return json.loads(_prune(raw, limit)), True


def within_depth(value: Any, limit: int) -> bool:
    """Is ``value`` (parsed) nested at most ``limit`` levels of arrays and objects, as
    :func:`json_depth` counts them? Level by level, no recursion."""
    level, frontier = 0, [value]
    while True:
        containers = [v for v in frontier if isinstance(v, dict | list)]
        if not containers:
            return True
        level += 1
        if level > limit:
            return False
        frontier = [x for v in containers for x in (v.values() if isinstance(v, dict) else v)]


def has_pruned(value: Any) -> bool:
    """Does ``value`` (a parsed object) hold a PRUNED subtree? Iterative, as it is only
    asked of objects that were parsed with ``loads``."""
    stack = [value]
    while stack:
        item = stack.pop()
        if item == PRUNED:
            return True
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
