"""Kubernetes label selectors (the string form), parsed once and matched purely.

Supports the grammar of ``kubectl -l``: ``k=v``, ``k==v``, ``k!=v``, ``k in (a,b)``,
``k notin (a,b)``, ``k`` (exists) and ``!k`` (does not exist), joined by commas.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Operator = Literal["in", "notin", "exists", "!exists"]

_KEY = r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?"
_VALUE = r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_KEY_RE = re.compile(rf"^{_KEY}$")
_VALUE_RE = re.compile(rf"^{_VALUE}$")


class SelectorError(ValueError):
    """A label selector that does not parse."""


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: Operator
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "exists":
            return self.key in labels
        if self.operator == "!exists":
            return self.key not in labels
        if self.operator == "in":
            return self.key in labels and labels[self.key] in self.values
        return self.key not in labels or labels[self.key] not in self.values


@dataclass(frozen=True)
class Selector:
    """An AND of requirements; the empty selector matches nothing here (never everything).

    An empty declared-consumer selector must not declare every pod on the node.
    """

    requirements: tuple[Requirement, ...]
    text: str

    def matches(self, labels: Mapping[str, str]) -> bool:
        return bool(self.requirements) and all(r.matches(labels) for r in self.requirements)


def _split_top_level(text: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth < 0:
                raise SelectorError(f"unbalanced ')' in {text!r}")
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth:
        raise SelectorError(f"unbalanced '(' in {text!r}")
    parts.append("".join(current))
    return parts


def _check_key(key: str, text: str) -> str:
    if not _KEY_RE.match(key) or len(key.rsplit("/", 1)[-1]) > 63:
        raise SelectorError(f"invalid label key {key!r} in selector {text!r}")
    return key


def _check_value(value: str, text: str) -> str:
    if not _VALUE_RE.match(value) or len(value) > 63:
        raise SelectorError(f"invalid label value {value!r} in selector {text!r}")
    return value


_SET_RE = re.compile(r"^(?P<key>\S+)\s+(?P<op>in|notin)\s*\((?P<values>[^()]*)\)$")


def _requirement(part: str, text: str) -> Requirement:
    part = part.strip()
    if not part:
        raise SelectorError(f"empty requirement in selector {text!r}")
    set_match = _SET_RE.match(part)
    if set_match:
        values = frozenset(_check_value(v.strip(), text) for v in set_match["values"].split(","))
        op: Operator = "in" if set_match["op"] == "in" else "notin"
        return Requirement(_check_key(set_match["key"], text), op, values)
    for token, equality_op in (("!=", "notin"), ("==", "in"), ("=", "in")):
        if token in part:
            key, value = part.split(token, 1)
            operator: Operator = "notin" if equality_op == "notin" else "in"
            return Requirement(
                _check_key(key.strip(), text),
                operator,
                frozenset({_check_value(value.strip(), text)}),
            )
    if part.startswith("!"):
        return Requirement(_check_key(part[1:].strip(), text), "!exists")
    return Requirement(_check_key(part, text), "exists")


def parse_selector(text: str) -> Selector:
    """Parse ``text``; raises ``SelectorError`` with the offending part."""
    if not text.strip():
        return Selector((), text)
    return Selector(tuple(_requirement(p, text) for p in _split_top_level(text)), text)
