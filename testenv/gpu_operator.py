"""The real gpu-operator (its ClusterPolicy controller) next to the test control plane.

Built from its Go module by ``testenv/gpu-operator/build.sh`` (cached, a separate step
from the control plane's build), and run as it runs in a cluster, minus the pod:

- in a private mount namespace (``unshare --mount``) with a tmpfs on ``/opt`` holding a
  copy of its states laid out as in its image (the module's ``assets/*`` and
  ``manifests/`` in ``/opt/gpu-operator/``, the hard-coded path it reads them from; the
  host's ``/opt`` is untouched);
- with ``OPERATOR_NAMESPACE``, ``KUBECONFIG`` and ``UNIT_TEST=true`` (its only effect: it
  skips reading the host's ``/host-etc/os-release``);
- under its own ServiceAccount, with the ClusterRole and Role of its Helm chart;
- against a control plane of its own (:func:`start_control_plane`): gpu-operator's own
  ClusterPolicy and NVIDIADriver CRDs (the project's trimmed ClusterPolicy CRD has no
  defaults), the project's GPUCluster and ServiceMonitor CRDs, and no other test's
  cluster-scoped objects for it to reconcile.

There is no kubelet or DaemonSet controller: :func:`add_gpu_node` writes a Node the way a
kubelet and node-feature-discovery would, and :func:`mark_daemonsets` sets the status the
DaemonSet controller would report. Synchronous (stdlib and :mod:`testenv`).

By hand: ``python -m testenv.gpu_operator`` (see docs/development.md).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

import testenv
from testenv import PROJECT_CRDS, TESTENV_DIR, ControlPlane, ControlPlaneError
from testenv.builds import cached_build

BUILD_SCRIPT = TESTENV_DIR / "gpu-operator" / "build.sh"
NAMESPACE = "gpu-operator"
# gpu-operator's gauges of its driver upgrade (controllers/operator_metrics.go; set by its
# upgrade controller in ClusterPolicy mode), which the dashboard shows beside shared-svc's.
UPGRADE_GAUGES = (
    "gpu_operator_nodes_upgrades_done",
    "gpu_operator_nodes_upgrades_in_progress",
    "gpu_operator_nodes_upgrades_failed",
    "gpu_operator_nodes_upgrades_pending",
    "gpu_operator_nodes_upgrades_available",
)
SERVICE_ACCOUNT = "gpu-operator"
CLUSTER_POLICY = "cluster-policy"
GPU_NODE_LABEL = "feature.node.kubernetes.io/pci-10de.present"
# The project's CRDs installed beside gpu-operator's (it ships no GPUCluster CRD at this
# version, and the ServiceMonitor CRD belongs to prometheus-operator).
PROJECT_CRDS_BESIDE = ("nvidia.com_gpuclusters.yaml", "monitoring.coreos.com_servicemonitors.yaml")
# What node-feature-discovery and a kubelet would have put on a GPU node; gpu-operator
# picks the driver image's OS suffix and the container runtime from these.
NODE_LABELS = {
    GPU_NODE_LABEL: "true",
    "feature.node.kubernetes.io/system-os_release.ID": "ubuntu",
    "feature.node.kubernetes.io/system-os_release.VERSION_ID": "22.04",
    "feature.node.kubernetes.io/kernel-version.full": "5.15.0-105-generic",
}
# This gpu-operator version crashes on a node with no annotations at all (a nil map in
# applyDriverAutoUpgradeAnnotation); real nodes always carry some.
NODE_ANNOTATIONS = {"node.alpha.kubernetes.io/ttl": "0"}

_REPO = "nvcr.io/nvidia"
_CLOUD_NATIVE = "nvcr.io/nvidia/cloud-native"
_VALIDATOR = {"repository": _CLOUD_NATIVE, "image": "gpu-operator-validator", "version": "v25.3.4"}


def _image(repository: str, image: str, version: str) -> dict[str, str]:
    return {"repository": repository, "image": image, "version": version}


# A ClusterPolicy with every image set (the chart's values for this version; nothing is
# pulled) and only the DCGM operands on: the validator (always deployed), nvidia-dcgm and
# nvidia-dcgm-exporter. Override with :func:`cluster_policy`.
DEFAULT_SPEC: dict[str, Any] = {
    "operator": {
        "defaultRuntime": "containerd",
        "runtimeClass": "nvidia",
        "initContainer": _image(_REPO, "cuda", "13.0.1-base-ubi9"),
    },
    "daemonsets": {"updateStrategy": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "1"}},
    "validator": dict(_VALIDATOR),
    "driver": {
        "enabled": False,
        **_image(_REPO, "driver", "580.82.07"),
        "manager": _image(_CLOUD_NATIVE, "k8s-driver-manager", "v0.8.1"),
    },
    "toolkit": {"enabled": False, **_image(f"{_REPO}/k8s", "container-toolkit", "v1.17.8")},
    "devicePlugin": {"enabled": False, **_image(_REPO, "k8s-device-plugin", "v0.17.4")},
    "gfd": {"enabled": False, **_image(_REPO, "k8s-device-plugin", "v0.17.4")},
    "migManager": {
        "enabled": False,
        **_image(_CLOUD_NATIVE, "k8s-mig-manager", "v0.12.3-ubuntu20.04"),
    },
    "nodeStatusExporter": {"enabled": False, **_VALIDATOR},
    "dcgm": {"enabled": True, **_image(_CLOUD_NATIVE, "dcgm", "4.3.1-1-ubuntu22.04")},
    "dcgmExporter": {
        "enabled": True,
        **_image(f"{_REPO}/k8s", "dcgm-exporter", "4.3.1-4.4.0-ubuntu22.04"),
    },
    "gds": {"enabled": False},
    "gdrcopy": {"enabled": False},
    "vgpuManager": {"enabled": False},
    "vgpuDeviceManager": {"enabled": False},
    "vfioManager": {"enabled": False},
    "sandboxDevicePlugin": {"enabled": False},
    "kataManager": {"enabled": False},
    "ccManager": {"enabled": False},
    "sandboxWorkloads": {"enabled": False},
    "mig": {"strategy": "single"},
    "cdi": {"enabled": False},
    "psa": {"enabled": False},
}


class GpuOperatorError(ControlPlaneError):
    """gpu-operator could not be built or started; the message says why."""


@functools.cache
def build() -> Path:
    """Runs the cached build (``nice -n 10``: it is heavy) once per process; returns the
    directory holding ``gpu-operator``, ``opt/gpu-operator/`` (its states), ``crds/`` and
    ``rbac/``. ``SHARED_SVC_GPU_OPERATOR_DIR`` names such a directory instead."""
    return cached_build(
        BUILD_SCRIPT,
        override_env="SHARED_SVC_GPU_OPERATOR_DIR",
        what="gpu-operator",
        error=GpuOperatorError,
    )


def start_control_plane(workdir: Path | None = None, **kwargs: Any) -> ControlPlane:
    """A control plane for gpu-operator: :func:`testenv.start` with
    gpu-operator's ClusterPolicy and NVIDIADriver CRDs (from its module) and the project's
    GPUCluster and ServiceMonitor CRDs, instead of the project's set."""
    builddir = build()
    cp = testenv.start(workdir, crds=False, **kwargs)
    try:
        cp.install_crds(
            [
                *sorted((builddir / "crds").glob("*.yaml")),
                *(PROJECT_CRDS / name for name in PROJECT_CRDS_BESIDE),
            ]
        )
    except BaseException:
        cp.stop()
        raise
    return cp


def chart_rbac(builddir: Path, namespace: str) -> list[dict[str, Any]]:
    """The ClusterRole and Role of gpu-operator's chart (its templates, with the chart's
    defaults: no labels, ``operator.cleanupCRD`` off), and their bindings to the
    ServiceAccount ``gpu-operator`` in ``namespace``."""
    docs = [_render(builddir / "rbac" / f"{name}.yaml") for name in ("clusterrole", "role")]
    docs[1]["metadata"]["namespace"] = namespace
    subject = {"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": namespace}
    for role in list(docs):
        binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": f"{role['kind']}Binding",
            "metadata": dict(role["metadata"]),
            "subjects": [subject],
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": role["kind"],
                "name": role["metadata"]["name"],
            },
        }
        docs.append(binding)
    return docs


def _render(path: Path) -> dict[str, Any]:
    """The few template lines of these two files: label includes (dropped) and the
    ``cleanupCRD`` condition (off). Anything else is refused, not guessed."""
    lines: list[str] = []
    skipping = False
    for line in path.read_text().splitlines():
        text = line.strip()
        if text.startswith("{{- if .Values.operator.cleanupCRD"):
            skipping = True
        elif skipping and text.startswith("{{- end"):
            skipping = False
        elif skipping or text.startswith('{{- include "gpu-operator.labels"'):
            continue
        elif "{{" in text:
            raise GpuOperatorError(f"{path}: template line not understood: {text}")
        else:
            lines.append(line)
    doc: dict[str, Any] = yaml.safe_load("\n".join(lines))
    return doc


@dataclass
class GpuOperator:
    """A running gpu-operator. Use :func:`start`, :func:`running` or the pytest fixture."""

    control_plane: ControlPlane
    namespace: str
    builddir: Path
    kubeconfig: Path
    log: Path
    process: subprocess.Popen[bytes]
    health_url: str
    metrics_address: str  # host:port of its /metrics (controller-runtime's, plain HTTP)

    def alive(self) -> bool:
        return self.process.poll() is None

    def tail(self, lines: int = 30) -> str:
        if not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def log_lines(self, since: str = "") -> list[dict[str, Any]]:
        """Its JSON log lines stamped ``since`` (an RFC 3339 second, :func:`now`) or later."""
        lines: list[dict[str, Any]] = []
        if not self.log.exists():
            return lines
        for raw in self.log.read_text(errors="replace").splitlines():
            if raw.startswith("{"):
                with contextlib.suppress(ValueError):
                    line = json.loads(raw)
                    if isinstance(line, dict) and str(line.get("ts", "")) >= since:
                        lines.append(line)
        return lines

    def reconciles(self, since: str = "") -> int:
        """ClusterPolicy reconciles since ``since``: each one logs its state-dcgm step."""
        return sum(
            1
            for line in self.log_lines(since)
            if line.get("msg") == "ClusterPolicy step completed"
            and line.get("state:") == "state-dcgm"
        )

    def updates(self, since: str = "") -> Counter[str]:
        """Its whole-object updates of Services since ``since``, by name (as logged)."""
        return Counter(
            str(line.get("Service"))
            for line in self.log_lines(since)
            if line.get("msg") == "Found Resource, updating..." and "Service" in line
        )

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM to its process group (the mount namespace goes with it), SIGKILL after
        ``timeout``."""
        proc = self.process
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if proc.poll() is not None:
                return
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout)

    def __enter__(self) -> GpuOperator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# In the new mount namespace: a tmpfs on /opt, a copy of the states (real directories:
# symlinked ones make it panic), then gpu-operator in place of the shell.
_LAUNCH = 'set -e; mount -t tmpfs tmpfs /opt; cp -R "$1/opt/gpu-operator" /opt/; shift; exec "$@"'


def start(
    cp: ControlPlane,
    *,
    namespace: str = NAMESPACE,
    builddir: Path | None = None,
    extra_args: Iterable[str] = (),
    timeout: float = 60.0,
    upgrade_controller: bool = True,
) -> GpuOperator:
    """Starts gpu-operator against ``cp`` (built by :func:`start_control_plane`) and waits
    until it serves ``/readyz``. Its log is ``<cp.workdir>/gpu-operator.log`` (JSON lines).
    ``upgrade_controller=False`` runs the build without its upgrade controller
    (``testenv/gpu-operator/no-upgrade/``: next to ``testenv/upgrade-libs/``, which plays
    gpu-operator v26.7.0's). Raises :class:`GpuOperatorError` with the log's tail if it
    exits or is not ready."""
    builddir = builddir or build()
    if not (builddir / "opt" / "gpu-operator" / "state-dcgm").is_dir():
        raise GpuOperatorError(f"{builddir}: no opt/gpu-operator/state-dcgm (not a build)")
    cp.ensure_namespace(namespace)
    cp.apply_manifests(chart_rbac(builddir, namespace))
    token = cp.service_account_token(namespace, SERVICE_ACCOUNT, seconds=7 * 24 * 3600)
    kubeconfig = cp.write_kubeconfig(
        cp.workdir / "gpu-operator.kubeconfig", token, user=SERVICE_ACCOUNT
    )
    health = f"127.0.0.1:{testenv.free_port()}"
    metrics = f"127.0.0.1:{testenv.free_port()}"
    args = [
        "unshare",
        "--mount",
        "--propagation=private",
        "sh",
        "-c",
        _LAUNCH,
        "gpu-operator",
        str(builddir),
        str(builddir / ("gpu-operator" if upgrade_controller else "gpu-operator-no-upgrade")),
        f"--metrics-bind-address={metrics}",
        f"--health-probe-bind-address={health}",
        "--leader-elect=false",
        *extra_args,
    ]
    env = {
        **os.environ,
        "OPERATOR_NAMESPACE": namespace,
        "KUBECONFIG": str(kubeconfig),
        "UNIT_TEST": "true",
    }
    log = cp.workdir / "gpu-operator.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    op = GpuOperator(
        cp, namespace, builddir, kubeconfig, log, proc, f"http://{health}/readyz", metrics
    )
    try:
        _wait_ready(op, timeout)
    except BaseException:
        op.stop()
        raise
    return op


def _wait_ready(op: GpuOperator, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if not op.alive():
            raise GpuOperatorError(
                f"gpu-operator exited with {op.process.returncode}; log {op.log}:\n{op.tail()}"
            )
        with contextlib.suppress(OSError), urllib.request.urlopen(op.health_url, timeout=5) as r:
            if r.status == 200:
                return
        if time.monotonic() > deadline:
            raise GpuOperatorError(
                f"gpu-operator not ready after {timeout}s; log {op.log}:\n{op.tail()}"
            )
        time.sleep(0.2)


@contextlib.contextmanager
def running(cp: ControlPlane, **kwargs: Any) -> Iterator[GpuOperator]:
    op = start(cp, **kwargs)
    try:
        yield op
    finally:
        op.stop()


# --- the cluster around it -------------------------------------------------------------

_T = TypeVar("_T")


def wait_for(check: Callable[[], _T], timeout: float = 30.0, what: str = "condition") -> _T:
    """Polls ``check`` until it returns a truthy value and returns it; raises
    AssertionError naming ``what`` and the last value after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s; last value: {last!r}")
        time.sleep(0.2)


def now() -> str:
    """The current second as gpu-operator stamps its log lines (``ts``)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def apiserver_requests(cp: ControlPlane) -> list[tuple[dict[str, str], int]]:
    """The API server's own ``apiserver_request_total`` (its ``/metrics``): each series'
    labels and count."""
    status, text = cp.request("GET", "/metrics")
    if status != 200:
        raise ControlPlaneError(f"/metrics: {status} {text}")
    out = []
    for line in str(text).splitlines():
        if line.startswith("apiserver_request_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            out.append((labels, int(float(line.rsplit(" ", 1)[1]))))
    return out


def request_counts(cp: ControlPlane, resource: str = "services") -> Counter[tuple[str, str]]:
    """The API server's own count of requests on ``resource`` (no subresources, no dry
    runs: shared-svc's guard probe changes nothing): (verb, code) -> count. Subtract two
    counts for what happened between."""
    out: Counter[tuple[str, str]] = Counter()
    for labels, n in apiserver_requests(cp):
        if (
            labels.get("resource") == resource
            and not labels.get("subresource")
            and not labels.get("dry_run")
        ):
            out[labels.get("verb", ""), labels.get("code", "")] += n
    return out


def _ok(status: int, body: Any, what: str) -> Any:
    if status >= 300:
        raise ControlPlaneError(f"{what}: {status} {body}")
    return body


def add_gpu_node(
    cp: ControlPlane,
    name: str,
    *,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Creates a Node as a GPU node's kubelet and node-feature-discovery would (the PCI
    label, OS and kernel labels, an annotation, ``Ready``, containerd); returns it."""
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, **NODE_LABELS, **(labels or {})},
            "annotations": {**NODE_ANNOTATIONS, **(annotations or {})},
        },
    }
    _ok(*cp.request("POST", "/api/v1/nodes", node), f"create node {name}")
    status = {
        "status": {
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "lastHeartbeatTime": _now(),
                    "lastTransitionTime": _now(),
                }
            ],
            "nodeInfo": {
                "architecture": "amd64",
                "bootID": "",
                "containerRuntimeVersion": "containerd://1.7.27",
                "kernelVersion": NODE_LABELS["feature.node.kubernetes.io/kernel-version.full"],
                "kubeProxyVersion": "",
                "kubeletVersion": "v1.36.3",
                "machineID": "",
                "operatingSystem": "linux",
                "osImage": "Ubuntu 22.04.5 LTS",
                "systemUUID": "",
            },
        }
    }
    updated: dict[str, Any] = _ok(
        *cp.request(
            "PATCH",
            f"/api/v1/nodes/{name}/status",
            status,
            content_type="application/merge-patch+json",
        ),
        f"status of node {name}",
    )
    return updated


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` merged in, maps recursively (a copy; ``None`` deletes)."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def cluster_policy(
    spec: dict[str, Any] | None = None, *, name: str = CLUSTER_POLICY
) -> dict[str, Any]:
    """A ClusterPolicy: :data:`DEFAULT_SPEC` with ``spec`` merged in (:func:`deep_merge`),
    e.g. ``cluster_policy({"dcgm": {"enabled": False}})``."""
    return {
        "apiVersion": "nvidia.com/v1",
        "kind": "ClusterPolicy",
        "metadata": {"name": name},
        "spec": deep_merge(DEFAULT_SPEC, spec or {}),
    }


def apply_cluster_policy(
    cp: ControlPlane, spec: dict[str, Any] | None = None, *, name: str = CLUSTER_POLICY
) -> dict[str, Any]:
    """Server-side applies :func:`cluster_policy` (field manager ``testenv``; a later
    apply replaces the spec fields an earlier one set); returns the policy."""
    policy = cluster_policy(spec, name=name)
    cp.apply_manifests([policy])
    return policy


def cluster_policy_status(cp: ControlPlane, name: str = CLUSTER_POLICY) -> dict[str, Any]:
    """The ClusterPolicy's ``status`` (``{}`` when it has none or does not exist)."""
    status, body = cp.request("GET", f"/apis/nvidia.com/v1/clusterpolicies/{name}")
    result: dict[str, Any] = body.get("status", {}) if status == 200 else {}
    return result


def daemonsets(cp: ControlPlane, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = _ok(
        *cp.request("GET", f"/apis/apps/v1/namespaces/{namespace}/daemonsets"),
        f"daemonsets in {namespace}",
    )["items"]
    return items


def _selects(node: dict[str, Any], ds: dict[str, Any]) -> bool:
    """The DaemonSet's nodeSelector (the only placement gpu-operator uses) matches."""
    selector = ds["spec"]["template"]["spec"].get("nodeSelector") or {}
    labels = node["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def mark_daemonsets(
    cp: ControlPlane,
    namespace: str = NAMESPACE,
    *,
    ready: bool = True,
    names: Iterable[str] | None = None,
) -> dict[str, int]:
    """Plays the DaemonSet controller's status for gpu-operator's DaemonSets (all in
    ``namespace``, or ``names``): scheduled on every Node its nodeSelector matches, rolled
    out to the current generation, and every pod available (``ready``) or none.
    Returns each DaemonSet's desired count. (Status only: for an ``OnDelete`` DaemonSet
    gpu-operator also wants pods of the current revision, which this does not create.)"""
    wanted = set(names) if names is not None else None
    nodes = _ok(*cp.request("GET", "/api/v1/nodes"), "nodes")["items"]
    desired: dict[str, int] = {}
    for ds in daemonsets(cp, namespace):
        name = ds["metadata"]["name"]
        if wanted is not None and name not in wanted:
            continue
        count = sum(1 for node in nodes if _selects(node, ds))
        up = count if ready else 0
        status = {
            "observedGeneration": ds["metadata"].get("generation", 1),
            "desiredNumberScheduled": count,
            "currentNumberScheduled": count,
            "updatedNumberScheduled": count,
            "numberMisscheduled": 0,
            "numberReady": up,
            "numberAvailable": up,
            "numberUnavailable": count - up,
        }
        _ok(
            *cp.request(
                "PATCH",
                f"/apis/apps/v1/namespaces/{namespace}/daemonsets/{name}/status",
                {"status": status},
                content_type="application/merge-patch+json",
            ),
            f"status of daemonset {name}",
        )
        desired[name] = count
    missing = sorted(wanted - desired.keys()) if wanted is not None else []
    if missing:
        raise ControlPlaneError(f"no such daemonsets in {namespace}: {missing}")
    return desired


def main(argv: list[str] | None = None) -> int:
    """By hand: a control plane, gpu-operator, one GPU node and the default ClusterPolicy;
    marks the DaemonSets ready as they appear, until Ctrl-C."""
    del argv
    cp = start_control_plane()
    try:
        with running(cp) as op:
            add_gpu_node(cp, "gpu-node-0")
            apply_cluster_policy(cp)
            print(f"kubeconfig (admin): {cp.kubeconfig}", flush=True)
            print(f"gpu-operator log:   {op.log}", flush=True)
            print("Ctrl-C stops everything", flush=True)
            state = None
            while op.alive():
                if daemonsets(cp):
                    mark_daemonsets(cp)
                new = cluster_policy_status(cp).get("state")
                if new != state:
                    print(f"ClusterPolicy {CLUSTER_POLICY}: {new}", flush=True)
                    state = new
                time.sleep(2)
            print(f"gpu-operator exited:\n{op.tail()}", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        return 0
    except ControlPlaneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        cp.stop()


if __name__ == "__main__":
    sys.exit(main())
