"""The one way every command finds the API server (``run``, ``upgrade …``, ``admission …``).

In order: ``--kubeconfig`` (or the setting's environment variables, ``KUBECONFIG`` first;
of a ``KUBECONFIG`` list, the first file), then ``~/.kube/config`` when it exists, then
the in-cluster service account (``KUBERNETES_SERVICE_HOST``/``_PORT`` and its token).
``resolve`` decides, without I/O beyond looking at files; ``api_client`` loads it.
Nothing here imports the Kubernetes client until a client is made.

A proxy for the API server comes from the kubeconfig (``proxy-url``) or, as for Go's
``net/http`` (client-go), from ``HTTPS_PROXY``/``HTTP_PROXY``/``NO_PROXY``: read once,
when the client is made (``proxy_once``), never per request.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from shared_svc.errors import UsageError

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# The kubeconfig setting's environment variables (shared_svc.config, field ``kubeconfig``).
ENV = ("KUBECONFIG", "SHARED_SVC_KUBECONFIG")


@dataclass(frozen=True)
class Source:
    kind: Literal["kubeconfig", "in-cluster"]
    path: str | None  # the kubeconfig file; None in-cluster
    origin: str  # for messages: "~/.kube/config", "in-cluster"; "" when given (flag or variable)


def _first(paths: str) -> str | None:
    """The first file of a kubeconfig list (``a:b``)."""
    return next((p for p in paths.split(os.pathsep) if p), None)


def resolve(
    explicit: str | None,
    environ: Mapping[str, str],
    home: Path,
    service_account: Path = SERVICE_ACCOUNT,
) -> Source:
    """Which configuration to use; UsageError (one line) when there is none."""
    if explicit and (path := _first(explicit)):
        return Source("kubeconfig", path, "")
    for name in ENV:
        if (path := _first(environ.get(name, ""))) is not None:
            return Source("kubeconfig", path, "")  # as run/upgrade's setting reads it
    default = home / ".kube" / "config"
    if default.is_file():
        return Source("kubeconfig", str(default), "~/.kube/config")
    in_cluster = environ.get("KUBERNETES_SERVICE_HOST") and environ.get("KUBERNETES_SERVICE_PORT")
    if in_cluster and (service_account / "token").is_file():
        return Source("in-cluster", None, "in-cluster")
    raise UsageError(
        f"no API server configured: pass --kubeconfig, set KUBECONFIG, create {default}, "
        f"or run in a pod (no KUBERNETES_SERVICE_HOST or no token in {service_account})"
    )


async def api_client(
    explicit: str | None,
    environ: Mapping[str, str] | None = None,
    home: Path | None = None,
) -> ApiClient:
    """An API client configured from ``resolve``; a bad kubeconfig is one UsageError line."""
    import yaml
    from kubernetes_asyncio import client
    from kubernetes_asyncio import config as kube_config

    source = resolve(
        explicit, os.environ if environ is None else environ, Path.home() if home is None else home
    )
    configuration = client.Configuration()
    if source.path is None:
        try:
            kube_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        except kube_config.ConfigException as exc:
            raise UsageError(f"in-cluster configuration cannot be used: {exc}") from None
        return proxy_once(client.ApiClient(configuration=configuration))
    where = f"kubeconfig {source.path}" + (f" (from {source.origin})" if source.origin else "")
    if not os.path.exists(source.path):  # noqa: ASYNC240 (once, at start-up)
        raise UsageError(f"{where} does not exist")
    try:
        with open(source.path) as fh:  # noqa: ASYNC230 (once, at start-up)
            parsed = yaml.safe_load(fh)
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(f"{where} cannot be read: {exc}".replace("\n", " ")) from None
    if not isinstance(parsed, dict) or not parsed.get("clusters"):
        raise UsageError(f"{where} is not a kubeconfig (it names no clusters)")
    try:
        await kube_config.load_kube_config(
            config_file=source.path, client_configuration=configuration
        )
    except Exception as exc:
        raise UsageError(f"{where} cannot be used: {exc}".replace("\n", " ")) from None
    return proxy_once(client.ApiClient(configuration=configuration))


TLS_READ_BUFFER_BYTES = 64 * 1024


def small_tls_reads() -> None:
    """asyncio's TLS transport (CPython 3.11's ``sslproto``) reads each connection into a
    buffer of its own of ``SSLProtocol.max_size``, 256 KiB (cpython#109534): a driver
    upgrade wave of 500 nodes opens the client's whole pool, 100 connections, 25 MiB of
    buffers alone (issue 22). 64 KiB is four TLS records per read: the lists of a
    5,000-node start-up read as fast. Process-wide (``run`` calls it)."""
    from asyncio import sslproto

    if getattr(sslproto.SSLProtocol, "max_size", 0) > TLS_READ_BUFFER_BYTES:
        sslproto.SSLProtocol.max_size = TLS_READ_BUFFER_BYTES


def without_compression(api: ApiClient) -> ApiClient:
    """``api`` asking for uncompressed answers (``Accept-Encoding: identity`` on every
    request, where aiohttp would ask for gzip): the API server gzips a list answer over
    128 KiB, which on the benchmark machine more than doubled its CPU while the caches
    of a 5,000-node fleet listed (docs/decisions.md; kubectl's ``--disable-compression``
    and the kubeconfig's ``disable-compression`` do the same for Go clients)."""
    api.set_default_header("Accept-Encoding", "identity")
    return api


def count_requests(api: ApiClient, on_request: Callable[[str, str], None]) -> ApiClient:
    """``api`` reporting each request it sends, ``on_request(method, code)``, as client-go's
    ``rest_client_requests_total`` counts them: the HTTP method and the answer's status code
    (of a watch, when its headers arrive), ``<error>`` when no answer came (a connection
    refused or reset, a timeout). Through aiohttp's request tracing on the client's session."""
    import aiohttp

    async def ended(_: Any, __: Any, params: aiohttp.TraceRequestEndParams) -> None:
        on_request(params.method, str(params.response.status))

    async def failed(_: Any, __: Any, params: aiohttp.TraceRequestExceptionParams) -> None:
        on_request(params.method, "<error>")

    trace = aiohttp.TraceConfig()
    trace.on_request_end.append(ended)
    trace.on_request_exception.append(failed)
    trace.freeze()
    # The session's trace configurations (what its ``trace_configs`` argument sets): the
    # client made its session already.
    api.rest_client.pool_manager._trace_configs.append(trace)
    return api


def proxy_once(api: ApiClient) -> ApiClient:
    """``api`` with the environment's proxy for its server looked up now, once.

    kubernetes_asyncio's session trusts the environment, so aiohttp looks the proxy
    variables up again for every request, in a thread: 0.4 ms of CPU per request on the
    benchmark machine, more than the request itself (and more in a pod, whose
    environment holds variables for every Service of its namespace). Go's ``net/http``
    reads them once; so does this: a proxy they name for the server is set on the
    client, and the session stops looking. A ``proxy-url`` of the kubeconfig wins.
    """
    from aiohttp.helpers import get_env_proxy_for_url
    from yarl import URL

    rest = api.rest_client
    if not rest.proxy:
        try:
            proxy, auth = get_env_proxy_for_url(URL(api.configuration.host or ""))
        except LookupError:  # no proxy for this server
            pass
        else:
            rest.proxy = str(proxy)
            if auth is not None:
                rest.proxy_headers = {"Proxy-Authorization": auth.encode()}
    # The session's trust_env (a read-only property) is this attribute; a test checks it.
    rest.pool_manager._trust_env = False
    return api
