"""``python -m testenv start|stop|status``: the test control plane, by hand.

``start`` leaves etcd and kube-apiserver running in the background and prints the
admin kubeconfig path; ``stop`` ends them (kube-apiserver first, then etcd; SIGKILL after
a grace period) and removes their directory only once both are gone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Any

import testenv
from shared_svc.errors import UsageError

DEFAULT_DIR = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shared-svc" / "testenv-run"
)


def register(subparsers: Any) -> None:
    """Adds ``start``, ``stop`` and ``status`` to ``subparsers``."""
    for name, handler, text in (
        ("start", _start, "start the control plane in the background; print its kubeconfig path"),
        ("stop", _stop, "stop the control plane and remove its directory"),
        ("status", _status, "show whether the control plane runs"),
    ):
        p = subparsers.add_parser(name, help=text)
        p.add_argument(
            "--dir", type=Path, default=DEFAULT_DIR, help=f"state directory (default {DEFAULT_DIR})"
        )
        if name == "start":
            p.add_argument(
                "--controller-manager",
                action="store_true",
                help="also run kube-controller-manager (garbage collector, EndpointSlices)",
            )
            p.add_argument(
                "--kube-version",
                metavar="MINOR",
                help=f"Kubernetes version ({', '.join(testenv.kube_versions())}; default "
                f"${testenv.KUBE_VERSION_ENV}, else {testenv.DEFAULT_KUBE_VERSION})",
            )
        if name == "stop":
            p.add_argument(
                "--timeout",
                type=float,
                default=15.0,
                metavar="SECONDS",
                help="wait this long for each process after SIGTERM, then SIGKILL (default 15)",
            )
        p.set_defaults(handler=handler)


def _state_file(directory: Path) -> Path:
    return directory / "state.json"


def _load(directory: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(_state_file(directory).read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise UsageError(
            f"{_state_file(directory)} is corrupt ({exc}); remove the directory"
        ) from exc
    return data


def _alive(state: dict[str, Any]) -> dict[str, bool]:
    return {name: testenv.process_alive(pid, name) for name, pid in state["pids"].items()}


def _kill(directory: Path, state: dict[str, Any], timeout: float = 15.0) -> None:
    """Stops the processes of ``state``; raises (leaving the directory) if one survives."""
    left = testenv.stop_processes(state["pids"], timeout=timeout)
    if left:
        running = ", ".join(f"{name} (pid {pid})" for name, pid in left.items())
        raise UsageError(f"{running} still running after SIGKILL; {directory} left in place")


def _start(args: argparse.Namespace) -> int:
    state = _load(args.dir)
    if state and all(_alive(state).values()):
        print(state["kubeconfig"])
        return 0
    if state:
        _kill(args.dir, state)
    try:
        if args.kube_version:
            os.environ[testenv.KUBE_VERSION_ENV] = args.kube_version
        cp = testenv.start(workdir=args.dir / "cp", controller_manager=args.controller_manager)
    except testenv.ControlPlaneError as exc:
        raise UsageError(str(exc)) from exc
    try:
        version = cp.server_version()
    except testenv.ControlPlaneError as exc:
        cp.stop()
        raise UsageError(str(exc)) from exc
    state = {
        "url": cp.url,
        "kubeVersion": version,
        "kubeconfig": str(cp.kubeconfig),
        "workdir": str(cp.workdir),
        "pids": {name: proc.pid for name, proc in cp.processes.items()},
    }
    _state_file(args.dir).write_text(json.dumps(state, indent=2))
    print(cp.kubeconfig)
    return 0


def _stop(args: argparse.Namespace) -> int:
    state = _load(args.dir)
    if state is None:
        print("not running")
        return 0
    _kill(args.dir, state, args.timeout)
    shutil.rmtree(args.dir, ignore_errors=True)
    print("stopped")
    return 0


def _status(args: argparse.Namespace) -> int:
    state = _load(args.dir)
    if state is None:
        print("not running")
        return 1
    alive = _alive(state)
    print(
        json.dumps(
            {
                "url": state["url"],
                "kubeVersion": state.get("kubeVersion"),
                "kubeconfig": state["kubeconfig"],
                "running": alive,
            },
            indent=2,
        )
    )
    return 0 if all(alive.values()) else 1
