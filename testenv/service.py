"""shared-svc's service in the caller's event loop, for the demos and the tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from shared_svc.config import Config
from shared_svc.service import Service


@contextlib.asynccontextmanager
async def running(config: Config, *, timeout: float = 30.0) -> AsyncIterator[Service]:
    """Runs the service in this event loop until the block ends (then a graceful stop).

    Raises what stopped the service if it ends before it has started, and
    :class:`TimeoutError` if it has not started within ``timeout`` seconds. The caller's
    heap is not frozen (``Service``'s ``freeze_heap``: ``shared-svc run`` freezes its own)."""
    service = Service(config, freeze_heap=False)
    stop = asyncio.Event()
    task = asyncio.ensure_future(service.run(stop))
    started = asyncio.ensure_future(service.started.wait())
    done, _ = await asyncio.wait(
        {task, started}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
    )
    if task in done:
        started.cancel()
        task.result()  # raises what stopped it
    if started not in done:
        started.cancel()
        stop.set()
        await asyncio.gather(task, return_exceptions=True)
        raise TimeoutError(f"the service did not start within {timeout:.0f}s")
    try:
        yield service
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=60)
