"""The one way every command finds the API server (``run``, ``upgrade …``, ``admission …``).

In order: ``--kubeconfig`` (or the setting's environment variables, ``KUBECONFIG`` first;
of a ``KUBECONFIG`` list, the first file), then ``~/.kube/config`` when it exists, then
the in-cluster service account (``KUBERNETES_SERVICE_HOST``/``_PORT`` and its token).
``resolve`` decides, without I/O beyond looking at files; ``api_client`` loads it.
Nothing here imports the Kubernetes client until a client is made.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

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
        return client.ApiClient(configuration=configuration)
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
    return client.ApiClient(configuration=configuration)
