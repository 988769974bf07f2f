"""Proxies on 127.0.0.1 between the service and the test API server, to make faults.

- :class:`TcpProxy` forwards bytes. ``freeze()`` stops forwarding on every connection
  (open and new) while keeping them open: a leader whose network froze (or a webhook server
  that stopped answering: ``start_to``); ``drop()`` closes the connections open now. ``blackhole()``
  silences the connections open now and forever, while new ones work: a watch on a
  connection that died without a FIN (or a server that stopped delivering).
- :class:`ThrottlingProxy` terminates TLS with the API server's own certificate and
  forwards each HTTP request; while ``throttle_watches`` is set it answers every watch
  request ``429 Too Many Requests`` with ``Retry-After``, as a loaded API server does;
  it records every request's method and path (``requests``), and the encodings asked
  for and answered (``encodings``); ``fail_once(method, suffix)``
  answers the next such request ``500 Internal Server Error`` (a transient server fault);
  it records every ``Warning`` header the API server answers with (``warnings``), and
  ``add_warning`` adds one to every answer (a server that warns about everything asked);
  ``before`` is awaited before each request goes on (another party acting in between).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import yaml
from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

from testenv import ControlPlane


def kubeconfig_via(cp: ControlPlane, url: str, path: Path) -> Path:
    """The admin kubeconfig, pointed at ``url`` (the API server's certificate names 127.0.0.1)."""
    config = yaml.safe_load(cp.kubeconfig.read_text())
    config["clusters"][0]["cluster"]["server"] = url
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


class _Pipe:
    """One proxied connection: two pumps, each of which can be held or silenced."""

    def __init__(self, proxy: TcpProxy) -> None:
        self.proxy = proxy
        self.silenced = False
        self.tasks: list[asyncio.Task[None]] = []
        self.writers: list[asyncio.StreamWriter] = []

    async def pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                while self.proxy.frozen.is_set() or self.silenced:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)  # hold the bytes: nothing passes, nothing closes
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()


class TcpProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.frozen = asyncio.Event()
        self.pipes: list[_Pipe] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    @classmethod
    async def start(cls, cp: ControlPlane) -> TcpProxy:
        proxy = cls(_port(cp.url))
        proxy.server = await asyncio.start_server(proxy._serve, "127.0.0.1", 0)
        proxy.port = proxy.server.sockets[0].getsockname()[1]
        return proxy

    @classmethod
    async def start_to(cls, port: int) -> TcpProxy:
        """A proxy to another server on 127.0.0.1 (a webhook server: ``freeze`` is a pod
        that stops answering)."""
        proxy = cls(port)
        proxy.server = await asyncio.start_server(proxy._serve, "127.0.0.1", 0)
        proxy.port = proxy.server.sockets[0].getsockname()[1]
        return proxy

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pipe = _Pipe(self)
        self.pipes.append(pipe)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        pipe.writers = [writer, up_writer]
        pipe.tasks = [
            asyncio.ensure_future(pipe.pump(reader, up_writer)),
            asyncio.ensure_future(pipe.pump(up_reader, writer)),
        ]
        await asyncio.gather(*pipe.tasks, return_exceptions=True)

    def freeze(self) -> None:
        self.frozen.set()

    def thaw(self) -> None:
        self.frozen.clear()

    def blackhole(self) -> int:
        """Silences every connection open now (they stay open); returns how many."""
        for pipe in self.pipes:
            pipe.silenced = True
        return len(self.pipes)

    def drop(self) -> int:
        """Closes every connection open now (new ones work): what a client sees when the
        server it kept a connection to goes away. Returns how many."""
        for pipe in self.pipes:
            for w in pipe.writers:
                with contextlib.suppress(Exception):
                    w.close()
        return len(self.pipes)

    async def close(self) -> None:
        if self.server:
            self.server.close()
        for pipe in self.pipes:
            for w in pipe.writers:
                with contextlib.suppress(Exception):
                    w.close()
            for t in pipe.tasks:
                t.cancel()
        for pipe in self.pipes:
            await asyncio.gather(*pipe.tasks, return_exceptions=True)


_HOP = {"transfer-encoding", "content-length", "connection", "keep-alive", "content-encoding"}


class ThrottlingProxy:
    """An HTTPS reverse proxy to the API server that can answer watches with 429."""

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self.throttle_watches = False
        self._enders: set[asyncio.Event] = set()
        self.retry_after = 1
        self.throttled = 0  # 429s answered
        self.watches = 0  # watch requests passed through
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request seen
        # (path, the request's Accept-Encoding, the API server's Content-Encoding) of each
        # request passed through
        self.encodings: list[tuple[str, str, str]] = []
        # (method, path suffix, status) to answer once with that status (500 or 429)
        self._faults: list[tuple[str, str, int]] = []
        self.faulted: list[tuple[str, str]] = []  # (method, path) of the requests so answered
        # (method, path, value) of every Warning header the API server answered with
        self.warnings: list[tuple[str, str, str]] = []
        self.add_warning: str | None = None  # a Warning header value added to every answer
        # awaited with (method, path) before each request is forwarded: a party that acts
        # between a client's two requests
        self.before: Callable[[str, str], Awaitable[None]] | None = None
        self._runner: web.AppRunner | None = None
        self._session: ClientSession | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @classmethod
    async def start(cls, cp: ControlPlane) -> ThrottlingProxy:
        proxy = cls(cp)
        certs = cp.workdir / "certs"
        server_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ssl.load_cert_chain(certs / "apiserver.crt", certs / "apiserver.key")
        upstream_ssl = ssl.create_default_context(cafile=str(certs / "apiserver.crt"))
        proxy._session = ClientSession(
            connector=TCPConnector(ssl=upstream_ssl), timeout=ClientTimeout(total=None)
        )
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", proxy._handle)
        proxy._runner = web.AppRunner(app, access_log=None)
        await proxy._runner.setup()
        site = web.TCPSite(proxy._runner, "127.0.0.1", 0, ssl_context=server_ssl)
        await site.start()
        server: Any = site._server
        proxy.port = server.sockets[0].getsockname()[1]
        return proxy

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.method, request.rel_url.path))
        if self.before is not None:
            await self.before(request.method, request.rel_url.path)
        for fault in self._faults:
            if request.method == fault[0] and request.rel_url.path.endswith(fault[1]):
                self._faults.remove(fault)
                self.faulted.append((request.method, request.rel_url.path))
                return self._refusal(fault[2])
        if request.query.get("watch") in ("true", "1"):
            if self.throttle_watches:
                self.throttled += 1
                return self._refusal(429)
            self.watches += 1
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host",)}
        async with self._session.request(
            request.method,
            self.cp.url + request.rel_url.raw_path_qs,
            headers=headers,
            data=await request.read() if request.can_read_body else None,
        ) as upstream:
            self.encodings.append(
                (
                    request.rel_url.path,
                    request.headers.get("Accept-Encoding", ""),
                    upstream.headers.get("Content-Encoding", ""),
                )
            )
            for value in upstream.headers.getall("Warning", ()):
                self.warnings.append((request.method, request.rel_url.path, value))
            resp = web.StreamResponse(status=upstream.status)
            for k, v in upstream.headers.items():  # every one: a header may come twice
                if k.lower() not in _HOP:
                    resp.headers.add(k, v)
            if self.add_warning is not None:
                resp.headers.add("Warning", self.add_warning)
            await resp.prepare(request)
            ender = asyncio.Event()
            self._enders.add(ender)
            try:
                while True:
                    read = asyncio.ensure_future(upstream.content.readany())
                    end = asyncio.ensure_future(ender.wait())
                    await asyncio.wait({read, end}, return_when=asyncio.FIRST_COMPLETED)
                    end.cancel()
                    if not read.done():
                        read.cancel()
                        break
                    chunk = read.result()
                    if not chunk:
                        break
                    await resp.write(chunk)
            finally:
                self._enders.discard(ender)
            await resp.write_eof()
            return resp

    def _refusal(self, code: int) -> web.Response:
        """A Status as the API server sends it: 500, or 429 with ``Retry-After`` (its own
        throttling: no cause, unlike a PodDisruptionBudget's refusal of an eviction)."""
        if code == 429:
            message, reason = "too many requests, please try again later", "TooManyRequests"
            headers = {"Retry-After": str(self.retry_after)}
        else:
            message = (
                'an error on the server ("test fault") has prevented the request from succeeding'
            )
            reason, headers = "InternalError", {}
        body = {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code,
        }
        return web.json_response(body, status=code, headers=headers)

    def fail_once(self, method: str, path_suffix: str, *, status: int = 500) -> None:
        """The next ``method`` request whose path ends with ``path_suffix`` gets a 500
        (``status`` 429: the API server's own throttling, as API Priority and Fairness
        answers, with ``Retry-After`` and no cause)."""
        self._faults.append((method, path_suffix, status))

    def throttle(self) -> None:
        """From now on every watch request gets 429; the open watches end (cleanly, as at
        their timeout), so every client has to open a new one."""
        self.throttle_watches = True
        for ender in self._enders:
            ender.set()

    async def close(self) -> None:
        # The streams still open (watches) end first: the runner's cleanup waits for every
        # handler, up to aiohttp's 60 s shutdown timeout.
        for ender in self._enders:
            ender.set()
        if self._runner:
            await self._runner.cleanup()
        if self._session:
            await self._session.close()
