"""Untrusted manifests in, well-formed JSON objects out: the gate in front of the core.

The reconcile core (``shared_svc/reconcile/``) takes Kubernetes objects as JSON values:
dicts with string keys, lists, strings, ints, finite floats, booleans and ``None``, nested
to a sane depth. What reaches it from outside comes through here first:

- :func:`load_documents` reads the text of a manifest file (``shared-svc plan -f``),
  bounded in size, nesting and YAML alias expansion (billion laughs, recursive aliases);
- :func:`well_formed` checks any decoded value (also the API server's JSON) and returns
  it as a plain tree of JSON values.

Anything else raises :class:`InputError` with a one-line message. The limits and the
conversions are in docs/decisions.md.
"""

from __future__ import annotations

import json
import math
from typing import Any, NoReturn

import yaml

MAX_BYTES = 64 * 1024 * 1024  # one input file
MAX_DEPTH = 100  # nested mappings and sequences; real objects stay below 20
MAX_ALIAS_NODES = 100_000  # nodes that YAML aliases may add to one file
_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1  # Kubernetes JSON integers are int64
_INT_TEXT = 100  # longest integer text converted at all (0b + 64 digits fits)


def size_text(limit: int) -> str:
    """``64 MiB`` for whole MiB, else ``N bytes``."""
    return f"{limit // 2**20} MiB" if limit % 2**20 == 0 else f"{limit} bytes"


class InputError(ValueError):
    """Input that is not a well-formed JSON value; ``str()`` is one line."""


class _Bad(Exception):
    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.path: list[str | int] = []


def _path(parts: list[str | int]) -> str:
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.replace("-", "").replace("_", "").isalnum():
            out += f".{part}" if out else part
        else:
            out += f"[{json.dumps(part)}]"
    return out


def _text_ok(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates, e.g. from "\ud800" in JSON
        return False
    return True


_NOT_JSON = {
    "bytes": "binary data (YAML !!binary)",
    "set": "a set (YAML !!set)",
    "tuple": "a pair list (YAML !!omap or !!pairs)",
    "date": "a date",
    "datetime": "a timestamp",
}


def _tree(value: Any, depth: int) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        if not _text_ok(value):
            raise _Bad("a string that is not valid Unicode")
        return value
    if isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            raise _Bad("an integer out of range (more than 64 bits)")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _Bad(f"{value} is not a JSON number")
        return value
    if isinstance(value, dict | list):
        if depth >= MAX_DEPTH:
            raise _Bad(f"nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, list):
            return [_child(item, index, depth) for index, item in enumerate(value)]
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise _Bad(f"the key {key!r} is not a string")
            if not _text_ok(key):
                raise _Bad("a key that is not valid Unicode")
            out[key] = _child(item, key, depth)
        return out
    kind = type(value).__name__
    raise _Bad(f"{_NOT_JSON.get(kind, kind)} is not a JSON value")


def _child(value: Any, at: str | int, depth: int) -> Any:
    try:
        return _tree(value, depth + 1)
    except _Bad as exc:
        exc.path.insert(0, at)
        raise


def well_formed(value: Any) -> Any:
    """``value`` as a fresh tree of JSON values (no shared parts), or :class:`InputError`.

    Total over any input: mapping keys must be strings, integers fit in 64 bits, floats
    are finite, strings are valid Unicode, nesting is at most :data:`MAX_DEPTH` levels;
    anything else (bytes, sets, dates, tuples, objects) is refused. The message names the
    path of the first offending value, e.g. ``spec.selector: the key 1 is not a string``.
    """
    try:
        return _tree(value, 0)
    except _Bad as exc:
        where = _path(exc.path)
        raise InputError(f"{where}: {exc.problem}" if where else exc.problem) from None


# ---------------------------------------------------------------- YAML and JSON text


def _fail(problem: str, node: Any) -> NoReturn:
    mark = getattr(node, "start_mark", None)
    raise InputError(f"{problem} at line {mark.line + 1}" if mark is not None else problem)


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader with bounded nesting and alias expansion, and JSON scalars only.

    Timestamps stay the text they were written as (what Kubernetes' YAML decoder does);
    ``!!binary``, ``!!set``, ``!!omap`` and ``!!pairs`` are refused.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._open: set[str] = set()  # anchors whose node is being composed
        self._sizes: dict[int, int] = {}  # id(node) -> nodes it expands to
        self._alias_nodes = 0

    def compose_document(self) -> Any:
        self._sizes = {}
        return super().compose_document()

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()  # type: ignore[no-untyped-call]
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self._open:
                _fail(f"recursive YAML alias *{event.anchor}", event)
            node = super().compose_node(parent, index)
            self._alias_nodes += self._sizes.get(id(node), 1)
            if self._alias_nodes > MAX_ALIAS_NODES:
                _fail(f"YAML aliases expand to more than {MAX_ALIAS_NODES} nodes", event)
            return node
        if self._depth >= MAX_DEPTH and not isinstance(event, yaml.ScalarEvent):
            _fail(f"nested deeper than {MAX_DEPTH} levels", event)
        anchor = event.anchor
        if anchor is not None:
            self._open.add(anchor)
        self._depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
            if anchor is not None:
                self._open.discard(anchor)
        if isinstance(node, yaml.SequenceNode):
            size = 1 + sum(self._sizes.get(id(child), 1) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            size = 1 + sum(
                self._sizes.get(id(k), 1) + self._sizes.get(id(v), 1) for k, v in node.value
            )
        else:
            size = 1
        self._sizes[id(node)] = size
        return node

    def construct_yaml_int(self, node: Any) -> int:
        if len(str(node.value)) > _INT_TEXT:
            _fail(f"an integer of {len(node.value)} digits", node)
        return super().construct_yaml_int(node)

    def construct_timestamp_text(self, node: Any) -> str:
        return str(self.construct_scalar(node))

    def refuse(self, node: Any) -> NoReturn:
        _fail(f"!!{node.tag.rpartition(':')[2]} is not a JSON value", node)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)
_BoundedLoader.add_constructor(
    "tag:yaml.org,2002:timestamp", _BoundedLoader.construct_timestamp_text
)
for _tag in ("binary", "set", "omap", "pairs"):
    _BoundedLoader.add_constructor(f"tag:yaml.org,2002:{_tag}", _BoundedLoader.refuse)


def _json_int(text: str) -> int:
    if len(text) > _INT_TEXT:
        raise InputError(f"an integer of {len(text)} digits")
    return int(text)


def _json_constant(text: str) -> NoReturn:
    raise InputError(f"{text} is not a JSON number")


def _looks_like_json(text: str) -> bool:
    return text.lstrip()[:1] in ("{", "[")


def load_documents(text: str) -> list[Any]:
    """The documents of a manifest (YAML, many documents, or one JSON value), bounded.

    Raises :class:`InputError` (one line) for input over :data:`MAX_BYTES`, invalid
    YAML or JSON, nesting beyond :data:`MAX_DEPTH`, aliases that recurse or expand to
    more than :data:`MAX_ALIAS_NODES` nodes, and non-JSON values. Each document is
    returned through :func:`well_formed` (``None`` for an empty YAML document).
    """
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise InputError(f"larger than {size_text(MAX_BYTES)}")
    if _looks_like_json(text):
        try:
            value = json.loads(text, parse_int=_json_int, parse_constant=_json_constant)
        except RecursionError:
            raise InputError(f"nested deeper than {MAX_DEPTH} levels") from None
        except json.JSONDecodeError:
            pass  # not JSON after all (a YAML flow mapping, several documents): read as YAML
        else:
            return [_document(value, 1)]
    loader = _BoundedLoader(text)
    documents: list[Any] = []
    try:
        while loader.check_node():
            documents.append(_document(loader.get_data(), len(documents) + 1))
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise InputError(f"invalid YAML{at}: {problem}") from None
    except RecursionError:  # not expected past the depth bound; never a traceback
        raise InputError(f"nested deeper than {MAX_DEPTH} levels") from None
    finally:
        loader.dispose()
    return documents


def _document(value: Any, number: int) -> Any:
    try:
        return well_formed(value)
    except InputError as exc:
        raise InputError(f"document {number}: {exc}") from None
