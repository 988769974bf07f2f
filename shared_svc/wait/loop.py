"""The one loop of every long-running part (apimachinery's ``wait.Until``, cut to what
shared-svc needs): below both ``kube/`` (the caches' list-and-watch, the Lease) and
``runtime/`` (``Periodic``), so neither layer writes a ``while not stop`` loop of its own."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


async def repeat(
    stop: asyncio.Event,
    step: Callable[[], Any],
    seconds: Callable[[], float],
    *,
    name: str,
    wake: asyncio.Event | None = None,
    at_once: bool = True,
) -> None:
    """The one loop of every long-running part: calls ``step`` (at once, or first after a
    wait) and then again every ``seconds()``, or as soon as ``wake`` is set, until
    ``stop``. A failure of ``step`` is logged, not fatal: the next call comes on time."""
    if not at_once and not await _wait(stop, wake, seconds()):
        return
    while not stop.is_set():
        try:
            result = step()
            if asyncio.iscoroutine(result):
                await result
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("periodic task failed", extra={"task": name})
        if not await _wait(stop, wake, seconds()):
            return


async def _wait(stop: asyncio.Event, wake: asyncio.Event | None, seconds: float) -> bool:
    """Waits ``seconds`` or until ``wake`` (cleared) or ``stop``; False once stopped."""
    waiters = [asyncio.ensure_future(stop.wait())]
    if wake is not None:
        waiters.append(asyncio.ensure_future(wake.wait()))
    try:
        await asyncio.wait(waiters, timeout=max(0.0, seconds), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
    if wake is not None:
        wake.clear()
    return not stop.is_set()
