"""The API client reads the proxy environment once, when it is made (``proxy_once``).

kubernetes_asyncio's session trusts the environment, and aiohttp then looks the proxy
variables up in a thread for every request (0.4 ms of CPU per request, more than the
request itself). Like Go's ``net/http``, the variables are read once.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared_svc import kubeconfig
from shared_svc.kube.writer import raw_request
from testenv import ControlPlane

PROXY_VARIABLES = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "NO_PROXY")


@pytest.fixture
def no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    return monkeypatch


def _kubeconfig(tmp_path: Path, server: str, **cluster: Any) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server, **cluster}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return str(path)


async def test_the_environment_proxy_is_set_once(
    tmp_path: Path, no_proxy_env: pytest.MonkeyPatch
) -> None:
    no_proxy_env.setenv("HTTPS_PROXY", "http://someone:secret@proxy.invalid:3128")
    api = await kubeconfig.api_client(_kubeconfig(tmp_path, "https://10.0.0.1:6443"))
    try:
        assert api.rest_client.pool_manager.trust_env is False
        assert api.rest_client.proxy == "http://proxy.invalid:3128"
        assert api.rest_client.proxy_headers == {
            "Proxy-Authorization": "Basic c29tZW9uZTpzZWNyZXQ="  # someone:secret
        }
    finally:
        await api.close()


async def test_no_proxy_and_the_kubeconfig_proxy_win(
    tmp_path: Path, no_proxy_env: pytest.MonkeyPatch
) -> None:
    no_proxy_env.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    no_proxy_env.setenv("NO_PROXY", "10.0.0.1")
    api = await kubeconfig.api_client(_kubeconfig(tmp_path, "https://10.0.0.1:6443"))
    try:
        assert api.rest_client.pool_manager.trust_env is False
        assert api.rest_client.proxy is None
    finally:
        await api.close()
    no_proxy_env.delenv("NO_PROXY")
    config = _kubeconfig(tmp_path, "https://10.0.0.1:6443", **{"proxy-url": "http://mine:8080"})
    api = await kubeconfig.api_client(config)
    try:
        assert api.rest_client.proxy == "http://mine:8080"
    finally:
        await api.close()


@pytest.mark.apiserver
async def test_requests_do_not_look_up_the_proxy_in_a_thread(
    control_plane: ControlPlane, no_proxy_env: pytest.MonkeyPatch
) -> None:
    api = await kubeconfig.api_client(str(control_plane.kubeconfig))
    threads = 0
    real = asyncio.to_thread

    async def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal threads
        threads += 1
        return await real(*args, **kwargs)

    no_proxy_env.setattr(asyncio, "to_thread", counting)
    try:
        for _ in range(5):
            assert (await raw_request(api, "GET", "/api/v1/namespaces/default"))["kind"] == (
                "Namespace"
            )
    finally:
        await api.close()
    assert threads == 0
