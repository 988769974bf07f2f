"""``shared-svc run``: the long-running service. Every setting is a flag (generated from
``shared_svc.config.Config``); flags override the environment."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import sys
from typing import Any

from shared_svc import __version__
from shared_svc.config import Config, add_flags, flag_values, load, unknown_env
from shared_svc.errors import UsageError

log = logging.getLogger("shared_svc")

# Settings never logged as they are (none holds a credential today; the kubeconfig is a path).
_SECRET = re.compile(r"token|password|secret|credential", re.IGNORECASE)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run the service (watch, reconcile, serve /livez /readyz /status /metrics)",
        description="Run the service. Every setting is a flag and an environment variable "
        "(shown with its default after each flag); a flag overrides its environment "
        "variable, which overrides the default. See docs/configuration.md.",
    )
    add_flags(parser)
    parser.set_defaults(handler=_run)


def load_config(args: argparse.Namespace) -> Config:
    """The settings of ``run``: its flags over the environment over the defaults."""
    return load(flag_values(args))


def effective_config(config: Config) -> dict[str, Any]:
    """Every setting as the service uses it (after environment and flags), secrets hidden."""
    return {
        k: "<redacted>" if _SECRET.search(k) and v is not None else v
        for k, v in config.model_dump(mode="json").items()
    }


def _run(args: argparse.Namespace) -> int:
    warnings = unknown_env(os.environ)
    try:
        config = load_config(args)
    except UsageError:
        for warning in warnings:  # a misspelt name may be why (one of a pair, say)
            print(f"shared-svc: warning: {warning}", file=sys.stderr)
        raise
    from shared_svc import logs
    from shared_svc.service import Service

    logs.configure(config.log_level)
    for warning in warnings:
        log.warning(warning)
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
