"""A big JSON List (``kubectl get -o json``, at most ``MAX_STREAM_BYTES``), read item by
item: each value through the gate (``manifests``), what the caller keeps of each item
kept."""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import shared_svc.commands.plan.manifests as manifests  # its MAX_BYTES, read at each use
from shared_svc.commands.plan.manifests import (
    InputError,
    _Bad,
    _json_constant,
    _json_int,
    _path,
    _tree,
    size_text,
)
from shared_svc.k8s.limits import TOO_DEEP

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
            if self.bytes > manifests.MAX_BYTES:
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
            if self.bytes > manifests.MAX_BYTES:
                raise InputError(f"larger than {size_text(manifests.MAX_BYTES)}")
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
                if len(self.buf) - self.pos > manifests.MAX_BYTES:
                    raise InputError(
                        f"a value larger than {size_text(manifests.MAX_BYTES)}"
                    ) from None
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
