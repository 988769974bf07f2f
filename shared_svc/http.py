"""The aiohttp app: /livez /healthz /readyz /status /metrics (documented in docs/operations.md)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def make_app(
    *,
    alive: Callable[[], bool],
    ready: Callable[[], bool],
    status: Callable[[], dict[str, Any]],
    registry: CollectorRegistry,
) -> web.Application:
    async def livez(_: web.Request) -> web.Response:
        ok = alive()
        return web.Response(
            text="ok\n" if ok else "reconcile loop stalled\n", status=200 if ok else 500
        )

    async def readyz(_: web.Request) -> web.Response:
        ok = ready()
        return web.Response(text="ok\n" if ok else "caches not synced\n", status=200 if ok else 503)

    async def status_view(_: web.Request) -> web.Response:
        return web.Response(
            text=json.dumps(status(), indent=2, default=str) + "\n", content_type="application/json"
        )

    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/livez", livez)
    app.router.add_get("/healthz", livez)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/status", status_view)
    app.router.add_get("/metrics", metrics)
    return app
