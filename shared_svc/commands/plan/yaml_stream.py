"""A big YAML List (``kubectl get -o yaml``), read item by item: each item parsed on its
own (the bounded way where it must), what the caller keeps of each kept; any other
YAML text is read whole (``yaml_text.load_documents``)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import yaml

import shared_svc.commands.plan.manifests as manifests  # its MAX_BYTES, read at each use
from shared_svc.commands.plan.json_stream import Text, _gated
from shared_svc.commands.plan.manifests import InputError, _Bad, size_text
from shared_svc.commands.plan.yaml_text import (
    _STR,
    _BoundedLoader,
    _load,
    _yaml_error,
    bounded_loader,
    load_documents,
)
from shared_svc.k8s.limits import MAX_DEPTH, TOO_DEEP

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
            if len(buf) - pos > manifests.MAX_BYTES:
                raise InputError(f"a value larger than {size_text(manifests.MAX_BYTES)}")
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
                f"larger than {size_text(manifests.MAX_BYTES)} and not one YAML List as kubectl "
                "writes it (items: and its members at column 0)"
            ) from None
        return load_documents(text.whole(), keep=keep)
    if len(rest) != 1 or not isinstance(rest[0], dict | None) or "items" in (rest[0] or {}):
        if text.restart():
            return load_documents(text.whole(), keep=keep)
        raise InputError(f"larger than {size_text(manifests.MAX_BYTES)} and not one YAML List")
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
    loader = bounded_loader("\n" * line + text)
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
