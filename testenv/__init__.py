"""The embedded test control plane: a real etcd and kube-apiserver on 127.0.0.1.

Built from Go modules by ``testenv/build.sh`` (cached), started with free ports in a
temporary directory, authenticated by a static token file (admin in
``system:masters``) with ``--authorization-mode=RBAC``. Used by the test fixtures, the
demo, the benchmarks and ``python -m testenv``. On request kube-controller-manager runs
too, with the garbage collector and EndpointSlice controllers only (:data:`CONTROLLERS`);
there is never a DaemonSet controller, scheduler or kubelet.

The Kubernetes version is chosen per run (:func:`kube_version`: ``SHARED_SVC_KUBE_VERSION``,
a minor with a module file ``testenv/kube/<minor>.mod``; default :data:`DEFAULT_KUBE_VERSION`);
each version is its own cached build.

Synchronous on purpose (stdlib only): fixtures and commands start it before any event
loop exists.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
TESTENV_DIR = REPO_ROOT / "testenv"
PROJECT_CRDS = Path(__file__).resolve().parent / "crds"
SERVICE_CIDR = "10.0.0.0/24"


class ControlPlaneError(RuntimeError):
    """The control plane could not be built or started; the message says why."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# The Kubernetes version of a run: a minor with a module file in testenv/kube/.
KUBE_VERSION_ENV = "SHARED_SVC_KUBE_VERSION"
DEFAULT_KUBE_VERSION = "1.36"
KUBE_MODULES = TESTENV_DIR / "kube"


def kube_versions() -> tuple[str, ...]:
    """The Kubernetes minors the test control plane builds (one ``kube/<minor>.mod`` each),
    oldest first."""
    minors = (p.name.removesuffix(".mod") for p in KUBE_MODULES.glob("*.mod"))
    return tuple(sorted(minors, key=lambda m: tuple(int(x) for x in m.split("."))))


def kube_version() -> str:
    """The minor this run tests (``$SHARED_SVC_KUBE_VERSION``, default
    :data:`DEFAULT_KUBE_VERSION`); one that is not built raises ControlPlaneError in one line."""
    minor = os.environ.get(KUBE_VERSION_ENV, "").strip() or DEFAULT_KUBE_VERSION
    known = kube_versions()
    if minor not in known:
        raise ControlPlaneError(
            f"{KUBE_VERSION_ENV}={minor}: not a Kubernetes version of the test control plane"
            f" (one of {', '.join(known)})"
        )
    return minor


def _required(minor: str, module: str) -> str:
    for line in (KUBE_MODULES / f"{minor}.mod").read_text().splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == module:
            return words[1]
    raise ControlPlaneError(f"testenv/kube/{minor}.mod requires no {module}")


def kubernetes_release(minor: str | None = None) -> str:
    """The ``k8s.io/kubernetes`` version the minor is built from, e.g. ``v1.33.13``."""
    return _required(minor or kube_version(), "k8s.io/kubernetes")


def etcd_release(minor: str | None = None) -> str:
    """The etcd version the minor runs with, e.g. ``v3.5.24``."""
    return _required(minor or kube_version(), "go.etcd.io/etcd/server/v3")


def build_binaries(minor: str | None = None) -> Path:
    """Runs the cached Go build of the minor's control plane (default :func:`kube_version`);
    returns the directory with ``etcd``, ``kube-apiserver`` and ``kube-controller-manager``.
    ``$SHARED_SVC_TESTENV_BIN`` names such a directory instead."""
    from testenv.builds import cached_build

    minor = minor or kube_version()
    return cached_build(
        TESTENV_DIR / "build.sh",
        minor,
        override_env="SHARED_SVC_TESTENV_BIN",
        what=f"the test control plane (Kubernetes {minor})",
        error=ControlPlaneError,
    )


def build_helmrender() -> Path:
    """Runs the cached Go build of helmrender (Helm's renderer, one for every version);
    returns the path of the binary."""
    from testenv.builds import cached_build

    return (
        cached_build(
            TESTENV_DIR / "helmrender" / "build.sh",
            override_env=None,
            what="helmrender",
            error=ControlPlaneError,
        )
        / "helmrender"
    )


def _insecure_context() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


@dataclass
class ControlPlane:
    """A running etcd + kube-apiserver pair. Use :func:`start` or the context manager."""

    workdir: Path
    url: str
    admin_token: str
    kubeconfig: Path
    etcd_url: str
    kube_version: str = DEFAULT_KUBE_VERSION  # the minor it runs (kube/<minor>.mod)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _apiserver_args: list[str] = field(default_factory=list)
    _etcd_args: list[str] = field(default_factory=list)
    _owns_workdir: bool = True

    # --- HTTP helpers (admin) ---
    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        token: str | None = None,
        content_type: str = "application/json",
        timeout: float = 30.0,
    ) -> tuple[int, Any]:
        data = None
        if body is not None:
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {token or self.admin_token}")
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, context=_insecure_context(), timeout=timeout) as resp:
                raw = resp.read()
                status: int = resp.status
        except urllib.error.HTTPError as err:
            raw = err.read()
            status = err.code
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode(errors="replace")

    def apply_manifests(
        self, docs: Iterable[dict[str, Any]], *, field_manager: str = "testenv"
    ) -> None:
        """Server-side applies each manifest (any kind the server knows, cluster or namespaced)."""
        for doc in docs:
            path = self._path_for(doc)
            status, resp = self.request(
                "PATCH",
                f"{path}?fieldManager={field_manager}&force=true",
                json.dumps(doc),
                content_type="application/apply-patch+yaml",
            )
            if status >= 300:
                raise ControlPlaneError(
                    f"apply {doc.get('kind')}/{doc['metadata'].get('name')}: {status} {resp}"
                )

    def install_crds(self, paths: Iterable[Path]) -> list[str]:
        names: list[str] = []
        docs: list[dict[str, Any]] = []
        for path in paths:
            docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
        self.apply_manifests(docs)
        names = [d["metadata"]["name"] for d in docs]
        self.wait_established(names)
        return names

    def wait_established(self, crd_names: Iterable[str], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        for name in crd_names:
            while True:
                status, crd = self.request(
                    "GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"
                )
                conds = (
                    {
                        c["type"]: c["status"]
                        for c in (crd or {}).get("status", {}).get("conditions", [])
                    }
                    if status == 200
                    else {}
                )
                if conds.get("Established") == "True":
                    break
                if time.monotonic() > deadline:
                    raise ControlPlaneError(f"CRD {name} not established after {timeout}s")
                time.sleep(0.2)
        # Discovery catches up a little after Established; wait until every group is served.
        groups = set()
        for name in crd_names:
            _, crd = self.request(
                "GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"
            )
            for ver in crd["spec"]["versions"]:
                if ver.get("served"):
                    groups.add((crd["spec"]["group"], ver["name"], crd["spec"]["names"]["plural"]))
        for group, version, plural in sorted(groups):
            while True:
                status, res = self.request("GET", f"/apis/{group}/{version}")
                listed = status == 200 and any(
                    r["name"] == plural for r in res.get("resources", [])
                )
                # ...and its storage answers lists (it says 429 while initializing).
                if (
                    listed
                    and self.request("GET", f"/apis/{group}/{version}/{plural}?limit=1")[0] == 200
                ):
                    break
                if time.monotonic() > deadline:
                    raise ControlPlaneError(
                        f"{group}/{version} {plural} not served after {timeout}s"
                    )
                time.sleep(0.2)

    def uninstall_crds(self, crd_names: Iterable[str], timeout: float = 60.0) -> None:
        for name in crd_names:
            self.request(
                "DELETE", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"
            )
        deadline = time.monotonic() + timeout
        for name in crd_names:
            while (
                self.request(
                    "GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"
                )[0]
                != 404
            ):
                if time.monotonic() > deadline:
                    raise ControlPlaneError(f"CRD {name} still present after {timeout}s")
                time.sleep(0.2)

    def ensure_namespace(self, name: str) -> None:
        status, resp = self.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
        if status not in (201, 409):
            raise ControlPlaneError(f"create namespace {name}: {status} {resp}")

    def service_account_token(self, namespace: str, name: str, seconds: int = 3600) -> str:
        """A real bound token for a ServiceAccount, issued by the API server (TokenRequest)."""
        self.request(
            "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": name}}
        )
        status, resp = self.request(
            "POST",
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"expirationSeconds": seconds},
            },
        )
        if status != 201:
            raise ControlPlaneError(f"token for {namespace}/{name}: {status} {resp}")
        token: str = resp["status"]["token"]
        return token

    def compact_etcd(self) -> int:
        """Compacts etcd's history up to now (the API server does this every 5 minutes in a
        real cluster); a watch from an older resourceVersion then gets 410 Gone."""

        def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
            req = urllib.request.Request(
                self.etcd_url + path, data=json.dumps(body).encode(), method="POST"
            )
            with urllib.request.urlopen(req, timeout=10) as resp:
                out: dict[str, Any] = json.loads(resp.read())
                return out

        revision = int(post("/v3/kv/range", {"key": "AA=="})["header"]["revision"])
        post("/v3/kv/compaction", {"revision": str(revision), "physical": True})
        return revision

    def write_kubeconfig(self, path: Path, token: str, user: str = "user") -> Path:
        ca = (self.workdir / "certs" / "apiserver.crt").read_text()
        import base64

        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "testenv",
                    "cluster": {
                        "server": self.url,
                        "certificate-authority-data": base64.b64encode(ca.encode()).decode(),
                    },
                }
            ],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "testenv", "context": {"cluster": "testenv", "user": user}}],
            "current-context": "testenv",
        }
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    def server_version(self) -> str:
        """What the API server says it is (``/version``'s ``gitVersion``, e.g. ``v1.33.13``)."""
        status, body = self.request("GET", "/version")
        if status != 200 or not isinstance(body, dict):
            raise ControlPlaneError(f"/version: {status} {body}")
        return str(body.get("gitVersion"))

    def _path_for(self, doc: dict[str, Any]) -> str:
        api_version: str = doc["apiVersion"]
        kind: str = doc["kind"]
        base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        status, res = self.request("GET", base)
        if status != 200:
            raise ControlPlaneError(f"{api_version} not served: {status}")
        for r in res["resources"]:
            if r["kind"] == kind and "/" not in r["name"]:
                ns = doc["metadata"].get("namespace")
                if r["namespaced"]:
                    if not ns:
                        raise ControlPlaneError(
                            f"{kind}/{doc['metadata']['name']} needs a namespace"
                        )
                    return f"{base}/namespaces/{ns}/{r['name']}/{doc['metadata']['name']}"
                return f"{base}/{r['name']}/{doc['metadata']['name']}"
        raise ControlPlaneError(f"{kind} not served in {api_version}")

    # --- lifecycle ---
    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for name, proc in self.processes.items():
                if proc.poll() is not None:
                    raise ControlPlaneError(
                        f"{name} exited with {proc.returncode}; log: {self.workdir / (name + '.log')}\n{self._tail(name)}"
                    )
            try:
                status, body = self.request("GET", "/readyz", timeout=5)
                if status == 200:
                    return
                last = f"{status} {body}"
            except OSError as exc:
                last = str(exc)
            time.sleep(0.25)
        raise ControlPlaneError(
            f"kube-apiserver not ready after {timeout}s: {last}\n{self._tail('kube-apiserver')}"
        )

    def _tail(self, name: str, lines: int = 20) -> str:
        log = self.workdir / f"{name}.log"
        if not log.exists():
            return ""
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])

    def start_controller_manager(
        self, bindir: Path, sa_key: Path, flags: Mapping[str, str | None] | None = None
    ) -> None:
        """Starts kube-controller-manager as the admin, and waits until it serves /healthz
        (``flags``: as :func:`with_flags`)."""
        kubeconfig = self.kubeconfig
        port = free_port()
        args = [
            str(bindir / "kube-controller-manager"),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--authentication-skip-lookup=true",
            f"--controllers={','.join(CONTROLLERS)}",
            "--use-service-account-credentials=false",
            f"--service-account-private-key-file={sa_key}",
            f"--root-ca-file={self.workdir / 'certs' / 'apiserver.crt'}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={self.workdir / 'kcm-certs'}",
            "--concurrent-gc-syncs=5",
            "--v=1",
        ]
        self.processes["kube-controller-manager"] = _spawn(
            with_flags(args, flags or {}), self.workdir / "kube-controller-manager.log"
        )
        deadline = time.monotonic() + 60
        url = f"https://127.0.0.1:{port}/healthz"
        while True:
            proc = self.processes["kube-controller-manager"]
            if proc.poll() is not None:
                raise ControlPlaneError(
                    f"kube-controller-manager exited with {proc.returncode}\n"
                    f"{self._tail('kube-controller-manager')}"
                )
            try:
                with urllib.request.urlopen(url, context=_insecure_context(), timeout=5) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise ControlPlaneError(
                    "kube-controller-manager not healthy after 60s\n"
                    f"{self._tail('kube-controller-manager')}"
                )
            time.sleep(0.25)

    def stop_apiserver(self) -> None:
        _terminate(self.processes.pop("kube-apiserver", None))

    def start_apiserver(self) -> None:
        """(Re)starts kube-apiserver with the same flags and port; etcd keeps the data."""
        if "kube-apiserver" in self.processes:
            return
        self.processes["kube-apiserver"] = _spawn(
            self._apiserver_args, self.workdir / "kube-apiserver.log"
        )
        self.wait_ready()

    def kill_etcd(self) -> None:
        """Kills etcd (-9), as a node that lost power would; :meth:`start_etcd` brings it
        back on its data (written without fsync: a process kill loses nothing)."""
        proc = self.processes.pop("etcd", None)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)

    def start_etcd(self) -> None:
        """(Re)starts etcd with the same flags and data; waits until the API server is ready."""
        if "etcd" in self.processes:
            return
        self.processes["etcd"] = _spawn(self._etcd_args, self.workdir / "etcd.log")
        self.wait_ready()

    def stop(self) -> None:
        for name in STOP_ORDER:
            _terminate(self.processes.pop(name, None))
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def with_flags(args: list[str], flags: Mapping[str, str | None]) -> list[str]:
    """``args`` (a program and its ``--flag=value`` arguments) with each of ``flags``
    replacing the flag of that name, or added; a ``None`` value drops it."""
    kept = [a for a in args if a.split("=", 1)[0] not in flags]
    return kept + [f"{name}={value}" for name, value in flags.items() if value is not None]


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


# The controller manager (a client of kube-apiserver) first, then kube-apiserver: stopped
# after etcd, it keeps retrying its storage and can outlive the stop; then etcd. Anything
# else after those.
STOP_ORDER = ("kube-controller-manager", "kube-apiserver", "etcd")
# The controllers whose behaviour the mission relies on: the garbage collector (owner
# references), the EndpointSlice controllers (what consumers of a Service see) and the
# Endpoints controller (Prometheus' role endpoints, tests/test_scrape_prometheus.py); the
# namespace controller (a namespace deleted under shared-svc) and the token controller
# (ServiceAccount tokens) so that those behave as in a cluster.
CONTROLLERS = (
    "garbage-collector-controller",
    "endpoints-controller",
    "endpointslice-controller",
    "endpointslice-mirroring-controller",
    "namespace-controller",
    "serviceaccount-token-controller",
)


def process_alive(pid: int, name: str | None = None) -> bool:
    """True while ``pid`` runs. A zombie (exited, not yet reaped) counts as gone. With
    ``name``, a process whose program is something else (the pid was reused) is not it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    proc = Path(f"/proc/{pid}")
    try:
        stat = (proc / "stat").read_text()
        cmdline = (proc / "cmdline").read_bytes()
    except FileNotFoundError:  # exited in between
        return False
    except OSError:  # no /proc (not Linux): the signal check is all there is
        return True
    if stat.rpartition(")")[2].split()[:1] == ["Z"]:
        return False
    if name is not None:
        program = cmdline.split(b"\0", 1)[0].decode(errors="replace")
        return Path(program).name == name
    return True


def stop_processes(pids: dict[str, int], timeout: float = 15.0) -> dict[str, int]:
    """Stops processes started by :func:`start` (by name and pid, each the leader of its own
    process group) one at a time in :data:`STOP_ORDER`: SIGTERM, wait up to ``timeout``,
    then SIGKILL and wait again. Returns the ones still running (empty when all are gone)."""
    order = sorted(pids, key=lambda n: STOP_ORDER.index(n) if n in STOP_ORDER else len(STOP_ORDER))
    left: dict[str, int] = {}
    for name in order:
        pid = pids[name]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not process_alive(pid, name):
                break
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig)
            deadline = time.monotonic() + timeout
            while process_alive(pid, name) and time.monotonic() < deadline:
                time.sleep(0.05)
        if process_alive(pid, name):
            left[name] = pid
    return left


def _terminate(proc: subprocess.Popen[bytes] | None, timeout: float = 15.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)


def start(
    workdir: Path | None = None,
    *,
    crds: bool = True,
    upstream_crds: Path | None = None,
    controller_manager: bool = False,
    version: str | None = None,
    address: str = "127.0.0.1",
    apiserver_flags: Mapping[str, str | None] | None = None,
    controller_manager_flags: Mapping[str, str | None] | None = None,
) -> ControlPlane:
    """Builds (cached) and starts etcd and kube-apiserver; installs the project's CRDs.

    ``version``: the Kubernetes minor to run (default :func:`kube_version`, the run's).

    With ``controller_manager``, also kube-controller-manager running :data:`CONTROLLERS`
    (no kubelet, scheduler or DaemonSet controller: tests play those parts).

    kube-apiserver serves on ``address`` (a local address; the real node's is the host end
    of its veth, testenv/node). ``apiserver_flags`` and ``controller_manager_flags`` replace
    or add flags (``{"--flag": value}``; ``None`` drops the flag), e.g. a cluster owner's
    ``--feature-gates``.

    Raises ControlPlaneError with the reason (and the process log tail) on failure; all
    started processes are stopped before raising.
    """
    minor = version or kube_version()
    bindir = build_binaries(minor)
    owns = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="shared-svc-testenv-")) if workdir is None else workdir
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "certs").mkdir(exist_ok=True)
    sa_key = workdir / "sa.key"
    subprocess.run(
        ["openssl", "genrsa", "-out", str(sa_key), "2048"],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    admin_token = secrets.token_hex(16)
    (workdir / "tokens.csv").write_text(f'{admin_token},admin,admin-uid,"system:masters"\n')

    etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
    etcd_url = f"http://127.0.0.1:{etcd_port}"
    peer_url = f"http://127.0.0.1:{peer_port}"
    etcd_args = [
        str(bindir / "etcd"),
        "--name=testenv",
        f"--data-dir={workdir / 'etcd'}",
        f"--listen-client-urls={etcd_url}",
        f"--advertise-client-urls={etcd_url}",
        f"--listen-peer-urls={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster=testenv={peer_url}",
        "--unsafe-no-fsync",
        "--log-level=warn",
    ]
    apiserver_args = [
        str(bindir / "kube-apiserver"),
        f"--etcd-servers={etcd_url}",
        f"--cert-dir={workdir / 'certs'}",
        f"--secure-port={api_port}",
        f"--bind-address={address}",
        f"--advertise-address={address}",
        # The kubernetes Service gets no endpoints: a loopback address may not be one (1.36
        # logs every failed sync, 1.37 refuses to start with the reconciler on), and nothing
        # here reaches the API server through that Service.
        "--endpoint-reconciler-type=none",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={sa_key}",
        f"--service-account-signing-key-file={sa_key}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--authorization-mode=RBAC",
        "--disable-admission-plugins=ServiceAccount",
        # As in kubeadm clusters: gpu-operator's DaemonSets run privileged containers
        # (without it, its validator DaemonSet is refused and it never reaches state-dcgm).
        "--allow-privileged=true",
        f"--token-auth-file={workdir / 'tokens.csv'}",
        "--event-ttl=1h",
        "--v=1",
    ]
    apiserver_args = with_flags(apiserver_args, apiserver_flags or {})
    cp = ControlPlane(
        workdir=workdir,
        url=f"https://{address}:{api_port}",
        admin_token=admin_token,
        kubeconfig=workdir / "admin.kubeconfig",
        etcd_url=etcd_url,
        kube_version=minor,
        _apiserver_args=apiserver_args,
        _etcd_args=etcd_args,
        _owns_workdir=owns,
    )
    try:
        cp.processes["etcd"] = _spawn(etcd_args, workdir / "etcd.log")
        cp.processes["kube-apiserver"] = _spawn(apiserver_args, workdir / "kube-apiserver.log")
        cp.wait_ready()
        cp.write_kubeconfig(cp.kubeconfig, admin_token, user="admin")
        if crds:
            cp.install_crds(sorted(PROJECT_CRDS.glob("*.yaml")))
        if upstream_crds is not None:
            cp.install_crds(sorted(upstream_crds.glob("*.yaml")))
        if controller_manager:
            cp.start_controller_manager(bindir, sa_key, controller_manager_flags or {})
    except BaseException:
        cp.stop()
        raise
    return cp


@contextlib.contextmanager
def running(**kwargs: Any) -> Iterator[ControlPlane]:
    cp = start(**kwargs)
    try:
        yield cp
    finally:
        cp.stop()
