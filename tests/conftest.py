"""Session fixture: a real etcd + kube-apiserver on 127.0.0.1 (see testenv); module
fixtures: a control plane with kube-controller-manager, the real gpu-operator."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest
from kubernetes_asyncio.client import ApiClient

import testenv
from shared_svc.service import Service
from testenv import gpu_operator as gpu_env
from testenv import node as node_env
from testenv import prometheus as prom_env
from testenv import prometheus_operator as prom_operator_env
from testenv import upgrade_libs as libs_env
from tests import compat
from tests.kube import api_client, make_namespace, unique
from tests.svc import Kube, running, service_config

# gpu-operator's own ClusterPolicy and GPUCluster CRDs, kept in the repository (see its README).
UPSTREAM_CRDS = Path(__file__).resolve().parent / "data" / "upstream-crds"

# A test that builds (or starts) the Go binaries of testenv/build.sh (etcd, kube-apiserver,
# kube-controller-manager), of testenv/helmrender/build.sh, of testenv/gpu-operator/build.sh,
# of testenv/prometheus/build.sh, of testenv/upgrade-libs/build.sh or of testenv/node/ (the
# real node and its images) carries one of these markers (pyproject.toml), so `-m "not
# apiserver and not controller_manager and not gpu_operator and not helm and not
# prometheus and not upgrade_libs and not node"` never starts a build. Enforced: such a
# test without one fails.
BUILD_MARKERS = {
    "testenv/build.sh": frozenset(
        {"apiserver", "controller_manager", "gpu_operator", "helm", "node"}
    ),
    "testenv/helmrender/build.sh": frozenset(
        {"apiserver", "controller_manager", "gpu_operator", "helm", "node"}
    ),
    "testenv/gpu-operator/build.sh": frozenset({"gpu_operator"}),
    "testenv/prometheus/build.sh": frozenset({"prometheus"}),
    "testenv/upgrade-libs/build.sh": frozenset({"upgrade_libs"}),
    "testenv/prometheus-operator/build.sh": frozenset({"prometheus"}),
    "testenv/node/build.sh": frozenset({"node"}),
}
_running: list[pytest.Item] = []


def unmarked_build(script: str, markers: Iterable[str]) -> str | None:
    """Why a test with ``markers`` may not run ``script`` (None: it may)."""
    allowed = BUILD_MARKERS[script]
    if allowed & set(markers):
        return None
    return f"runs {script} (a Go build) without a marker: mark it {' or '.join(sorted(allowed))}"


def _only_for_marked_tests(script: str, build: Callable[..., Path]) -> Callable[..., Path]:
    def guarded(*args: Any) -> Path:
        if _running:
            refusal = unmarked_build(script, (m.name for m in _running[0].iter_markers()))
            if refusal:
                pytest.fail(f"{_running[0].nodeid} {refusal}", pytrace=False)
        return build(*args)

    return guarded


testenv.build_binaries = _only_for_marked_tests("testenv/build.sh", testenv.build_binaries)
testenv.build_helmrender = _only_for_marked_tests(
    "testenv/helmrender/build.sh", testenv.build_helmrender
)
gpu_env.build = _only_for_marked_tests("testenv/gpu-operator/build.sh", gpu_env.build)
prom_env.build = _only_for_marked_tests("testenv/prometheus/build.sh", prom_env.build)
libs_env.build = _only_for_marked_tests("testenv/upgrade-libs/build.sh", libs_env.build)
prom_operator_env.build = _only_for_marked_tests(
    "testenv/prometheus-operator/build.sh", prom_operator_env.build
)
node_env.build = _only_for_marked_tests("testenv/node/build.sh", node_env.build)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--kube-version",
        metavar="MINOR",
        help=f"Kubernetes version of every control plane of the run: sets "
        f"{testenv.KUBE_VERSION_ENV} (one of {', '.join(testenv.kube_versions())}; "
        f"default ${testenv.KUBE_VERSION_ENV}, else {testenv.DEFAULT_KUBE_VERSION})",
    )


def pytest_configure(config: pytest.Config) -> None:
    """``--kube-version`` sets ``$SHARED_SVC_KUBE_VERSION`` for the run (its control planes
    and every process it starts); a version that is not built is a usage error."""
    minor = config.getoption("--kube-version")
    if minor:
        os.environ[testenv.KUBE_VERSION_ENV] = minor
    try:
        testenv.kube_version()
    except testenv.ControlPlaneError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_report_header(config: pytest.Config) -> str:
    return f"Kubernetes {testenv.kube_version()} ({testenv.kubernetes_release()})"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the tests of the compatibility suite (tests/compat.py) ``compat``, before ``-m``
    selects."""
    for item in items:
        path = item.path.relative_to(config.rootpath).as_posix()
        name = getattr(item, "originalname", item.name)
        if compat.in_suite(path, name):
            item.add_marker(pytest.mark.compat)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """The test whose fixtures and body run now (for the build guard above)."""
    _running[:] = [item]


class Stoppable(Protocol):
    def stop(self) -> None: ...


S = TypeVar("S", bound=Stoppable)


def started(what: str, start: Callable[[], S]) -> Iterator[S]:
    """What ``start()`` starts (a control plane, Prometheus, prometheus-operator) until the
    fixture ends, stopped even when tests fail; one that does not start fails the test in
    one line."""
    try:
        thing = start()
    except testenv.ControlPlaneError as exc:
        pytest.fail(f"{what} did not start: {exc}", pytrace=False)
    try:
        yield thing
    finally:
        thing.stop()


def _plane(what: str, **kwargs: Any) -> Iterator[testenv.ControlPlane]:
    """A control plane (``testenv.start(**kwargs)``), as :func:`started`."""
    yield from started(what, lambda: testenv.start(**kwargs))


@contextlib.asynccontextmanager
async def _admin_client(cp: testenv.ControlPlane) -> AsyncIterator[ApiClient]:
    c = await api_client(cp)
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture(scope="session")
def control_plane() -> Iterator[testenv.ControlPlane]:
    """Started once per session; stopped at the end even when tests fail."""
    yield from _plane("test control plane")


@pytest.fixture(scope="module")
def gpu_operator_nodes() -> tuple[str, ...]:
    """The GPU nodes the ``gpu_operator`` fixture creates; a test module overrides this
    fixture to have others (more nodes: :func:`gpu_env.add_gpu_node` later works too)."""
    return ("gpu-node-0",)


@pytest.fixture(scope="module")
def gpu_operator(
    gpu_operator_nodes: tuple[str, ...], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[gpu_env.GpuOperator]:
    """The real gpu-operator on a control plane of the test module's own (its CRDs, not
    the project's; see testenv/gpu_operator.py), with GPU nodes and no
    ClusterPolicy yet. ``.control_plane`` is that control plane; its workdir (kept after
    the session, under pytest's basetemp) holds ``gpu-operator.log``. Stopped, with the
    control plane, at the end of the module even when tests fail."""
    workdir = tmp_path_factory.mktemp("gpu-operator")
    try:
        cp = gpu_env.start_control_plane(workdir)
    except testenv.ControlPlaneError as exc:
        pytest.fail(f"control plane for gpu-operator did not start: {exc}", pytrace=False)
    try:
        for node in gpu_operator_nodes:
            gpu_env.add_gpu_node(cp, node)
        try:
            op = gpu_env.start(cp)
        except testenv.ControlPlaneError as exc:
            pytest.fail(f"gpu-operator did not start: {exc}", pytrace=False)
        try:
            yield op
        finally:
            op.stop()
    finally:
        cp.stop()


@pytest.fixture
async def api(control_plane: testenv.ControlPlane) -> AsyncIterator[ApiClient]:
    """An admin API client for one test."""
    async with _admin_client(control_plane) as c:
        yield c


@contextlib.asynccontextmanager
async def _namespace_of_the_test(
    api: ApiClient, request: pytest.FixtureRequest
) -> AsyncIterator[Kube]:
    """Admin helpers in a new namespace named after the test module, with no
    ClusterPolicy/GPUCluster before or after (the CRs are cluster-scoped)."""
    prefix = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_").replace("_", "-")[:20]
    k = Kube(api, await make_namespace(api, unique(prefix)))
    await k.clean_crs()
    try:
        yield k
    finally:
        await k.clean_crs()


@pytest.fixture
async def kube(api: ApiClient, request: pytest.FixtureRequest) -> AsyncIterator[Kube]:
    """Admin helpers in a namespace of the test's own, with no ClusterPolicy/GPUCluster
    before or after (the CRs are cluster-scoped and the API server is shared)."""
    async with _namespace_of_the_test(api, request) as k:
        yield k


# --- a control plane of the module's own, with kube-controller-manager (its garbage
# collector and EndpointSlice controller would otherwise act on every other test's
# objects): tests/test_endpoints_gc.py, tests/test_scrape_prometheus.py ---


@pytest.fixture(scope="module")
def kcm_plane() -> Iterator[testenv.ControlPlane]:
    yield from _plane("control plane with kube-controller-manager", controller_manager=True)


@pytest.fixture
async def kapi(kcm_plane: testenv.ControlPlane) -> AsyncIterator[ApiClient]:
    """An admin API client of ``kcm_plane`` for one test."""
    async with _admin_client(kcm_plane) as c:
        yield c


@pytest.fixture
async def kk(kapi: ApiClient, request: pytest.FixtureRequest) -> AsyncIterator[Kube]:
    """``kube`` on ``kcm_plane``."""
    async with _namespace_of_the_test(kapi, request) as k:
        yield k


@pytest.fixture
async def svc(kcm_plane: testenv.ControlPlane, kk: Kube) -> AsyncIterator[Service]:
    """shared-svc running on ``kcm_plane`` for ``kk``'s namespace."""
    async with running(service_config(kcm_plane, kk.ns)) as service:
        yield service


# --- the real node (testenv/node): one at a time on the machine, one per session ---


class NodeSession:
    """Starts the real node on first use and keeps it for the session; a node stopped by a
    test (tests/test_real_node_teardown.py) is started again for any test after it. A node
    that does not start fails every test that needs it, with the reason (never a skip)."""

    def __init__(self, parent: Path) -> None:
        self.parent = parent
        self.node: node_env.Node | None = None
        self.failure: str | None = None

    def get(self) -> node_env.Node:
        if self.failure is not None:
            pytest.fail(self.failure, pytrace=False)
        if self.node is None or self.node.stopped:
            try:
                self.node = node_env.start(self.parent, keep_logs=self.parent / "logs")
            except testenv.ControlPlaneError as exc:
                self.failure = f"the real node did not start: {exc}"
                pytest.fail(self.failure, pytrace=False)
        return self.node

    def stop(self) -> None:
        if self.node is not None:
            self.node.stop()


@pytest.fixture(scope="session")
def node_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeSession]:
    session = NodeSession(tmp_path_factory.mktemp("real-node"))
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture(scope="module")
def real_node(node_session: NodeSession) -> node_env.Node:
    """The session's real node (testenv/node), with its own control plane
    (``.control_plane``); its logs are kept under pytest's basetemp, ``real-node*/logs``."""
    return node_session.get()


# --- prometheus-operator and the Prometheus it feeds (testenv/prometheus_operator.py) ---

OPERATOR_PROXY = "servicemonitors"  # the stand-ins' proxy for the operator's scrape jobs


@pytest.fixture(scope="module")
def operator_crds(kcm_plane: testenv.ControlPlane) -> testenv.ControlPlane:
    """The module's control plane with prometheus-operator's CRDs (Prometheus,
    PrometheusRule, its ServiceMonitor CRD in place of the project's)."""
    try:
        prom_operator_env.install_crds(kcm_plane)
    except testenv.ControlPlaneError as exc:
        pytest.fail(f"prometheus-operator's CRDs: {exc}", pytrace=False)
    return kcm_plane


@pytest.fixture(scope="module")
def prometheus_operator(
    operator_crds: testenv.ControlPlane,
) -> Iterator[prom_operator_env.Operator]:
    yield from started("prometheus-operator", lambda: prom_operator_env.start(operator_crds))


def serving_stand_ins(jobs: tuple[str, ...] = tuple(prom_env.JOBS)) -> Iterator[prom_env.StandIns]:
    """Exporter stand-ins with a scrape proxy per job of ``jobs``, until the fixture ends."""
    s = prom_env.StandIns().start(jobs=jobs)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def operator_stand_ins() -> Iterator[prom_env.StandIns]:
    """The scrape proxy of the operator's jobs (``OPERATOR_PROXY``) and the stand-ins."""
    yield from serving_stand_ins((OPERATOR_PROXY,))


@pytest.fixture(scope="module")
def operator_prometheus(
    operator_crds: testenv.ControlPlane, operator_stand_ins: prom_env.StandIns
) -> Iterator[prom_env.Prometheus]:
    """Prometheus with no scrape job until the config-reloader brings the operator's."""
    yield from started(
        "Prometheus", lambda: prom_env.start(operator_crds, operator_stand_ins, jobs=False)
    )
