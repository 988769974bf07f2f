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

import codecs
import json
import math
import os
import re
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import yaml

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


# ---------------------------------------------------------------- YAML and JSON text


def _fail(problem: str, node: Any) -> NoReturn:
    mark = getattr(node, "start_mark", None)
    raise InputError(f"{problem} at line {mark.line + 1}" if mark is not None else problem)


class _Bounds(yaml.composer.Composer, yaml.constructor.SafeConstructor):
    """Bounded nesting and alias expansion, and JSON scalars only, over any YAML parser.

    Timestamps stay the text they were written as (what Kubernetes' YAML decoder does);
    ``!!binary``, ``!!set``, ``!!omap`` and ``!!pairs`` are refused. The nodes are composed
    here, in Python, whichever parser (libyaml's or PyYAML's) produces the events.
    """

    def _init_bounds(self) -> None:
        self._depth = 0
        self._open: set[str] = set()  # anchors whose node is being composed
        self._sizes: dict[int, int] = {}  # id(node) -> nodes it expands to
        self._alias_nodes = 0
        self._streamed: dict[int, _Streamed] = {}  # id(placeholder node) -> its items

    def compose_document(self) -> Any:
        self._sizes = {}
        return super().compose_document()

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()  # type: ignore[attr-defined]
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self._open:
                _fail(f"recursive YAML alias *{event.anchor}", event)
            node = super().compose_node(parent, index)
            self._alias_nodes += self._sizes.get(id(node), 1)
            if self._alias_nodes > MAX_ALIAS_NODES:
                _fail(f"YAML aliases expand to more than {MAX_ALIAS_NODES} nodes", event)
            return node
        if self._depth >= MAX_DEPTH and not isinstance(event, yaml.ScalarEvent):
            _fail(TOO_DEEP, event)
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

    def construct_streamed(self, node: Any) -> Any:
        """The place of a streamed ``items`` in its document: its members, or the first
        error building them, raised where building the document whole would raise it."""
        streamed: _Streamed = self._streamed[id(node)]
        if streamed.unbuilt is not None:
            raise streamed.unbuilt
        return streamed


_Bounds.add_constructor("tag:yaml.org,2002:int", _Bounds.construct_yaml_int)  # type: ignore[type-var]
_Bounds.add_constructor("tag:yaml.org,2002:timestamp", _Bounds.construct_timestamp_text)  # type: ignore[type-var]
for _tag in ("binary", "set", "omap", "pairs"):
    _Bounds.add_constructor(f"tag:yaml.org,2002:{_tag}", _Bounds.refuse)  # type: ignore[type-var]
_STREAMED = "tag:shared-svc.nvidia.com,2026:streamed-items"  # never resolved from text
_Bounds.add_constructor(_STREAMED, _Bounds.construct_streamed)  # type: ignore[type-var]


class _BoundedLoader(_Bounds, yaml.SafeLoader):
    """The bounds over PyYAML's pure-Python reader, scanner and parser."""

    def __init__(self, stream: str) -> None:
        yaml.SafeLoader.__init__(self, stream)
        self._init_bounds()


_STR, _MAP, _SEQ = (f"tag:yaml.org,2002:{t}" for t in ("str", "map", "seq"))
_SPECIAL_KEYS = ("tag:yaml.org,2002:merge", "tag:yaml.org,2002:value")
_FastLoader: Any = None
_NoAliasLoader: Any = None
if getattr(yaml, "__with_libyaml__", False):
    from yaml._yaml import CParser

    class _CBoundedLoader(_Bounds, CParser, yaml.resolver.Resolver):
        """The same bounds and composer over libyaml's scanner and parser (C): the same
        documents, a few times faster. Composer comes before CParser, so the Python
        composer (with the bounds) builds the nodes, never libyaml's."""

        def __init__(self, stream: str) -> None:
            CParser.__init__(self, stream)
            yaml.composer.Composer.__init__(self)
            yaml.constructor.SafeConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)
            self._init_bounds()

    class _CLoader(CParser, _Bounds, yaml.resolver.Resolver):
        """libyaml composes too (C): only for text without anchors or aliases (no ``&`` or
        ``*`` anywhere), where there is no expansion to bound. libyaml refuses nesting
        past its own limit (1,000 levels) and the well-formed gate past ours."""

        def __init__(self, stream: str) -> None:
            CParser.__init__(self, stream)
            yaml.constructor.SafeConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)
            self._init_bounds()

        def construct_document(self, node: Any) -> Any:
            return self._value(node, 0)

        def _value(self, node: Any, depth: int) -> Any:
            """The value of ``node``: what SafeConstructor (with the bounds' scalars) makes
            of it, built directly for plain strings, mappings and sequences."""
            tag = node.tag
            if tag == _STR:
                return node.value
            if tag in (_MAP, _SEQ):
                if depth >= MAX_DEPTH:
                    _fail(TOO_DEEP, node)
                if tag == _SEQ:
                    return [self._value(child, depth + 1) for child in node.value]
                out = {}
                for key_node, value_node in node.value:
                    if key_node.tag in _SPECIAL_KEYS:  # merge keys: PyYAML's way
                        return self.construct_object(node, deep=True)
                    key = self._value(key_node, depth + 1)
                    if not isinstance(key, Hashable):
                        raise yaml.constructor.ConstructorError(
                            "while constructing a mapping",
                            node.start_mark,
                            "found unhashable key",
                            key_node.start_mark,
                        )
                    out[key] = self._value(value_node, depth + 1)
                return out
            return self.construct_object(node, deep=True)

    _FastLoader = _CBoundedLoader
    _NoAliasLoader = _CLoader


def _json_int(text: str) -> int:
    if len(text) > _INT_TEXT:
        raise InputError(f"an integer of {len(text)} digits")
    return int(text)


def _json_constant(text: str) -> NoReturn:
    raise InputError(f"{text} is not a JSON number")


def _looks_like_json(text: str) -> bool:
    return text.lstrip()[:1] in ("{", "[")


def load_documents(text: str, keep: Callable[[Any], Any] | None = None) -> list[Any]:
    """The documents of a manifest (YAML, many documents, or one JSON value), bounded.

    Raises :class:`InputError` (one line) for input over :data:`MAX_BYTES`, invalid
    YAML or JSON, nesting beyond :data:`MAX_DEPTH`, aliases that recurse or expand to
    more than :data:`MAX_ALIAS_NODES` nodes, and non-JSON values. Each document is
    returned through :func:`well_formed` (``None`` for an empty YAML document).

    With ``keep``, YAML is streamed: documents are read one at a time, and the members of
    a document's top-level ``items`` sequence (a ``kind: List``) are composed, built and
    checked one at a time; each of them, and each document that is not such a list, goes
    through ``keep`` (which may return less of it) once it has passed the checks, so only
    what ``keep`` returns is held. The bounds and the values before ``keep`` are the same.
    """
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise InputError(f"larger than {size_text(MAX_BYTES)}")
    return _load(text, keep)


def _load(text: str, keep: Callable[[Any], Any] | None = None) -> list[Any]:
    """:func:`load_documents` of text known to be within the size bound."""
    if _looks_like_json(text):
        try:
            value = json.loads(text, parse_int=_json_int, parse_constant=_json_constant)
        except RecursionError:
            raise InputError(TOO_DEEP) from None
        except json.JSONDecodeError:
            pass  # not JSON after all (a YAML flow mapping, several documents): read as YAML
        else:
            return [_document(value, 1)]
    if keep is not None:
        loader = (_FastLoader or _BoundedLoader)(text)
    elif _NoAliasLoader is not None and "&" not in text and "*" not in text:
        loader = _NoAliasLoader(text)
    else:
        loader = (_FastLoader or _BoundedLoader)(text)
    documents: list[Any] = []
    try:
        if keep is None:
            while loader.check_node():
                documents.append(_document(loader.get_data(), len(documents) + 1))
        else:
            loader.get_event()  # StreamStartEvent
            while not loader.check_event(yaml.StreamEndEvent):
                documents.append(_streamed_document(loader, keep, len(documents) + 1))
            loader.get_event()
    except yaml.YAMLError as exc:
        raise _yaml_error(exc) from None
    except RecursionError:  # not expected past the depth bound; never a traceback
        raise InputError(TOO_DEEP) from None
    finally:
        loader.dispose()
    return documents


def _yaml_error(exc: yaml.YAMLError) -> InputError:
    where = getattr(exc, "problem_mark", None)
    at = f" at line {where.line + 1}" if where is not None else ""
    problem = getattr(exc, "problem", None) or type(exc).__name__
    if "maximum nesting depth" in problem:  # libyaml's own bound, far above ours
        return InputError(f"{TOO_DEEP}{at}")
    return InputError(f"invalid YAML{at}: {problem}")


def _plain(event: Any, kind: Any) -> bool:
    """An event opening a node of ``kind`` with no anchor and no tag (nothing can refer to
    it, and it resolves to the plain mapping or sequence)."""
    return isinstance(event, kind) and event.anchor is None and event.tag is None


def _streamed_document(loader: Any, keep: Callable[[Any], Any], number: int) -> Any:
    """One YAML document, from its DocumentStartEvent; a top-level ``items`` sequence is
    composed, built, checked and kept one member at a time (see :func:`load_documents`).

    The rest of the document is composed and built whole with a placeholder where such an
    ``items`` was, so an error is the one building the document whole raises first: a
    composing error (syntax, bounds) as it is read, a building error (a refused tag, a
    long integer) before any failed check, each kind first in document order.
    """
    loader.get_event()  # DocumentStartEvent
    loader._sizes = {}
    loader._streamed = {}
    if not _plain(loader.peek_event(), yaml.MappingStartEvent):
        node = loader.compose_node(None, None)
        loader.get_event()  # DocumentEndEvent
        loader.anchors = {}
        value = _document(loader.construct_document(node), number)
        return None if value is None else keep(value)
    start = loader.get_event()
    pairs: list[tuple[Any, Any]] = []
    lists = False
    loader._depth = 1
    try:
        while not loader.check_event(yaml.MappingEndEvent):
            key = loader.compose_node(None, None)
            if (
                isinstance(key, yaml.ScalarNode)
                and key.tag == _STR
                and key.value == "items"
                and _plain(loader.peek_event(), yaml.SequenceStartEvent)
            ):
                seq = loader.get_event()
                loader._depth = 2
                streamed = _stream_items(loader, keep)
                end = loader.get_event()
                loader._depth = 1
                placeholder = yaml.SequenceNode(_STREAMED, [], seq.start_mark, end.end_mark)
                loader._streamed[id(placeholder)] = streamed
                pairs.append((key, placeholder))
                lists = True
            else:
                pairs.append((key, loader.compose_node(None, None)))
        end = loader.get_event()
    finally:
        loader._depth = 0
    loader.get_event()  # DocumentEndEvent
    loader.anchors = {}
    mapping = yaml.MappingNode(_MAP, pairs, start.start_mark, end.end_mark, start.flow_style)
    value = _document(loader.construct_document(mapping), number)
    loader._streamed = {}
    return value if lists else keep(value)


def _stream_items(loader: Any, keep: Callable[[Any], Any]) -> _Streamed:
    """The members of a sequence, up to its SequenceEndEvent: each composed, built and
    checked alone, then kept; the first that cannot be built or fails is remembered."""
    streamed = _Streamed()
    index = 0
    while not loader.check_event(yaml.SequenceEndEvent):
        node = loader.compose_node(None, None)
        if streamed.unbuilt is None:
            try:
                value = loader.construct_document(node)
            except (InputError, yaml.YAMLError) as exc:
                streamed.unbuilt = exc
            else:
                if streamed.bad is None:
                    try:
                        streamed.append(keep(_tree(value, 2)))
                    except _Bad as exc:
                        exc.path.insert(0, index)
                        streamed.bad = exc
                del value
        del node
        # Only anchored nodes can be referred to again: forget the sizes of the others.
        loader._sizes = {id(n): loader._sizes.get(id(n), 1) for n in loader.anchors.values()}
        index += 1
    return streamed


# ---------------------------------------------------------------- a big JSON List, streamed

MAX_STREAM_BYTES = 1024 * 1024 * 1024  # one file read item by item (kubectl get -o json|yaml)
_CHUNK = 1 << 20


class Text:
    """The text of a binary stream (a file, stdin), read in chunks: strict UTF-8 (else
    :class:`UnicodeDecodeError`), at most :data:`MAX_STREAM_BYTES` bytes (else
    :class:`InputError`). The first :data:`MAX_BYTES` bytes are kept, so that while no
    more was read the text can be read again from its start (:meth:`restart`)."""

    def __init__(self, read: Callable[[int], bytes]) -> None:
        self._raw = read
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self.bytes = 0  # bytes read from the stream
        self._kept: list[str] | None = []
        self._at = 0  # chunks of _kept read again since the last restart
        self._peeked: str | None = None

    def read(self, size: int = _CHUNK) -> str:
        """The next characters ("" at the end): about ``size`` bytes' worth."""
        if self._kept is not None and self._at < len(self._kept):
            self._at += 1
            return self._kept[self._at - 1]
        if self._peeked is not None:
            text, self._peeked = self._peeked, None
        else:
            text = self._fresh(size)
        if self._kept is not None:
            if self.bytes > MAX_BYTES:
                self._kept = None
            elif text:
                self._kept.append(text)
                self._at += 1
        return text

    def peek(self) -> str:
        """The first chunk, read again by the first :meth:`read` (call it before any)."""
        if self._peeked is None:
            self._peeked = self._fresh(_CHUNK)
        return self._peeked

    def _fresh(self, size: int) -> str:
        while True:
            data = self._raw(max(size, 1))
            self.bytes += len(data)
            if self.bytes > MAX_STREAM_BYTES:
                raise InputError(f"larger than {size_text(MAX_STREAM_BYTES)}")
            text = self._decoder.decode(data, final=not data)
            if text or not data:
                return text

    def restart(self) -> bool:
        """Read from the start again; False (and nothing changes) once more than
        :data:`MAX_BYTES` was read."""
        if self._kept is None:
            return False
        self._at = 0
        return True

    def whole(self) -> str:
        """All the text from here, at most :data:`MAX_BYTES` read in all."""
        parts = []
        while part := self.read():
            parts.append(part)
            if self.bytes > MAX_BYTES:
                raise InputError(f"larger than {size_text(MAX_BYTES)}")
        return "".join(parts)


_HEAD = 4096  # the beginning a cut value must match within
_MAX_CUT = 4 * _CHUNK  # a value longer than this is read the exact way
_DECODER = json.JSONDecoder(parse_int=_json_int, parse_constant=_json_constant)
_WS = re.compile(r"[ \t\n\r]*")


class NotJSON(ValueError):
    """The text is not one JSON value (it may be YAML)."""


class _Chunks:
    """JSON values decoded one at a time from text read in chunks."""

    def __init__(self, read: Callable[[int], str]) -> None:
        self._read = read
        self.buf = ""
        self.pos = 0
        self.eof = False
        self.lines = 0  # newlines before buf

    def _more(self, at_least: int) -> bool:
        if self.eof:
            return False
        data = self._read(max(_CHUNK, at_least))
        if not data:
            self.eof = True
            return False
        self.lines += self.buf.count("\n", 0, self.pos)
        self.buf = self.buf[self.pos :] + data
        self.pos = 0
        return True

    def fail(self, problem: str, pos: int | None = None) -> NoReturn:
        at = self.pos if pos is None else pos
        raise NotJSON(
            f"invalid JSON at line {self.lines + self.buf.count(chr(10), 0, at) + 1}: {problem}"
        )

    def peek(self) -> str:
        """The next character after white space ("" at the end)."""
        while True:
            match = _WS.match(self.buf, self.pos)
            self.pos = match.end() if match else self.pos
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._more(0):
                return ""

    def punctuation(self, allowed: str) -> str:
        char = self.peek()
        if not char or char not in allowed:
            self.fail(f"expecting one of {' '.join(allowed)}")
        self.pos += 1
        return char

    def value(self) -> Any:
        self.peek()
        while True:
            try:
                value, end = _DECODER.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as exc:
                truncated = exc.msg.startswith("Unterminated") or exc.pos >= len(self.buf) - 64
                if not (truncated and self._more(len(self.buf) - self.pos)):
                    self.fail(exc.msg, exc.pos)
                if len(self.buf) - self.pos > MAX_BYTES:
                    raise InputError(f"a value larger than {size_text(MAX_BYTES)}") from None
                continue
            except RecursionError:
                raise InputError(TOO_DEEP) from None
            if end == len(self.buf) and isinstance(value, int | float) and self._more(0):
                continue  # a number may go on in the next chunk
            self.pos = end
            return value

    def cut(self, start: re.Pattern[str]) -> str | None:
        """The text of the next value, if it begins as ``start`` matches and ends where the
        next value beginning with the same text starts (``}`` ``,`` that text); else None,
        and nothing is consumed until :meth:`taken`. The cut may be wrong (that text inside
        the value): a reader that reads the whole text as one value tells it is not, since
        a JSON value's text ends at one place."""
        self.peek()
        while (begin := start.match(self.buf, self.pos)) is None:
            if len(self.buf) - self.pos > _HEAD or not self._more(0):
                return None
        prefix = begin.group()
        searched = begin.end() - self.pos  # from pos: the buffer moves as it grows
        while True:
            found = self.buf.find(prefix, self.pos + searched)
            if found >= 0:
                end = self._closing(found)
                return None if end is None else self.buf[self.pos : end + 1]
            searched = max(searched, len(self.buf) - self.pos - len(prefix))
            if len(self.buf) - self.pos > _MAX_CUT or not self._more(0):
                return None

    def _closing(self, found: int) -> int | None:
        """The position of the ``}`` before ``,`` and white space before ``found``."""
        at = found - 1
        while at > self.pos and self.buf[at] in " \t\n\r":
            at -= 1
        if self.buf[at] != ",":
            return None
        at -= 1
        while at > self.pos and self.buf[at] in " \t\n\r":
            at -= 1
        return at if self.buf[at] == "}" else None

    def taken(self, text: str) -> None:
        """The text :meth:`cut` returned was read as one value: go past it."""
        self.pos += len(text)


def _gated(value: Any, path: list[str | int], depth: int) -> Any:
    try:
        return _tree(value, depth)
    except _Bad as exc:
        raise InputError(f"document 1: {_path([*path, *exc.path])}: {exc.problem}") from None


@dataclass(frozen=True)
class Fast:
    """A faster reader of some members of a streamed ``items``: the text of a member that
    begins as ``start`` matches is cut out (:meth:`_Chunks.cut`) and given to ``read``,
    which returns what ``keep`` would return of the member as the exact reader builds it,
    or None wherever it cannot tell it reads the text as that reader does (a wrong cut,
    input near a bound): the member is then read the exact way."""

    start: re.Pattern[str]
    read: Callable[[str], Any]


def load_json_stream(
    read: Callable[[int], str], keep: Callable[[Any], Any], fast: Fast | None = None
) -> Any:
    """One JSON object read in chunks; the members of its ``items`` array one at a time.

    For ``kubectl get -o json`` output of any size (up to :data:`MAX_STREAM_BYTES`):
    each item goes through ``keep`` (which may return less of it) and then through the
    well-formed gate, so only what ``keep`` returns is held. Every other member is read
    whole and gated. The JSON bounds of :func:`load_documents` hold (64-bit integers, no
    NaN, nesting, each value at most :data:`MAX_BYTES`), but what ``keep`` drops is only
    parsed. With ``fast``, the members it reads are read so (the same values kept and the
    same errors, faster). Raises :class:`NotJSON` when the text is not one JSON object (read it as
    YAML then), :class:`InputError` (one line) for JSON beyond the bounds.
    """
    chunks = _Chunks(read)
    chunks.punctuation("{")
    document: dict[str, Any] = {}
    streamed: set[str] = set()
    if chunks.peek() == "}":
        chunks.pos += 1
    else:
        while True:
            if chunks.peek() != '"':
                chunks.fail("expecting a property name in double quotes")
            key = chunks.value()
            chunks.punctuation(":")
            if key == "items" and chunks.peek() == "[":
                chunks.pos += 1
                items: list[Any] = []
                if chunks.peek() == "]":
                    chunks.pos += 1
                else:
                    while True:
                        kept = None
                        if fast is not None and (text := chunks.cut(fast.start)) is not None:
                            kept = fast.read(text)
                            if kept is not None:
                                chunks.taken(text)
                        if kept is None:
                            kept = keep(chunks.value())
                        items.append(_gated(kept, ["items", len(items)], 2))
                        if chunks.punctuation(",]") == "]":
                            break
                document[key] = items
                streamed.add(key)
            else:
                document[key] = chunks.value()
                streamed.discard(key)
            if chunks.punctuation(",}") == "}":
                break
    if chunks.peek():
        chunks.fail("extra data")
    return {k: v if k in streamed else _gated(v, [k], 1) for k, v in document.items()}


def _document(value: Any, number: int) -> Any:
    try:
        return well_formed(value)
    except InputError as exc:
        raise InputError(f"document {number}: {exc}") from None


# ---------------------------------------------------------------- a big YAML List, streamed

ALL: Any = None  # in a Shape: the value whole
Shape = Any  # ALL, {key: Shape} (a mapping: those keys; else the value whole), [Shape] (each)
_MAX_HEAD = 1 << 20  # the text around a List's items (apiVersion, kind, metadata)
_ITEMS_START = re.compile(r"(?:\A|\n)items:\n")
_LINE_AT_COLUMN_0 = re.compile(r"\n[^ \n]")
_DOCUMENT_MARK = re.compile(r"^(?:---|\.\.\.|%)", re.M)
# Each item is parsed by rapidyaml; what it cannot hold as libyaml reads it goes the
# bounded way: anchors, aliases and tags (& * !), tabs, CR, and the characters the YAML
# reader refuses (PyYAML's Reader.NON_PRINTABLE).
_IRREGULAR = re.compile(
    "[&*!\t\r\ufeff\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x84\x86-\x9f\ud800-\udfff\ufffe\uffff]"
)
_PLAIN_ASCII = bytes(c for c in range(0x20, 0x7F) if chr(c) not in "&*!") + b"\n"
_PLAIN_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("null", "bool", "int", "float", "timestamp")}


class _Irregular(Exception):
    """An item the fast reader does not read as libyaml would: read it the bounded way."""


class _Layout(Exception):
    """The text is not one ``kind: List`` laid out as kubectl writes it."""


class _ListReader:
    """The items of a List, each parsed by rapidyaml (C++) and only the parts ``shape``
    names converted: each scalar resolved and constructed as the bounded loader does."""

    def __init__(self, shape: Callable[[Any], Shape]) -> None:
        import ryml  # type: ignore[import-untyped]  # the `plan` command alone needs it

        self._ryml = ryml
        self._shape = shape
        self._constructor = _BoundedLoader("")
        self._resolver = yaml.resolver.Resolver()
        self._plain: dict[str, Any] = {}  # plain scalar text -> its value (immutable)
        self._shapes: dict[int, tuple[Any, dict[bytes, tuple[str, Shape]]]] = {}
        self._stderr = os.dup(2)
        self._devnull = os.open(os.devnull, os.O_WRONLY)

    def close(self) -> None:
        os.close(self._stderr)
        os.close(self._devnull)

    def item(self, text: str) -> Any:
        data = text.encode("utf-8")
        if data.translate(None, _PLAIN_ASCII) and _IRREGULAR.search(text):
            raise _Irregular
        ryml = self._ryml
        os.dup2(self._devnull, 2)  # rapidyaml prints its errors on fd 2: libyaml words them
        try:
            tree = ryml.parse_in_arena(data)
        except Exception:
            raise _Irregular from None
        finally:
            os.dup2(self._stderr, 2)
        root = tree.root_id()
        if not tree.is_seq(root) or tree.num_children(root) != 1:
            raise _Irregular
        node = tree.first_child(root)
        try:
            if not tree.is_map(node):
                return self._value(tree, node, 2, ALL)
            kind = None
            child = tree.first_child(node)
            while child != ryml.NONE:
                key = tree.key(child)
                if key is not None and bytes(key) == b"kind" and not tree.is_container(child):
                    kind = self._scalar(tree, child)  # the last one, as in a mapping
                child = tree.next_sibling(child)
            return self._value(tree, node, 2, self._shape(kind))
        except (UnicodeDecodeError, yaml.YAMLError, InputError, _Bad):
            raise _Irregular from None

    def _key(self, tree: Any, node: Any) -> Any:
        key = tree.key(node)  # no anchors, aliases or tags: _IRREGULAR
        if key is None:
            raise _Irregular
        text = bytes(key).decode("utf-8")
        return text if tree.is_key_quoted(node) else self._resolved(text)

    def _scalar(self, tree: Any, node: Any) -> Any:
        value = tree.val(node)
        if tree.is_val_quoted(node):  # quoted or a block scalar: a string
            return "" if value is None else bytes(value).decode("utf-8")
        return self._resolved("" if value is None else bytes(value).decode("utf-8"))

    def _resolved(self, text: str) -> Any:
        """A plain scalar as SafeConstructor (with the bounds' scalars) makes it."""
        if text in self._plain:
            return self._plain[text]
        tag = self._resolver.resolve(yaml.ScalarNode, text, (True, False))  # type: ignore[no-untyped-call]
        if tag == _STR:
            value: Any = text
        elif tag in _PLAIN_TAGS:
            node = yaml.ScalarNode(tag, text)
            value = self._constructor.yaml_constructors[tag](self._constructor, node)
        else:  # a merge key (<<), =: the bounded loader's way
            raise _Irregular
        if len(self._plain) > 100_000:
            self._plain.clear()
        self._plain[text] = value
        return value

    def _value(self, tree: Any, node: Any, depth: int, shape: Shape) -> Any:
        if not tree.is_container(node):
            return self._scalar(tree, node)
        if depth >= MAX_DEPTH:
            raise _Irregular
        none = self._ryml.NONE
        child = tree.first_child(node)
        if tree.is_seq(node):
            inner = shape[0] if isinstance(shape, list) else ALL
            out_list = []
            while child != none:
                out_list.append(self._value(tree, child, depth + 1, inner))
                child = tree.next_sibling(child)
            return out_list
        out: dict[Any, Any] = {}
        if not isinstance(shape, dict):
            while child != none:
                out[self._key(tree, child)] = self._value(tree, child, depth + 1, ALL)
                child = tree.next_sibling(child)
            return out
        wanted = self._wanted(shape)
        while child != none:
            # The key as written (unescaped): only a wanted one is resolved and kept; a
            # merge key (<<) would add keys, so the bounded loader reads it.
            raw = tree.key(child)
            if raw is None:
                raise _Irregular
            raw = bytes(raw)
            if raw in wanted:
                key, inner = wanted[raw]
                if self._key(tree, child) == key:
                    out[key] = self._value(tree, child, depth + 1, inner)
            elif raw == b"<<":
                raise _Irregular
            child = tree.next_sibling(child)
        return out

    def _wanted(self, shape: dict[str, Shape]) -> dict[bytes, tuple[str, Shape]]:
        found = self._shapes.get(id(shape))
        if found is None or found[0] is not shape:
            found = (shape, {k.encode("utf-8"): (k, v) for k, v in shape.items()})
            self._shapes[id(shape)] = found
        return found[1]


def _split(text: Text) -> Iterator[tuple[str, str, int]]:
    """The parts of one ``kind: List`` as kubectl writes it: ``("head", text, 0)`` up to
    and with its ``items:`` line, ``("item", text, line)`` for each member (a line
    ``- ...`` at column 0 and the indented lines after it), ``("tail", text, line)``.

    Raises :class:`_Layout` for other text. A wrong cut (inside a quoted scalar or a flow
    collection) leaves a part that does not parse alone, so parts that each parse alone
    are the document's."""
    buf = text.read()
    while (start := _ITEMS_START.search(buf)) is None:
        if len(buf) > _MAX_HEAD or not (more := text.read()):
            raise _Layout
        buf += more
    pos = start.end()
    yield "head", buf[:pos], 0
    line = buf.count("\n", 0, pos)
    while True:
        while len(buf) - pos < 2 and (more := text.read()):
            buf += more
        if not buf.startswith(("- ", "-\n"), pos):
            break
        search = pos + 1
        while (end := _LINE_AT_COLUMN_0.search(buf, search)) is None:
            search = max(pos, len(buf) - 1)
            if len(buf) - pos > MAX_BYTES:
                raise InputError(f"a value larger than {size_text(MAX_BYTES)}")
            if not (more := text.read()):
                break
            buf = buf[pos:] + more
            search -= pos
            pos = 0
        cut = len(buf) if end is None else end.start() + 1
        item = buf[pos:cut]
        yield "item", item, line
        line += item.count("\n")
        pos = cut
    tail = buf[pos:]
    while more := text.read():
        tail += more
        if len(tail) > _MAX_HEAD:
            raise _Layout
    if _DOCUMENT_MARK.search(tail):  # another document: not one List
        raise _Layout
    yield "tail", tail, line


def load_yaml_stream(
    text: Text, keep: Callable[[Any], Any], shape: Callable[[Any], Shape]
) -> list[Any]:
    """The documents of a YAML stream of any size up to :data:`MAX_STREAM_BYTES`.

    One ``kind: List`` as kubectl writes it (``items:`` and its members ``- `` at column
    0) is read one member at a time: each parsed by rapidyaml, and of a member whose
    ``kind`` is K only the parts ``shape(K)`` names are converted and checked (the rest is
    only parsed), then kept through ``keep``. A member rapidyaml cannot read as libyaml
    does (anchors, aliases, tags, tabs, a parse error, a value beyond the bounds), and any
    other text, is read by :func:`load_documents` (the text whole, at most :data:`MAX_BYTES`);
    past that size, such a member is read alone by the bounded loader. The values and
    the errors are those of :func:`load_documents`.
    """
    reader = _ListReader(shape)
    try:
        return _read_list(text, keep, reader)
    finally:
        reader.close()


def _read_list(text: Text, keep: Callable[[Any], Any], reader: _ListReader) -> list[Any]:
    items: list[Any] = []
    head: Any = None
    rest: list[Any] = [None]
    alias_nodes = 0
    try:
        for part, chunk, line in _split(text):
            if part == "head":
                head = _alone(chunk)
                if not isinstance(head, dict) or list(head)[-1:] != ["items"] or head["items"]:
                    raise _Layout
            elif part == "tail":
                rest = _load(chunk) if chunk.strip() else [None]
            else:
                try:
                    value = reader.item(chunk)
                    items.append(_gated(keep(value), ["items", len(items)], 2))
                except (_Irregular, InputError):
                    if text.restart():
                        raise _Layout from None
                    value, alias_nodes = _bounded_item(chunk, line, alias_nodes)
                    items.append(_gated(keep(value), ["items", len(items)], 2))
    except (_Layout, InputError) as exc:
        if not text.restart():
            if isinstance(exc, InputError):
                raise
            raise InputError(
                f"larger than {size_text(MAX_BYTES)} and not one YAML List as kubectl "
                "writes it (items: and its members at column 0)"
            ) from None
        return load_documents(text.whole(), keep=keep)
    if len(rest) != 1 or not isinstance(rest[0], dict | None) or "items" in (rest[0] or {}):
        if text.restart():
            return load_documents(text.whole(), keep=keep)
        raise InputError(f"larger than {size_text(MAX_BYTES)} and not one YAML List")
    if items:
        head["items"] = items
    head.update(rest[0] or {})
    return [head]


def _alone(text: str) -> Any:
    documents = _load(text)
    if len(documents) != 1:
        raise _Layout
    return documents[0]


def _bounded_item(text: str, line: int, alias_nodes: int) -> tuple[Any, int]:
    """One member read alone by the bounded loader, its lines numbered as in the file, its
    aliases counted with those before it (a file's budget)."""
    loader = (_FastLoader or _BoundedLoader)("\n" * line + text)
    loader._alias_nodes = alias_nodes
    try:
        [value] = loader.get_single_data()
    except yaml.YAMLError as exc:
        raise _yaml_error(exc) from None
    except RecursionError:
        raise InputError(TOO_DEEP) from None
    finally:
        loader.dispose()
    return value, loader._alias_nodes
