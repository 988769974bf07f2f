"""``shared-svc testenv start|stop|status``: the test control plane, by hand.

``start`` leaves etcd and kube-apiserver running in the background and prints the
admin kubeconfig path; ``stop`` ends them and removes their directory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
from pathlib import Path
from typing import Any

from shared_svc import testenv
from shared_svc.errors import UsageError

DEFAULT_DIR = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shared-svc" / "testenv-run"
)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "testenv", help="start/stop the embedded test control plane (etcd + kube-apiserver)"
    )
    sub = parser.add_subparsers(dest="testenv_command", metavar="ACTION", required=True)
    for name, handler, text in (
        ("start", _start, "start in the background and print the kubeconfig path"),
        ("stop", _stop, "stop and remove"),
        ("status", _status, "show whether it runs"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument(
            "--dir", type=Path, default=DEFAULT_DIR, help=f"state directory (default {DEFAULT_DIR})"
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _start(args: argparse.Namespace) -> int:
    state = _load(args.dir)
    if state and all(_alive(p) for p in state["pids"].values()):
        print(state["kubeconfig"])
        return 0
    if state:
        _kill(state)
    try:
        cp = testenv.start(workdir=args.dir / "cp")
    except testenv.ControlPlaneError as exc:
        raise UsageError(str(exc)) from exc
    state = {
        "url": cp.url,
        "kubeconfig": str(cp.kubeconfig),
        "workdir": str(cp.workdir),
        "pids": {name: proc.pid for name, proc in cp.processes.items()},
    }
    _state_file(args.dir).write_text(json.dumps(state, indent=2))
    print(cp.kubeconfig)
    return 0


def _kill(state: dict[str, Any]) -> None:
    for pid in state["pids"].values():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGTERM)


def _stop(args: argparse.Namespace) -> int:
    state = _load(args.dir)
    if state is None:
        print("not running")
        return 0
    _kill(state)
    import shutil
    import time

    deadline = time.monotonic() + 15
    while any(_alive(p) for p in state["pids"].values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    shutil.rmtree(args.dir, ignore_errors=True)
    print("stopped")
    return 0


def _status(args: argparse.Namespace) -> int:
    state = _load(args.dir)
    if state is None:
        print("not running")
        return 1
    alive = {name: _alive(pid) for name, pid in state["pids"].items()}
    print(
        json.dumps(
            {"url": state["url"], "kubeconfig": state["kubeconfig"], "running": alive}, indent=2
        )
    )
    return 0 if all(alive.values()) else 1
