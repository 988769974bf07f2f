"""Untrusted manifests in, well-formed JSON objects out: the gate in front of the core.

The reconcile core (``shared_svc/reconcile/``) takes Kubernetes objects as JSON values:
dicts with string keys, lists, strings, ints, finite floats, booleans and ``None``, nested
to a sane depth. What reaches it from outside comes through here first: :func:`well_formed`
checks any decoded value (also the API server's JSON) and returns it as a plain tree of
JSON values, within the limits here (``MAX_BYTES``: one input file; ``MAX_DEPTH``).
The text is read by format, each in a module of its own:

- ``yaml_text.py``: :func:`~.yaml_text.load_documents` reads the text of a manifest file
  (``shared-svc plan -f``), bounded in size, nesting and YAML alias expansion (billion
  laughs, recursive aliases);
- ``json_stream.py``: :func:`~.json_stream.load_json_stream`, a big JSON List
  (``kubectl get -o json``) read item by item;
- ``yaml_stream.py``: :func:`~.yaml_stream.load_yaml_stream`, a big YAML List read item
  by item.

Anything else raises :class:`InputError` with a one-line message. The limits and the
conversions are in docs/decisions.md.
"""

from __future__ import annotations

import json
import math
from typing import Any, NoReturn

from shared_svc.k8s.limits import MAX_DEPTH as MAX_DEPTH
from shared_svc.k8s.limits import TOO_DEEP

MAX_BYTES = 64 * 1024 * 1024  # one input file


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


class _Streamed(list[Any]):
    """A top-level ``items`` read as a stream: its members built, checked and kept one at
    a time; else the first member that could not be built or failed the checks."""

    def __init__(self) -> None:
        super().__init__()
        self.unbuilt: Exception | None = None
        self.bad: _Bad | None = None


def _tree(value: Any, depth: int) -> Any:
    if type(value) is str and value.isascii():  # the most common value, valid: first
        return value
    if value is None or isinstance(value, bool):
        return value
    if type(value) is _Streamed:  # checked already, member by member
        if value.bad is not None:
            raise value.bad
        return list(value)
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
            raise _Bad(TOO_DEEP)
        if isinstance(value, list):
            return [_child(item, index, depth) for index, item in enumerate(value)]
        out = {}
        for key, item in value.items():
            if type(key) is not str or not key.isascii():
                if not isinstance(key, str):
                    raise _Bad(f"the key {key!r} is not a string")
                if not _text_ok(key):
                    raise _Bad("a key that is not valid Unicode")
            # an ASCII string is valid as it is: kept without a call (most label values)
            out[key] = item if type(item) is str and item.isascii() else _child(item, key, depth)
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


def _json_int(text: str) -> int:
    if len(text) > _INT_TEXT:
        raise InputError(f"an integer of {len(text)} digits")
    return int(text)


def _json_constant(text: str) -> NoReturn:
    raise InputError(f"{text} is not a JSON number")


def _document(value: Any, number: int) -> Any:
    try:
        return well_formed(value)
    except InputError as exc:
        raise InputError(f"document {number}: {exc}") from None
