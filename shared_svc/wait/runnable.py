"""The :class:`Runnable` protocol: a long-running part of the process, run until its stop
event, and its default answers.

It sits here, below ``kube/`` and ``runtime/``, because parts of both layers are
Runnables of the one ``runtime.Manager`` (the Lease and the caches in ``kube/``, the HTTP
server, the controllers, ``runtime.Periodic``): as controller-runtime's ``Runnable`` is
only ``Start(ctx)``, anything with these members is one. A part that subclasses the
protocol inherits its defaults (not leader-gated, ready, alive, no status, deaf to
leadership) and says only what differs; ``run`` it always says.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol


class Runnable(Protocol):
    """``name`` (``Manager.stopped``, logs); ``needs_leader``: runs only while this
    replica leads (the Manager starts and stops it); ``run(stop)``: until ``stop`` is
    set; ``ready()``: caches synced (``/readyz``); ``alive()``: not wedged (``/livez``);
    ``status()``: for ``/status``; ``leadership_changed(leader)``: told of each change."""

    name: str
    needs_leader: bool = False

    async def run(self, stop: asyncio.Event) -> None: ...

    def ready(self) -> bool:
        return True

    def alive(self) -> bool:
        return True

    def status(self) -> dict[str, Any]:
        return {}

    def leadership_changed(self, leader: bool) -> None:
        return None
