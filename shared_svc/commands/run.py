"""``shared-svc run``: the long-running service. Flags override the environment."""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import signal
import sys
from typing import Any

from pydantic import ValidationError

from shared_svc import __version__
from shared_svc.config import Config
from shared_svc.errors import UsageError

log = logging.getLogger("shared_svc")

# Settings never logged as they are (none holds a credential today; the kubeconfig is a path).
_SECRET = re.compile(r"token|password|secret|credential", re.IGNORECASE)


def _bool(value: str) -> bool:
    lowered = value.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


# flag -> (Config field, argparse kwargs). The configuration reference in
# docs/configuration.md lists the same fields; a test keeps them in step.
FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "--namespace": ("namespace", {}),
    "--selector-mode": ("selector_mode", {"choices": ["auto", "app"]}),
    "--adopt": ("adopt", {"type": _bool, "metavar": "BOOL"}),
    "--services-controller": ("services_controller", {"type": _bool, "metavar": "BOOL"}),
    "--upgrade-controller": ("upgrade_controller", {"type": _bool, "metavar": "BOOL"}),
    "--dry-run": ("dry_run", {"type": _bool, "metavar": "BOOL", "nargs": "?", "const": True}),
    "--kubeconfig": ("kubeconfig", {}),
    "--pod-name": ("pod_name", {}),
    "--bind-address": ("bind_address", {}),
    "--port": ("port", {"type": int}),
    "--leader-election": ("leader_election", {"type": _bool, "metavar": "BOOL"}),
    "--lease-name": ("lease_name", {}),
    "--resync-seconds": ("resync_seconds", {"type": float}),
    "--log-level": ("log_level", {"choices": ["DEBUG", "INFO", "WARNING", "ERROR"]}),
    "--upgrade-driver-name": ("upgrade_driver_name", {}),
    "--upgrade-detection": ("upgrade_detection", {"choices": ["off", "report", "evict"]}),
}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run the service (watch, reconcile, serve /livez /readyz /status /metrics)",
        description="Every setting also reads from the environment (SHARED_SVC_<NAME>, OPERATOR_NAMESPACE, KUBECONFIG); "
        "see docs/configuration.md.",
    )
    for flag, (field, kwargs) in FLAGS.items():
        description = Config.model_fields[field].description
        parser.add_argument(flag, dest=field, default=None, help=description, **kwargs)
    parser.set_defaults(handler=_run)


def load_config(args: argparse.Namespace) -> Config:
    overrides = {
        f: getattr(args, f) for _, (f, _) in FLAGS.items() if getattr(args, f, None) is not None
    }
    try:
        return Config(**overrides)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}" for e in exc.errors()
        )
        raise UsageError(f"invalid configuration: {problems}") from exc


def effective_config(config: Config) -> dict[str, Any]:
    """Every setting as the service uses it (after environment and flags), secrets hidden."""
    return {
        k: "<redacted>" if _SECRET.search(k) and v is not None else v
        for k, v in config.model_dump(mode="json").items()
    }


def _run(args: argparse.Namespace) -> int:
    config = load_config(args)
    from shared_svc import logs
    from shared_svc.service import Service

    logs.configure(config.log_level)
    log.info("starting", extra={"version": __version__, "config": effective_config(config)})

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await Service(config).run(stop)

    from shared_svc.service import ControllerCrashed

    try:
        asyncio.run(main())
    except ControllerCrashed as exc:
        print(f"shared-svc: {exc}", file=sys.stderr)
        return 1
    return 0
