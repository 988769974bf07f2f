"""The real driver-upgrade state machine of gpu-operator v26.7.0 next to a test control plane.

``testenv/upgrade-libs/`` is a small Go module that runs github.com/NVIDIA/k8s-operator-libs'
upgrade state manager at the pseudo-version gpu-operator v26.7.0 vendors
(``v0.0.0-20260629200812-d720f2557494``), configured as gpu-operator configures it (driver
name ``gpu``, pod deletion with gpu-operator's filter, validation by
``app=nvidia-operator-validator``, and gpu-operator's restart-only rule: equal
``DRIVER_CONFIG_DIGEST`` env of the running driver pod and the DaemonSet template), reading
the upgrade policy gpu-operator v26.7.0 reads (the ClusterPolicy's ``spec.driver.upgradePolicy``
in ClusterPolicy mode; in NVIDIADriver mode, ``useNvidiaDriverCRD`` or no ClusterPolicy, each
NVIDIADriver's ``spec.upgradePolicy`` for the nodes labelled with its name) and requeueing
every 2 minutes as gpu-operator's upgrade controller does (its main.go says what is played
and what not).
Built by ``testenv/upgrade-libs/build.sh`` (cached, its own key and lock), run as the
admin of the control plane; the DaemonSet controller, kubelet and driver-manager around
it are the tests' (``tests/upgrade_flow.py``). It watches NVIDIADrivers, as gpu-operator
v26.7.0 does in every mode: their CRD (``tests/data/upstream-crds/``) must be installed
first, as gpu-operator's chart always does. Synchronous (stdlib and :mod:`testenv`).
"""

from __future__ import annotations

import contextlib
import functools
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testenv import TESTENV_DIR, ControlPlane, ControlPlaneError, _spawn, _terminate, free_port
from testenv.builds import cached_build

BUILD_SCRIPT = TESTENV_DIR / "upgrade-libs" / "build.sh"
NAMESPACE = "gpu-operator"
CLUSTER_POLICY = "cluster-policy"  # the name the tests give the ClusterPolicy


class UpgradeLibsError(ControlPlaneError):
    """The upgrade-libs driver could not be built or started; the message says why."""


@functools.cache
def build() -> Path:
    """Runs the cached build (``nice -n 10``) once per process; returns the directory
    holding ``upgrade-libs``. ``SHARED_SVC_UPGRADE_LIBS_DIR`` names such a directory instead."""
    return cached_build(
        BUILD_SCRIPT,
        override_env="SHARED_SVC_UPGRADE_LIBS_DIR",
        what="upgrade-libs",
        error=UpgradeLibsError,
    )


@dataclass
class UpgradeLibs:
    """A running driver of the libs' state machine. Use :func:`start` or :func:`running`."""

    log: Path
    process: Any  # subprocess.Popen[bytes]
    health_url: str

    def alive(self) -> bool:
        return self.process.poll() is None

    def tail(self, lines: int = 30) -> str:
        if not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        _terminate(self.process)


def start(
    cp: ControlPlane,
    *,
    namespace: str = NAMESPACE,
    requeue_seconds: float = 120.0,
    timeout: float = 60.0,
) -> UpgradeLibs:
    """Starts the driver against ``cp`` and waits until it serves ``/readyz``. Its log is
    ``<cp.workdir>/upgrade-libs.log`` (JSON lines). Raises :class:`UpgradeLibsError` with
    the log's tail if it exits or is not ready in time."""
    binary = build() / "upgrade-libs"
    health = f"127.0.0.1:{free_port()}"
    args = [
        str(binary),
        f"--kubeconfig={cp.kubeconfig}",
        f"--namespace={namespace}",
        f"--requeue={requeue_seconds:g}s",
        f"--health-probe-bind-address={health}",
        "--zap-encoder=json",
    ]
    log = cp.workdir / "upgrade-libs.log"
    libs = UpgradeLibs(log, _spawn(args, log), f"http://{health}/readyz")
    deadline = time.monotonic() + timeout
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while True:
        if not libs.alive():
            raise UpgradeLibsError(
                f"upgrade-libs exited with {libs.process.returncode}; log {log}:\n{libs.tail()}"
            )
        with contextlib.suppress(OSError), opener.open(libs.health_url, timeout=5) as resp:
            if resp.status == 200:
                return libs
        if time.monotonic() > deadline:
            libs.stop()
            raise UpgradeLibsError(
                f"upgrade-libs not ready after {timeout}s; log {log}:\n{libs.tail()}"
            )
        time.sleep(0.2)


@contextlib.contextmanager
def running(cp: ControlPlane, **kwargs: Any) -> Iterator[UpgradeLibs]:
    libs = start(cp, **kwargs)
    try:
        yield libs
    finally:
        libs.stop()
