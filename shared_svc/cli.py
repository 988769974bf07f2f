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

# Command families, in the order they appear in --help.
_COMMAND_MODULES = (
    "shared_svc.commands.plan",
    "shared_svc.commands.run",
    "shared_svc.commands.upgrade",
    "shared_svc.commands.admission",
    "shared_svc.commands.demo",
    "shared_svc.commands.testenv",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shared-svc",
        description="Shared DCGM Services for gpu-operator (ClusterPolicy and GPUCluster).",
    )
    parser.add_argument("--version", action="version", version=f"shared-svc {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # a command family not built yet
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
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
