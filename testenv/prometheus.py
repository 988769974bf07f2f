"""A real Prometheus next to the test control plane, and exporter stand-ins for it to scrape.

Prometheus 3.5.0 is built from its Go module by ``testenv/prometheus/build.sh`` (cached, its
own key and lock), and runs on 127.0.0.1 with the prometheus-community chart's
``kubernetes-service-endpoints`` job (:data:`CHART_RELABEL_CONFIGS`, the chart's relabelling
as it ships) twice: with ``role: endpoints`` and ``role: endpointslice``. Only what connects
it to the test differs from the chart: discovery reads the test API server through a
kubeconfig (its URL, CA and a token), is limited to one namespace, and a short scrape
interval.

kube-apiserver refuses loopback addresses in Endpoints and EndpointSlices, so exporter pods
get ordinary pod IPs (``status.podIP``, never contacted). Each job scrapes through
``proxy_url``: a proxy of its own on 127.0.0.1 (:class:`StandIns`) maps ``podIP:9400`` to the
loopback listener of that pod's stand-in, which serves ``/metrics`` and counts the scrapes of
each job. Synchronous (stdlib threads and :mod:`testenv`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from testenv import TESTENV_DIR, ControlPlane, ControlPlaneError, _spawn, _terminate, free_port
from testenv.builds import cached_build

BUILD_SCRIPT = TESTENV_DIR / "prometheus" / "build.sh"
EXPORTER_PORT = 9400
# The jobs: the chart's job with its own role, and the same with role endpointslice.
JOBS = {
    "kubernetes-service-endpoints": "endpoints",
    "kubernetes-service-endpointslices": "endpointslice",
}
SCRAPE_INTERVAL = "1s"
# The scrape manager's throttle of target updates (a hidden flag; 5 s by default). The
# discovery manager sends its updates every 5 s (fixed), so one discovery refresh is up to
# 5 s + this.
RELOAD_INTERVAL = "1s"
REFRESH_SECONDS = 6.0

# The chart's kubernetes-service-endpoints relabelling (prometheus-community/prometheus
# values.yaml, serverFiles.prometheus.yml), verbatim.
CHART_RELABEL_CONFIGS: list[dict[str, Any]] = yaml.safe_load(
    r"""
- source_labels: [__meta_kubernetes_service_annotation_prometheus_io_scrape]
  action: keep
  regex: true
- source_labels: [__meta_kubernetes_service_annotation_prometheus_io_scrape_slow]
  action: drop
  regex: true
- source_labels: [__meta_kubernetes_service_annotation_prometheus_io_scheme]
  action: replace
  target_label: __scheme__
  regex: (https?)
- source_labels: [__meta_kubernetes_service_annotation_prometheus_io_path]
  action: replace
  target_label: __metrics_path__
  regex: (.+)
- source_labels: [__address__, __meta_kubernetes_service_annotation_prometheus_io_port]
  action: replace
  target_label: __address__
  regex: (.+?)(?::\d+)?;(\d+)
  replacement: $1:$2
- action: labelmap
  regex: __meta_kubernetes_service_annotation_prometheus_io_param_(.+)
  replacement: __param_$1
- action: labelmap
  regex: __meta_kubernetes_service_label_(.+)
- source_labels: [__meta_kubernetes_namespace]
  action: replace
  target_label: namespace
- source_labels: [__meta_kubernetes_service_name]
  action: replace
  target_label: service
- source_labels: [__meta_kubernetes_pod_node_name]
  action: replace
  target_label: node
"""
)


class PrometheusError(ControlPlaneError):
    """Prometheus could not be built or started; the message says why."""


@functools.cache
def build() -> Path:
    """Runs the cached build (``nice -n 10``) once per process; returns the directory holding
    ``prometheus``. ``SHARED_SVC_PROMETHEUS_DIR`` names such a directory instead."""
    return cached_build(
        BUILD_SCRIPT,
        override_env="SHARED_SVC_PROMETHEUS_DIR",
        what="Prometheus",
        error=PrometheusError,
    )


# ---------------------------------------------------------------- exporter stand-ins


class _Server(ThreadingHTTPServer):
    daemon_threads = True


@dataclass
class StandIns:
    """Exporter stand-ins by pod IP, and one scrape proxy per job (:data:`JOBS`)."""

    ports: dict[str, int] = field(default_factory=dict)  # pod IP -> stand-in port
    # (pod IP, port) -> a loopback port that serves that pod's port for real (:meth:`route`)
    routes: dict[tuple[str, int], int] = field(default_factory=dict)
    scrapes: dict[str, Counter[str]] = field(default_factory=dict)  # pod IP -> job -> count
    proxies: dict[str, int] = field(default_factory=dict)  # job -> proxy port
    _servers: list[_Server] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, jobs: tuple[str, ...] = tuple(JOBS)) -> StandIns:
        """One scrape proxy per job of ``jobs`` (the annotation jobs, unless told)."""
        for job in jobs:
            self.proxies[job] = self._serve(self._proxy_handler(job))
        return self

    def add(self, pod_ip: str) -> None:
        """A stand-in for the exporter of the pod with ``pod_ip``."""
        with self._lock:
            if pod_ip in self.ports:
                return
            self.scrapes[pod_ip] = Counter()
        self.ports[pod_ip] = self._serve(self._exporter_handler(pod_ip))

    def route(self, pod_ip: str, port: int, loopback_port: int) -> None:
        """Scrapes of ``pod_ip:port`` go to ``127.0.0.1:loopback_port``: a real server (a
        shared-svc replica's /metrics) in place of a stand-in."""
        self.routes[(pod_ip, port)] = loopback_port

    def count(self, pod_ip: str) -> Counter[str]:
        with self._lock:
            return Counter(self.scrapes.get(pod_ip, Counter()))

    def close(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._servers.clear()

    def _serve(self, handler: type[BaseHTTPRequestHandler]) -> int:
        server = _Server(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self._servers.append(server)
        port: int = server.server_address[1]
        return port

    def _exporter_handler(self, pod_ip: str) -> type[BaseHTTPRequestHandler]:
        owner = self

        class Exporter(_Quiet):
            def do_GET(self) -> None:
                job = self.headers.get("X-Scrape-Job", "direct")
                with owner._lock:
                    owner.scrapes[pod_ip][job] += 1
                body = f'dcgm_stand_in_up{{pod_ip="{pod_ip}"}} 1\n'.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Exporter

    def _proxy_handler(self, job: str) -> type[BaseHTTPRequestHandler]:
        owner = self

        class Proxy(_Quiet):
            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)  # absolute: http://podIP:9400/metrics
                port = owner.routes.get((url.hostname or "", url.port or 80))
                if port is None and url.port == EXPORTER_PORT:
                    port = owner.ports.get(url.hostname or "")
                if port is None:
                    self.send_error(502, f"no stand-in for {url.netloc}")
                    return
                query = f"?{url.query}" if url.query else ""
                req = urllib.request.Request(
                    f"http://127.0.0.1:{port}{url.path}{query}", headers={"X-Scrape-Job": job}
                )
                opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
                with opener.open(req, timeout=5) as resp:
                    body = resp.read()
                    content_type = resp.headers.get("Content-Type", "text/plain")
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Proxy


class _Quiet(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


# ---------------------------------------------------------------- Prometheus


def scrape_config(
    kubeconfig: Path, proxies: dict[str, int], namespace: str | None = None
) -> dict[str, Any]:
    """The two jobs; discovery in ``namespace`` only, or in all (targets carry ``namespace``)."""
    sd: dict[str, Any] = {"kubeconfig_file": str(kubeconfig)}
    if namespace is not None:
        sd["namespaces"] = {"names": [namespace]}
    jobs = [
        {
            "job_name": job,
            "honor_labels": True,
            "scrape_interval": SCRAPE_INTERVAL,
            "scrape_timeout": SCRAPE_INTERVAL,
            "proxy_url": f"http://127.0.0.1:{proxies[job]}",
            "kubernetes_sd_configs": [{"role": role, **sd}],
            "relabel_configs": CHART_RELABEL_CONFIGS,
        }
        for job, role in JOBS.items()
    ]
    return {"global": {"scrape_interval": SCRAPE_INTERVAL}, "scrape_configs": jobs}


@dataclass
class Prometheus:
    url: str
    workdir: Path
    process: subprocess.Popen[bytes]

    def get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(self.url + path + query, timeout=10) as resp:
            body = json.loads(resp.read())
        if body.get("status") != "success":
            raise PrometheusError(f"{path}: {body}")
        return body["data"]

    def active_targets(self) -> list[dict[str, Any]]:
        targets: list[dict[str, Any]] = self.get("/api/v1/targets", state="active")["activeTargets"]
        return targets

    def targets_by_pod_ip(self) -> dict[str, Counter[str]]:
        """job counts of the active targets, by the pod IP of their address."""
        out: dict[str, Counter[str]] = {}
        for t in self.active_targets():
            ip = str(t["discoveredLabels"].get("__address__", "")).rsplit(":", 1)[0]
            out.setdefault(ip, Counter())[t["labels"]["job"]] += 1
        return out

    def reload(self, config: dict[str, Any]) -> None:
        """Writes ``config`` as its configuration and has it reload it (``/-/reload``); a
        configuration it refuses raises, with its log."""
        (self.workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        req = urllib.request.Request(self.url + "/-/reload", method="POST")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(req, timeout=30) as resp:
                resp.read()
        except urllib.error.HTTPError as exc:
            raise PrometheusError(f"reload refused: {exc.read()!r}\n{self.tail()}") from exc

    def up_series(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.get("/api/v1/query", query="up")["result"]
        return result

    def tail(self, lines: int = 30) -> str:
        log = self.workdir / "prometheus.log"
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        _terminate(self.process)
        shutil.rmtree(self.workdir, ignore_errors=True)


def start(
    control_plane: ControlPlane,
    stand_ins: StandIns,
    namespace: str | None = None,
    timeout: float = 60.0,
    *,
    jobs: bool = True,
) -> Prometheus:
    """Prometheus on 127.0.0.1 discovering ``control_plane`` (as its admin; in ``namespace``
    only, when given), scraping through the proxies of ``stand_ins``. ``jobs=False``: no
    scrape jobs until :meth:`Prometheus.reload` brings a configuration (as prometheus-operator's
    config-reloader does)."""
    workdir = Path(tempfile.mkdtemp(prefix="shared-svc-prometheus-"))
    kubeconfig = control_plane.write_kubeconfig(
        workdir / "kubeconfig", control_plane.admin_token, user="prometheus"
    )
    initial = (
        scrape_config(kubeconfig, stand_ins.proxies, namespace)
        if jobs
        else {"global": {"scrape_interval": SCRAPE_INTERVAL}, "scrape_configs": []}
    )
    return _run(workdir, initial, timeout)


def start_with(
    config: dict[str, Any], files: Mapping[str, str] | None = None, timeout: float = 60.0
) -> Prometheus:
    """Prometheus on 127.0.0.1 with ``config`` as its prometheus.yml (for example static
    targets and ``rule_files``), ``files`` (name -> text, such as rule files named there)
    written beside it first."""
    workdir = Path(tempfile.mkdtemp(prefix="shared-svc-prometheus-"))
    for name, text in (files or {}).items():
        (workdir / name).write_text(text)
    return _run(workdir, config, timeout)


def _run(workdir: Path, prometheus_yml: dict[str, Any], timeout: float) -> Prometheus:
    bindir = build()
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_yml))
    port = free_port()
    args = [
        str(bindir / "prometheus"),
        f"--config.file={config}",
        f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        f"--scrape.discovery-reload-interval={RELOAD_INTERVAL}",
        "--web.enable-lifecycle",
        "--log.level=info",
    ]
    # Go never sends requests for loopback addresses through a proxy from the environment.
    proc = _spawn(args, workdir / "prometheus.log")
    prom = Prometheus(f"http://127.0.0.1:{port}", workdir, proc)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise PrometheusError(f"prometheus exited with {proc.returncode}\n{prom.tail()}")
        with contextlib.suppress(OSError, urllib.error.URLError):
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            with opener.open(prom.url + "/-/ready", timeout=5) as resp:
                if resp.status == 200:
                    return prom
        if time.monotonic() > deadline:
            prom.stop()
            raise PrometheusError(f"prometheus not ready after {timeout}s\n{prom.tail()}")
        time.sleep(0.25)
