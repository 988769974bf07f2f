"""The real prometheus-operator next to the test control plane, and the real Prometheus fed the
configuration it renders from the ServiceMonitors.

prometheus-operator v0.85.0 is built from its Go module by ``testenv/prometheus-operator/build.sh``
(cached, its own key and lock; its CRDs come with the build). It runs on 127.0.0.1 against the
test API server as its admin (``KUBECONFIG``), watches the ``Prometheus`` resource of a test
(:func:`prometheus_resource`) and the ServiceMonitors its selectors select, and writes the
Prometheus configuration into the Secret ``prometheus-<name>`` (``prometheus.yaml.gz``), as in a
cluster, and the rule files of the PrometheusRules it selects into the ConfigMaps
``prometheus-<name>-rulefiles-<n>``. No kubelet runs its StatefulSet: :class:`ConfigReloader`
plays the config-reloader sidecar, copying each new version of that configuration (and the
rule files, as the StatefulSet mounts them) to the real Prometheus of
``testenv/prometheus.py`` and asking it to reload, with ``$(POD_NAME)`` and ``$(SHARD)`` expanded
as the sidecar does. What the operator renders is kept as it is (the ServiceMonitors' relabelling,
job names, ``jobLabel``, discovery roles, sharding), except what connects it to the test: each
scrape job gets the stand-ins' ``proxy_url``, as the annotation jobs of ``testenv/prometheus.py``
do. The ``Prometheus`` resource's ``apiserverConfig`` gives its
discovery the test API server's URL, CA and a token file. Synchronous (stdlib threads).
"""

from __future__ import annotations

import base64
import functools
import gzip
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from testenv import TESTENV_DIR, ControlPlane, _spawn, _terminate, free_port
from testenv.builds import cached_build
from testenv.prometheus import SCRAPE_INTERVAL, Prometheus, PrometheusError

BUILD_SCRIPT = TESTENV_DIR / "prometheus-operator" / "build.sh"
NAME = "k8s"  # the Prometheus resource of a test: its Secret is prometheus-k8s
PROMETHEUS_VERSION = "v3.5.0"  # the Prometheus testenv/prometheus/build.sh builds


@functools.cache
def build() -> Path:
    """Runs the cached build (``nice -n 10``) once per process; returns the directory holding
    ``operator`` and ``crds/``. ``SHARED_SVC_PROMETHEUS_OPERATOR_DIR`` names such a directory
    instead."""
    return cached_build(
        BUILD_SCRIPT,
        override_env="SHARED_SVC_PROMETHEUS_OPERATOR_DIR",
        what="prometheus-operator",
        error=PrometheusError,
    )


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading the YAML 1.1 "value" tag as the plain string it is in
    YAML 1.2 (its CRDs list the operator ``=`` unquoted)."""


def _value(loader: _Loader, node: yaml.Node) -> Any:
    return loader.construct_scalar(node)  # type: ignore[arg-type]


_Loader.add_constructor("tag:yaml.org,2002:value", _value)


def install_crds(control_plane: ControlPlane) -> list[str]:
    """prometheus-operator's own CRDs (its ServiceMonitor CRD replaces the project's)."""
    docs: list[dict[str, Any]] = []
    for path in sorted((build() / "crds").glob("*.yaml")):
        docs.extend(d for d in yaml.load_all(path.read_text(), Loader=_Loader) if d)
    control_plane.apply_manifests(docs)
    names = [d["metadata"]["name"] for d in docs]
    control_plane.wait_established(names)
    return names


@dataclass
class Operator:
    workdir: Path
    process: subprocess.Popen[bytes]

    def alive(self) -> bool:
        return self.process.poll() is None

    def tail(self, lines: int = 30) -> str:
        log = self.workdir / "operator.log"
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        _terminate(self.process)
        shutil.rmtree(self.workdir, ignore_errors=True)


def start(control_plane: ControlPlane, timeout: float = 60.0) -> Operator:
    """prometheus-operator on 127.0.0.1 against ``control_plane`` (as its admin, all
    namespaces; no kubelet Endpoints), up when its metrics endpoint answers."""
    bindir = build()
    workdir = Path(tempfile.mkdtemp(prefix="shared-svc-prometheus-operator-"))
    port = free_port()
    args = [
        "env",
        f"KUBECONFIG={control_plane.kubeconfig}",
        str(bindir / "operator"),
        f"--web.listen-address=127.0.0.1:{port}",
        "--log-level=info",
    ]
    op = Operator(workdir, _spawn(args, workdir / "operator.log"))
    deadline = time.monotonic() + timeout
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while True:
        if not op.alive():
            raise PrometheusError(f"prometheus-operator exited\n{op.tail()}")
        try:
            with opener.open(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                if resp.status == 200:
                    return op
        except (OSError, urllib.error.URLError):
            pass
        if time.monotonic() > deadline:
            op.stop()
            raise PrometheusError(f"prometheus-operator not up after {timeout}s\n{op.tail()}")
        time.sleep(0.25)


def prometheus_resource(
    control_plane: ControlPlane, namespace: str, workdir: Path
) -> dict[str, Any]:
    """A ``Prometheus`` in ``namespace`` that selects every ServiceMonitor of its namespace,
    scrapes every second, and discovers through the test API server (token and CA files in
    ``workdir``, read by the real Prometheus on this machine)."""
    token = workdir / "token"
    token.write_text(control_plane.admin_token)
    ca = workdir / "ca.crt"
    shutil.copy(control_plane.workdir / "certs" / "apiserver.crt", ca)
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "Prometheus",
        "metadata": {"name": NAME, "namespace": namespace},
        "spec": {
            "version": PROMETHEUS_VERSION,
            "replicas": 1,
            "serviceMonitorSelector": {},  # every ServiceMonitor of its own namespace
            "ruleSelector": {},  # every PrometheusRule of its own namespace
            "scrapeInterval": SCRAPE_INTERVAL,
            "scrapeTimeout": SCRAPE_INTERVAL,
            "evaluationInterval": SCRAPE_INTERVAL,
            "apiserverConfig": {
                "host": control_plane.url,
                "bearerTokenFile": str(token),
                "tlsConfig": {"caFile": str(ca)},
            },
        },
    }


def rendered(control_plane: ControlPlane, namespace: str) -> bytes | None:
    """The configuration prometheus-operator wrote for the test's Prometheus (gzip), or None."""
    code, secret = control_plane.request(
        "GET", f"/api/v1/namespaces/{namespace}/secrets/prometheus-{NAME}"
    )
    if code != 200:
        return None
    data = (secret.get("data") or {}).get("prometheus.yaml.gz")
    return base64.b64decode(data) if data else None


# Where the StatefulSet mounts the rule ConfigMaps (prometheus-<name>-rulefiles-<n>), as the
# configuration's rule_files name them.
RULES_DIR = "/etc/prometheus/rules/"


def rule_files(control_plane: ControlPlane, namespace: str) -> dict[str, dict[str, str]]:
    """The rule ConfigMaps prometheus-operator wrote for the test's Prometheus, from the
    PrometheusRules it selects: ConfigMap name -> file name -> rules (YAML)."""
    code, body = control_plane.request(
        "GET",
        f"/api/v1/namespaces/{namespace}/configmaps?labelSelector=prometheus-name%3D{NAME}",
    )
    if code != 200:
        return {}
    return {
        cm["metadata"]["name"]: dict(cm.get("data") or {})
        for cm in body.get("items") or []
        if cm["metadata"]["name"].startswith(f"prometheus-{NAME}-rulefiles-")
    }


# What the config-reloader's environment gives the configuration's ``$(NAME)`` references in
# the StatefulSet prometheus-operator writes: the pod's name, and its ordinal as the shard.
RELOADER_ENV = {"POD_NAME": f"prometheus-{NAME}-0", "SHARD": "0"}
_ENV_REFERENCE = re.compile(r"\$\(([a-zA-Z_0-9]+)\)")


def expanded(text: str) -> str:
    """``$(NAME)`` replaced from :data:`RELOADER_ENV`, as the config-reloader expands its
    environment (thanos' reloader); an unknown name raises, as there."""

    def value(match: re.Match[str]) -> str:
        if match[1] not in RELOADER_ENV:
            raise PrometheusError(
                f"the configuration references $({match[1]}), not in the reloader's environment"
            )
        return RELOADER_ENV[match[1]]

    return _ENV_REFERENCE.sub(value, text)


def connected(config: dict[str, Any], proxy_port: int) -> dict[str, Any]:
    """The operator's configuration with what connects it to the test: each scrape job
    through the stand-ins' proxy (pod IPs are never contacted)."""
    for job in config.get("scrape_configs") or []:
        job["proxy_url"] = f"http://127.0.0.1:{proxy_port}"
    return config


@dataclass
class ConfigReloader:
    """prometheus-operator's config-reloader sidecar, for one test: each new version of the
    rendered configuration goes to ``prometheus`` (:func:`connected`), then ``/-/reload``."""

    control_plane: ControlPlane
    namespace: str
    prometheus: Prometheus
    proxy_port: int
    interval: float = 0.25
    reloads: int = 0
    jobs: list[str] = field(default_factory=list)  # the scrape jobs of the last reload
    error: str | None = None
    _last: bytes | None = None
    _rules: dict[str, dict[str, str]] | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sync(self) -> bool:
        """Copies a new version, if any, with the rule files it names (the operator's rule
        ConfigMaps, as the StatefulSet mounts them); True when Prometheus reloaded."""
        data = rendered(self.control_plane, self.namespace)
        rules = rule_files(self.control_plane, self.namespace)
        if data is None or (data, rules) == (self._last, self._rules):
            return False
        text = expanded(gzip.decompress(data).decode())
        config = connected(yaml.safe_load(text) or {}, self.proxy_port)
        mounted = self.prometheus.workdir / "rules"
        shutil.rmtree(mounted, ignore_errors=True)
        for configmap, files in rules.items():
            (mounted / configmap).mkdir(parents=True)
            for name, rules_text in files.items():
                (mounted / configmap / name).write_text(rules_text)
        config["rule_files"] = [
            f"{mounted}/{str(f).removeprefix(RULES_DIR)}" for f in config.get("rule_files") or []
        ]
        self.prometheus.reload(config)
        self._last, self._rules = data, rules
        self.reloads += 1
        self.jobs = [str(j.get("job_name")) for j in config.get("scrape_configs") or []]
        return True

    def start(self) -> ConfigReloader:
        def loop() -> None:
            while not self._stop.wait(self.interval):
                try:
                    self.sync()
                    self.error = None
                except Exception as exc:  # the test reads it; the loop goes on
                    self.error = f"{type(exc).__name__}: {exc}"[:2000]

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
