"""Command line: one entry point, one module per command family.

Each command module exposes ``register(subparsers)`` which adds its parser and sets
``handler`` (a callable taking the parsed namespace and returning an exit code).
Imports are lazy so that ``shared-svc plan`` never loads the API client.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from shared_svc import __version__
from shared_svc.errors import UsageError

# Command families, in the order they appear in --help, with their one-line help: only the
# module of the command given is imported (``--help`` imports none of them).
_COMMANDS = {
    "plan": (
        "shared_svc.commands.plan",
        "show the Services the reconciler would manage, offline, from manifests",
    ),
    "run": (
        "shared_svc.commands.run",
        "run the service (watch, reconcile, serve /livez /readyz /status /metrics)",
    ),
    "upgrade": (
        "shared_svc.commands.upgrade",
        "driver-upgrade consumers: opt a DaemonSet in to parking; show upgrading nodes",
    ),
    "admission": (
        "shared_svc.commands.admission",
        "the admission guard's certificate and uninstall steps (the chart's hook Jobs)",
    ),
}
_COMMAND_MODULES = tuple(module for module, _ in _COMMANDS.values())


def _command_of(argv: Sequence[str]) -> str | None:
    """The command word of ``argv`` (the top-level options take no values)."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; with ``argv``, only the module of its command is imported."""
    parser = argparse.ArgumentParser(
        prog="shared-svc",
        description="Shared DCGM Services for gpu-operator (ClusterPolicy and GPUCluster).",
    )
    parser.add_argument("--version", action="version", version=f"shared-svc {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = None if argv is None else _command_of(argv)
    for name, (module_name, help_text) in _COMMANDS.items():
        if argv is not None and name != chosen:
            subparsers.add_parser(name, help=help_text)  # listed in --help, not loaded
            continue
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        code: int = handler(args)
    except UsageError as exc:
        print(f"shared-svc: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
