"""Helpers for tests that talk to the real test API server through kubernetes_asyncio."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

from kubernetes_asyncio import client, config
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from shared_svc.kubeconfig import proxy_once
from testenv import ControlPlane

_counter = itertools.count()


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
