"""The one way a command talks to the API server: connect, run, close; API trouble is one line."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from shared_svc.errors import UsageError

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient
    from kubernetes_asyncio.client.exceptions import ApiException

T = TypeVar("T")


def with_api(kubeconfig: str | None, body: Callable[[ApiClient], Awaitable[T]]) -> T:
    """Connect (shared_svc.kubeconfig: the path, $KUBECONFIG, ~/.kube/config, in-cluster),
    run ``body(api)``, close. A refusal or an unreachable API server becomes a
    :class:`UsageError` (one line, exit 2), never a traceback."""
    from aiohttp import ClientError
    from kubernetes_asyncio.client.exceptions import ApiException

    from shared_svc.kubeconfig import api_client

    async def main() -> T:
        api = await api_client(kubeconfig)
        try:
            return await body(api)
        finally:
            await api.close()

    try:
        return asyncio.run(main())
    except ApiException as exc:
        raise UsageError(f"the API server refused: {exc.status} {api_message(exc)}") from None
    except (TimeoutError, ClientError, OSError) as exc:
        raise UsageError(f"cannot reach the API server: {exc or type(exc).__name__}") from None


def api_message(exc: ApiException) -> str:
    """The message of the API server's Status in ``exc`` (else its reason)."""
    from shared_svc.kube.writer import status_of

    return str(status_of(exc).get("message") or exc.reason)
