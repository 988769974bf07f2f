"""Helpers for tests that talk to the real test API server through kubernetes_asyncio."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from shared_svc.kubeconfig import proxy_once
from testenv import ControlPlane

_counter = itertools.count()


class WatchGone(Exception):
    """The watch's resourceVersion is gone (410): list again."""


async def watch_events(
    api: ApiClient, path: str, rv: str, *, seconds: int, bookmarks: bool = False
) -> AsyncIterator[dict[str, Any]]:
    """The events of one watch of ``path`` from ``rv`` (the API server ends it after
    ``seconds``), as the API server sends them (``ERROR`` included); raises
    :class:`WatchGone` when the API server answers 410 at once."""
    query = [("watch", "true"), ("resourceVersion", rv), ("timeoutSeconds", str(seconds))]
    if bookmarks:
        query.append(("allowWatchBookmarks", "true"))
    resp = await api.call_api(
        path,
        "GET",
        query_params=query,
        header_params={"Accept": "application/json"},
        auth_settings=["BearerToken"],
        _preload_content=False,
        _request_timeout=aiohttp.ClientTimeout(total=seconds + 30, sock_connect=5),
    )
    async with resp:
        if resp.status == 410:
            raise WatchGone(path)
        while line := await resp.content.readline():
            yield json.loads(line)


async def api_client(control_plane: ControlPlane, kubeconfig: str | None = None) -> ApiClient:
    """An admin client (or the identity of ``kubeconfig``); the caller closes it."""
    configuration = client.Configuration()
    await config.load_kube_config(
        config_file=str(kubeconfig or control_plane.kubeconfig), client_configuration=configuration
    )
    return proxy_once(ApiClient(configuration=configuration))


def unique(prefix: str) -> str:
    """A name unique within the test session (tests share one API server)."""
    return f"{prefix}-{next(_counter)}"


async def make_namespace(api: ApiClient, name: str) -> str:
    try:
        await client.CoreV1Api(api).create_namespace({"metadata": {"name": name}})
    except ApiException as exc:
        if exc.status != 409:
            raise
    return name


async def eventually(
    check: Callable[[], Awaitable[Any]], timeout: float = 30.0, interval: float = 0.1
) -> Any:
    """Polls ``check`` until it returns a truthy value; returns it, or fails with the last value."""
    deadline = asyncio.get_running_loop().time() + timeout
    last: Any = None
    while True:
        last = await check()
        if last:
            return last
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s; last value: {last!r}")
        await asyncio.sleep(interval)
