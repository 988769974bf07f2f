"""The soak's reads of the API server (synchronous: the runner's thread)."""

from __future__ import annotations

from typing import Any

from testenv import ControlPlane


class Unanswered(Exception):
    """The API server did not answer a read of the soak's (restarting, 429, 5xx): the
    world is not settled yet, which the runner's bounded wait judges."""


def answer(
    cp: ControlPlane, method: str, path: str, body: Any = None, **kw: Any
) -> tuple[int, Any]:
    try:
        status, out = cp.request(method, path, body, **kw)
    except OSError as exc:
        raise Unanswered(f"{method} {path}: {exc}") from exc
    if status == 429 or status >= 500:
        raise Unanswered(f"{method} {path}: {status} {out}")
    return status, out


def items(cp: ControlPlane, path: str) -> list[dict[str, Any]]:
    """The items of a list at ``path`` (raises :class:`Unanswered`, or on any other error)."""
    status, body = answer(cp, "GET", path)
    if status != 200:
        raise AssertionError(f"GET {path}: {status} {body}")
    found: list[dict[str, Any]] = body["items"]
    return found
