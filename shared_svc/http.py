"""The aiohttp app: /livez /healthz /readyz /status /metrics (documented in docs/operations.md).

:func:`make_runner` serves it with two changes to aiohttp's defaults: a request aiohttp
cannot parse is a client's mistake, logged as one INFO line (aiohttp logs each one at
ERROR with a traceback), and a connection that has not sent a complete request within
:data:`CLIENT_TIMEOUT` seconds of opening (or of its last response) is closed (aiohttp
waits an hour).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, MutableMapping
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from shared_svc.wait.runnable import Runnable


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
        return web.Response(
            text="ok\n" if ok else "not ready: caches not synced or not planned yet\n",
            status=200 if ok else 503,
        )

    async def status_view(_: web.Request) -> web.Response:
        # msgspec, not json.dumps(indent=2) (pure Python with an indent: 60 ms of the event
        # loop for 500 upgrading nodes); a value of another type is written as its str.
        body = msgspec.json.format(msgspec.json.encode(status(), enc_hook=str), indent=2)
        return web.Response(body=body + b"\n", content_type="application/json")

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


# Probes and scrapes send their request at once; a client that has not completed one by
# then (headers never finished: slowloris) or an idle keep-alive connection is closed.
CLIENT_TIMEOUT = 10.0

log = logging.getLogger(__name__)


class _ServerLog(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's server logger, minus the ERROR and traceback for each malformed request.

    aiohttp reports a request it cannot parse through ``logger.exception`` with the
    parse error as ``exc_info``. That is the client's mistake, not ours: one INFO line
    (DEBUG where aiohttp itself chose DEBUG), no traceback. Errors in our handlers keep
    their ERROR and traceback.
    """

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info")
        if isinstance(exc, HttpProcessingError):
            if not self.isEnabledFor(min(level, logging.INFO)):
                return
            self.logger.log(
                min(level, logging.INFO),
                "bad HTTP request from %s: %s",
                args[0] if args else None,
                _one_line(exc),
                extra={"status": exc.code},
            )
            return
        super().log(level, msg, *args, **kwargs)

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        return msg, kwargs


def _one_line(exc: HttpProcessingError) -> str:
    """aiohttp's message without its multi-line caret drawing, at most 200 characters."""
    parts = [p.strip() for p in str(exc.message or "").splitlines()]
    text = " ".join(p for p in parts if p and set(p) != {"^"}) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def bound_port(runner: web.BaseRunner) -> int:
    """The TCP port ``runner``'s started site listens on (the one the OS picked for port 0),
    read from aiohttp's public ``BaseRunner.addresses``."""
    for address in runner.addresses:
        if isinstance(address, tuple):  # (host, port) or (host, port, flowinfo, scope_id)
            return int(address[1])
    raise RuntimeError("the runner listens on no TCP port")


def make_runner(app: web.Application, *, client_timeout: float = CLIENT_TIMEOUT) -> web.AppRunner:
    """The runner that serves ``app`` (no access log; see the module docstring)."""
    return web.AppRunner(
        app,
        access_log=None,
        logger=_ServerLog(logging.getLogger("aiohttp.server")),
        keepalive_timeout=client_timeout,
    )


class HttpServer(Runnable):
    """A Runnable that serves ``app`` on ``host:port`` (``make_runner``'s settings) until
    stopped; ``started`` is set once it listens, ``port`` is the port it listens on (the
    one the OS picked for port 0). The protocol's defaults answer the rest."""

    def __init__(
        self,
        name: str,
        app: web.Application,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.name = name
        self._app = app
        self._host = host
        self._port = port
        self._ssl = ssl_context
        self.started = asyncio.Event()
        self.port: int | None = None

    async def run(self, stop: asyncio.Event) -> None:
        runner = make_runner(self._app)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self._host, self._port, ssl_context=self._ssl)
            await site.start()
            self.port = bound_port(runner)
            log.debug("listening", extra={"server": self.name, "port": self.port})
            self.started.set()
            await stop.wait()
        finally:
            await runner.cleanup()
            self.port = None
