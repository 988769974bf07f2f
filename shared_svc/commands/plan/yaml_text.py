"""YAML and JSON text read whole (``shared-svc plan -f``, at most ``manifests.MAX_BYTES``):
bounded in nesting and in YAML alias expansion, each document through the gate
(``manifests.well_formed``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable
from typing import Any, NoReturn

import yaml

import shared_svc.commands.plan.manifests as manifests  # its MAX_BYTES, read at each use
from shared_svc.commands.plan.manifests import (
    _INT_TEXT,
    MAX_ALIAS_NODES,
    InputError,
    _Bad,
    _document,
    _json_constant,
    _json_int,
    _Streamed,
    _tree,
    size_text,
)
from shared_svc.k8s.limits import MAX_DEPTH, TOO_DEEP


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
    if len(text.encode("utf-8", "surrogatepass")) > manifests.MAX_BYTES:
        raise InputError(f"larger than {size_text(manifests.MAX_BYTES)}")
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
        loader = bounded_loader(text)
    elif _NoAliasLoader is not None and "&" not in text and "*" not in text:
        loader = _NoAliasLoader(text)
    else:
        loader = bounded_loader(text)
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


def bounded_loader(text: str) -> Any:
    """The bounded loader over ``text``: on libyaml when there is one, else PyYAML alone."""
    return (_FastLoader or _BoundedLoader)(text)


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
