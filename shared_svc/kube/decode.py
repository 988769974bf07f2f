"""List pages and watch events decoded straight into what a cache reads (msgspec).

A cache keeps a few fields of each object (``Resource.project``, ``metadata_only``);
``json.loads`` builds every dict of a 15-22 KiB pod first, then the projection copies out
the few it keeps. A :class:`Decoder` builds only the fields of a :data:`Shape` (the ones
the projection reads, and each object's name, namespace and resourceVersion) from the
wire bytes, with msgspec typed structs: the rest of the text is skipped, not built. What
comes out is the same page or event, less the fields nobody reads, so the projection
after it (``Resource.kept``) gives what it gives from the whole object.

Exact or not at all: :meth:`Decoder.page` and :meth:`Decoder.event` answer None where
today's reader (``json.loads`` behind ``kube.untrusted``) could read the text otherwise,
and the caller reads it the exact way (the same value, the same error): a kept part of
another type than its struct's (``metadata: "x"``, a condition that is not a mapping, a
null), JSON that msgspec refuses (NaN, a lone surrogate, a number out of its range, a
syntax error), an integer longer than Python's ``int`` reads (``json.loads`` refuses it
even in a dropped field; msgspec would skip it), a byte that is not UTF-8 (idem), an
ERROR event (its Status fields are not an object's), and a struct with
``forbid_unknown_fields`` meeting a key it does not declare. The nesting bound stays the
caller's (``untrusted.loads``): msgspec reads any text, its own limit being Python's
recursion limit (about 1,000 levels, skipped fields included; a RecursionError is answered
None), and what it built is taken only when nested within ``MAX_DEPTH``, else the text is
pruned the exact way.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

ALL: Any = None
"""In a :data:`Shape`: the value whole, as it is (any JSON type)."""

Shape = Any
"""``ALL``, ``{key: Shape}`` (a mapping: those keys of it, each of its shape) or
``[Shape]`` (a list, each item of the shape). The same convention as ``yaml_stream.Shape``;
besides, :class:`Closed` and :data:`SKIP`."""

SKIP: Any = msgspec.Raw
"""In a :class:`Closed` shape: a key whose value is parsed, not built (a ``msgspec.Raw``
left in the decoded mapping, for the projection to drop)."""


class Closed(dict[str, Any]):
    """A mapping shape of every key the mapping may have: a text whose mapping holds
    another is read the exact way (msgspec's ``forbid_unknown_fields``). For a projection
    that keeps every key but a few (``metadata_view``): the few are :data:`SKIP`."""


# Each object's identity and version: the key and the resourceVersion of the cache.
_IDENTITY: Shape = {"metadata": {"name": ALL, "namespace": ALL, "resourceVersion": ALL}}

_DIGITS = bytes(ord("0") if chr(c).isdigit() and c < 128 else ord(" ") for c in range(256))


def merge(a: Shape, b: Shape) -> Shape:
    """The shape reading both ``a`` and ``b`` (``ALL`` wins)."""
    if a is ALL or b is ALL:
        return ALL
    if isinstance(a, list) and isinstance(b, list):
        return [merge(a[0], b[0])]
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        keys = {**a, **b}
        out = {k: merge(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in keys}
        return Closed(out) if isinstance(a, Closed) or isinstance(b, Closed) else out
    raise ValueError(f"shapes of different kinds: {a!r}, {b!r}")


def _struct(shape: Shape, name: str) -> Any:
    """The msgspec type reading ``shape``: Any, a list of one, or a Struct whose fields
    are all optional (UNSET when absent, left out by ``to_builtins``)."""
    if shape is ALL:
        return Any
    if shape is SKIP:
        return msgspec.Raw
    if isinstance(shape, list):
        return list[_struct(shape[0], name)]  # type: ignore[misc]
    fields = []
    for key, sub in shape.items():
        kind = _struct(sub, f"{name}_{key}")
        typ = Any if kind is Any else kind | UnsetType
        fields.append((f"f_{key}", typ, msgspec.field(default=UNSET, name=key)))
    return msgspec.defstruct(name, fields, forbid_unknown_fields=isinstance(shape, Closed))


class Decoder:
    """Decodes list pages and watch events of one resource: of each object, the fields of
    ``shape`` and its identity (name, namespace, resourceVersion)."""

    def __init__(self, shape: Shape) -> None:
        self.shape = merge(shape, _IDENTITY)
        item = _struct(self.shape, "Item")
        page_meta = _struct({"resourceVersion": ALL, "continue": ALL}, "ListMeta")
        page = msgspec.defstruct(
            "Page",
            [
                ("metadata", page_meta | None | UnsetType, UNSET),
                ("items", list[item] | None | UnsetType, UNSET),  # type: ignore[valid-type]
            ],
        )
        event = msgspec.defstruct(
            "Event", [("type", Any, UNSET), ("object", item | None | UnsetType, UNSET)]
        )
        self._page = msgspec.json.Decoder(page)
        self._event = msgspec.json.Decoder(event)

    def page(self, raw: bytes) -> Any:
        """A list page as ``json.loads`` reads it, less the unread fields; None: read it
        the exact way."""
        return self._decode(self._page, raw)

    def event(self, raw: bytes) -> Any:
        """A watch event (ADDED, MODIFIED, DELETED, BOOKMARK) as ``json.loads`` reads it,
        less the unread fields; None: read it the exact way (an ERROR event too)."""
        event = self._decode(self._event, raw)
        if event is None or event.get("type") not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
            return None
        return event

    @staticmethod
    def _decode(decoder: msgspec.json.Decoder[Any], raw: bytes) -> Any:
        if not raw.isascii():
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return None
        # json.loads refuses integers longer than this, anywhere; msgspec skips them.
        limit = sys.get_int_max_str_digits()
        if limit and b"0" * (limit + 1) in raw.translate(_DIGITS):
            return None
        try:
            value = decoder.decode(raw)
        except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
            return None
        # Plain dicts and lists in the structs' order, unset fields left out, SKIP's as Raw.
        return msgspec.to_builtins(value, builtin_types=(msgspec.Raw,))
