"""Label selectors: one parser of each written form, one matcher.

Two forms are read: the string form of ``kubectl -l`` and of a list's ``labelSelector=``
(``k=v``, ``k==v``, ``k!=v``, ``k in (a,b)``, ``k notin (a,b)``, ``k`` and ``!k``, joined
by commas: :func:`parse_selector`) and ``metav1.LabelSelector`` (``matchLabels`` and
``matchExpressions`` with ``In``, ``NotIn``, ``Exists`` and ``DoesNotExist``:
:func:`label_selector`). Both validate as the API server does (label keys and values,
``In``/``NotIn`` with at least one value, ``Exists``/``DoesNotExist`` with none) and raise
:class:`SelectorError` naming the offending part. ``Selector.text`` is the string form
again (:attr:`Selector.canonical` parses back to the same requirements).

Matching is Kubernetes': every requirement must hold, so the empty selector selects
everything. A caller for which "empty" must select nothing (a Service without a
selector, an empty consumer selector) says so itself.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from shared_svc.k8s.labels import is_label_key, is_label_value

Operator = Literal["In", "NotIn", "Exists", "DoesNotExist"]
OPERATORS: tuple[Operator, ...] = get_args(Operator)


class SelectorError(ValueError):
    """A label selector that does not parse or is not valid."""


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: Operator
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "Exists":
            return self.key in labels
        if self.operator == "DoesNotExist":
            return self.key not in labels
        if self.operator == "In":
            return self.key in labels and labels[self.key] in self.values
        return self.key not in labels or labels[self.key] not in self.values

    @property
    def text(self) -> str:
        """The string form: ``k=v``, ``k in (a,b)``, ``k!=v``, ``k notin (a,b)``, ``k``, ``!k``."""
        values = sorted(self.values)
        if self.operator == "Exists":
            return self.key
        if self.operator == "DoesNotExist":
            return f"!{self.key}"
        if len(values) == 1:
            return f"{self.key}{'=' if self.operator == 'In' else '!='}{values[0]}"
        word = "in" if self.operator == "In" else "notin"
        return f"{self.key} {word} ({','.join(values)})"


@dataclass(frozen=True)
class Selector:
    """An AND of requirements. ``text``: as written, else :attr:`canonical` (not compared)."""

    requirements: tuple[Requirement, ...] = ()
    text: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.text:
            object.__setattr__(self, "text", self.canonical)

    @property
    def canonical(self) -> str:
        """The string form of a list's ``labelSelector=``; parses back to these requirements."""
        return ",".join(r.text for r in self.requirements)

    @property
    def empty(self) -> bool:
        return not self.requirements

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Every requirement holds (the empty selector selects everything, as in Kubernetes)."""
        return all(r.matches(labels) for r in self.requirements)


def selector_from_set(labels: Mapping[str, str]) -> Selector:
    """``k=v`` for each label, sorted by key (``labels.SelectorFromSet``; not validated)."""
    return Selector(tuple(Requirement(k, "In", frozenset({v})) for k, v in sorted(labels.items())))


# --- the string form ---


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
                raise SelectorError(f"unbalanced ')' in selector {text!r}")
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth:
        raise SelectorError(f"unbalanced '(' in selector {text!r}")
    parts.append("".join(current))
    return parts


def _key(key: Any, where: str) -> str:
    if not isinstance(key, str) or not is_label_key(key):
        raise SelectorError(f"invalid label key {key!r} in {where}")
    return key


def _value(value: Any, where: str) -> str:
    if not isinstance(value, str) or not is_label_value(value):
        raise SelectorError(f"invalid label value {value!r} in {where}")
    return value


_SET = re.compile(r"(?P<key>\S+)\s+(?P<op>in|notin)\s*\((?P<values>[^()]*)\)")


def _requirement(part: str, where: str) -> Requirement:
    part = part.strip()
    if not part:
        raise SelectorError(f"empty requirement in {where}")
    set_match = _SET.fullmatch(part)
    if set_match:
        listed = set_match["values"]
        if not listed.strip():
            raise SelectorError(f"'{set_match['op']}' needs at least one value in {where}")
        values = frozenset(_value(v.strip(), where) for v in listed.split(","))
        op: Operator = "In" if set_match["op"] == "in" else "NotIn"
        return Requirement(_key(set_match["key"], where), op, values)
    for token, equality_op in (("!=", "NotIn"), ("==", "In"), ("=", "In")):
        if token in part:
            key, value = part.split(token, 1)
            operator: Operator = "NotIn" if equality_op == "NotIn" else "In"
            return Requirement(
                _key(key.strip(), where), operator, frozenset({_value(value.strip(), where)})
            )
    if part.startswith("!"):
        return Requirement(_key(part[1:].strip(), where), "DoesNotExist")
    return Requirement(_key(part, where), "Exists")


def parse_selector(text: str) -> Selector:
    """The string form; raises :class:`SelectorError` naming the offending part.

    An empty (or blank) text is the empty selector."""
    if not text.strip():
        return Selector((), text)
    where = f"selector {text!r}"
    return Selector(tuple(_requirement(p, where) for p in _split_top_level(text)), text)


# --- metav1.LabelSelector ---


def label_selector(value: Any) -> Selector:
    """A ``metav1.LabelSelector`` (a dict); raises :class:`SelectorError` when it is not a
    valid one (as ``LabelSelectorAsSelector`` does)."""
    if not isinstance(value, dict):
        raise SelectorError(f"a label selector must be an object, not {type(value).__name__}")
    requirements: list[Requirement] = []
    match_labels = value.get("matchLabels")
    if match_labels is not None:
        if not isinstance(match_labels, dict):
            raise SelectorError("matchLabels must be an object")
        for k, v in match_labels.items():
            key = _key(k, "matchLabels")
            requirements.append(
                Requirement(key, "In", frozenset({_value(v, f"matchLabels[{key}]")}))
            )
        requirements.sort(key=lambda r: r.key)
    expressions = value.get("matchExpressions")
    if expressions is not None:
        if not isinstance(expressions, list):
            raise SelectorError("matchExpressions must be a list")
        for i, expr in enumerate(expressions):
            requirements.append(_expression(expr, f"matchExpressions[{i}]"))
    return Selector(tuple(requirements))


def _expression(expr: Any, where: str) -> Requirement:
    if not isinstance(expr, dict):
        raise SelectorError(f"{where} must be an object")
    key = _key(expr.get("key"), where)
    op = expr.get("operator")
    if op not in OPERATORS:
        raise SelectorError(f"{where}: operator {op!r} is not one of {', '.join(OPERATORS)}")
    values = expr.get("values")
    values = [] if values is None else values
    if not isinstance(values, list):
        raise SelectorError(f"{where}: values must be a list")
    if op in ("In", "NotIn") and not values:
        raise SelectorError(f"{where}: operator {op} needs at least one value")
    if op in ("Exists", "DoesNotExist") and values:
        raise SelectorError(f"{where}: operator {op} takes no values")
    operator: Operator = op
    return Requirement(key, operator, frozenset(_value(v, where) for v in values))
