"""Session fixture: a real etcd + kube-apiserver on 127.0.0.1 (see shared_svc.testenv)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from kubernetes_asyncio.client import ApiClient

from shared_svc import testenv
from tests.kube import api_client, make_namespace, unique
from tests.svc import Kube

# gpu-operator's own ClusterPolicy and GPUCluster CRDs, kept in the repository (see its README).
UPSTREAM_CRDS = Path(__file__).resolve().parent / "data" / "upstream-crds"


@pytest.fixture(scope="session")
def control_plane() -> Iterator[testenv.ControlPlane]:
    """Started once per session; stopped at the end even when tests fail."""
    try:
        cp = testenv.start()
    except testenv.ControlPlaneError as exc:
        pytest.fail(f"test control plane did not start: {exc}", pytrace=False)
    try:
        yield cp
    finally:
        cp.stop()


@pytest.fixture
async def api(control_plane: testenv.ControlPlane) -> AsyncIterator[ApiClient]:
    """An admin API client for one test."""
    c = await api_client(control_plane)
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture
async def kube(api: ApiClient, request: pytest.FixtureRequest) -> AsyncIterator[Kube]:
    """Admin helpers in a namespace of the test's own, with no ClusterPolicy/GPUCluster
    before or after (the CRs are cluster-scoped and the API server is shared)."""
    prefix = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_").replace("_", "-")[:20]
    k = Kube(api, await make_namespace(api, unique(prefix)))
    await k.clean_crs()
    try:
        yield k
    finally:
        await k.clean_crs()
