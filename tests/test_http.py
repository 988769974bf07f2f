"""The HTTP endpoints as served (``make_runner``, what ``Service`` uses), over raw sockets.

Malformed requests get a 400 and one INFO line without a traceback; a client that never
completes its request is disconnected; an error in our own handler is still an ERROR.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from shared_svc.http import CLIENT_TIMEOUT, bound_port, make_app, make_runner
from tests.kube import eventually


def _status() -> dict[str, Any]:
    raise RuntimeError("status exploded")


@pytest.fixture
async def port() -> AsyncIterator[int]:
    app = make_app(
        alive=lambda: True, ready=lambda: True, status=_status, registry=CollectorRegistry()
    )
    runner = make_runner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield bound_port(runner)
    finally:
        await runner.cleanup()


async def _exchange(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /livez HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
        b"GET /livez HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\n\r\n",
        b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /livez HTTP/9.9\r\nHost: x\r\n\r\n",
    ],
    ids=["header-without-colon", "nul-in-header", "line-too-long", "bad-version"],
)
async def test_a_malformed_request_is_a_400_and_one_info_line_without_traceback(
    port: int, request_bytes: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="aiohttp")
    response = await _exchange(port, request_bytes)
    assert response.split(b"\r\n", 1)[0].split(b" ")[1] == b"400", response[:80]
    records = [r for r in caplog.records if r.name.startswith("aiohttp")]
    assert not [r for r in records if r.levelno >= logging.WARNING or r.exc_info], [
        (r.levelname, r.getMessage()) for r in records
    ]
    [line] = [r for r in records if "bad HTTP request" in r.getMessage()]
    assert line.levelno == logging.INFO and "\n" not in line.getMessage()


async def test_an_error_in_our_handler_is_still_an_error_with_its_traceback(
    port: int, caplog: pytest.LogCaptureFixture
) -> None:
    response = await _exchange(
        port, b"GET /status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    assert response.startswith(b"HTTP/1.1 500")
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.exc_info is not None and "status exploded" in str(record.exc_info[1])


async def test_a_client_that_sends_half_a_request_line_is_disconnected(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /liv")
    await writer.drain()

    async def closed() -> bool:
        try:
            return await asyncio.wait_for(reader.read(1024), 0.5) == b""
        except TimeoutError:
            return False

    try:
        assert await eventually(closed, timeout=CLIENT_TIMEOUT + 20)
    finally:
        writer.close()


async def test_a_slow_client_gets_its_answer_within_the_timeout(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for part in (b"GET /livez HT", b"TP/1.1\r\nHost: x\r\n", b"Connection: close\r\n\r\n"):
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.2)
        response = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    assert response.startswith(b"HTTP/1.1 200") and response.endswith(b"ok\n")
