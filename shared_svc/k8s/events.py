"""What an Event says (``events.k8s.io/v1``), as plain data, and the API's size limits.

The cores return :class:`Report` s; the shell (``kube.recorder``) writes them. A note is at
most :data:`NOTE_LIMIT` bytes: :func:`note` cuts longer ones at a character boundary.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Literal

NOTE_LIMIT = 1024
"""The API server's limit on ``note``, in bytes of UTF-8."""
FIELD_LIMIT = 128
"""The API server's limit on ``reason``, ``action`` and ``reportingInstance``, in bytes."""


def truncate_bytes(text: str, limit: int, marker: str = "...") -> str:
    """``text`` if its UTF-8 fits in ``limit`` bytes; else its longest prefix that fits with
    ``marker`` after it, cut between characters (never inside one)."""
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return data.decode("utf-8")
    tail = marker.encode()
    cut = max(limit - len(tail), 0)
    while cut > 0 and data[cut] & 0xC0 == 0x80:  # a continuation byte: inside a character
        cut -= 1
    return data[:cut].decode("utf-8") + (marker if len(tail) <= limit else "")


def note(text: str) -> str:
    """An Event note within :data:`NOTE_LIMIT` bytes."""
    return truncate_bytes(text, NOTE_LIMIT)


@dataclass(frozen=True)
class ObjectRef:
    """Names an object for reports and Events (``regarding``)."""

    api_version: str
    kind: str
    name: str
    namespace: str | None = None
    uid: str | None = None

    def __post_init__(self) -> None:
        # The API server keeps an Event whose ``regarding`` has no name, and drops the
        # empty name: an Event about nothing a user can find. Every object has a name.
        if not self.name:
            raise ValueError(f"an Event must regard a named object, not {self.kind} {self!r}")

    def as_event_ref(self) -> dict[str, str]:
        ref = {"apiVersion": self.api_version, "kind": self.kind, "name": self.name}
        if self.namespace:
            ref["namespace"] = self.namespace
        if self.uid:
            ref["uid"] = self.uid
        return ref


@dataclass(frozen=True)
class Report:
    """An Event the shell should emit (deduplicated by ``key`` into a series)."""

    type: Literal["Normal", "Warning"]
    reason: str
    action: str  # events.k8s.io/v1 ``action``, e.g. "Reconcile", "Create", "Adopt", "Delete"
    regarding: ObjectRef
    note: str
    key: str  # stable identity of the occurrence; same key => same Event series
    # Set on Normal reports that announce a write: (kind, name) of that action. The shell
    # emits them only after that write succeeded.
    after_write: tuple[str, str] | None = None


def unsent(sent: AbstractSet[str], reports: Iterable[Report]) -> tuple[Report, ...]:
    """The reports whose key is not sent already (the first of each key)."""
    seen = set(sent)
    out = []
    for report in reports:
        if report.key not in seen:
            seen.add(report.key)
            out.append(report)
    return tuple(out)


def still_sent(
    sent: AbstractSet[str], reports: Iterable[Report], written: AbstractSet[str]
) -> frozenset[str]:
    """The keys sent after this round of a level-triggered scope: those of ``reports``
    (what is true now) already sent, or written now. A report whose Event could not be
    written stays out (sent again next time); one no longer true drops out (sent again
    when it comes back, as a series)."""
    return frozenset(r.key for r in reports if r.key in sent or r.key in written)
