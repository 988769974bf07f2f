"""Command line: one entry point, one module per command family.

Each command module exposes ``register(subparsers)`` which adds its parser and sets
``handler`` (a callable taking the parsed namespace and returning an exit code).
Imports are lazy so that ``shared-svc plan`` never loads the API client.

Every parser, at every level, is a ``Parser``: plain-text help wrapped to 80 columns
(descriptions keep their paragraphs; defaults are shown), and a missing subcommand is
argparse's usage and error on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

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


WIDTH = 80


def plain(text: str) -> str:
    """Help text without the reStructuredText quoting of docstrings (``x`` -> x)."""
    return re.sub(r"`+", "", text)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Plain text at most 80 columns wide, whatever the terminal: descriptions are
    re-wrapped paragraph by paragraph (blank lines kept, as RawDescriptionHelpFormatter
    keeps them), and a default that says something is shown after the help."""

    def __init__(self, prog: str, **kwargs: Any) -> None:
        kwargs["width"] = min(kwargs.get("width") or WIDTH, WIDTH)
        super().__init__(prog, **kwargs)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = re.split(r"\n\s*\n", plain(text).strip())
        return "\n\n".join(
            textwrap.fill(
                " ".join(p.split()),
                width,
                initial_indent=indent,
                subsequent_indent=indent,
                break_on_hyphens=False,
            )
            for p in paragraphs
        )

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(plain(text).split()), width, break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        unsaid = action.default is None or action.default is False or action.default == []
        if unsaid or action.default is argparse.SUPPRESS or "default" in text:
            return text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """Every parser of the command line, subcommands included (``add_subparsers`` makes
    parsers of the class of their parent): the same help format everywhere."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["formatter_class"] = HelpFormatter
        super().__init__(*args, **kwargs)


def _command_of(argv: Sequence[str]) -> str | None:
    """The command word of ``argv`` (the top-level options take no values)."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; with ``argv``, only the module of its command is imported."""
    parser = Parser(
        prog="shared-svc",
        description="Shared DCGM Services for gpu-operator (ClusterPolicy and GPUCluster).",
        epilog="Run 'shared-svc COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"shared-svc {__version__}")
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", title="commands", required=True
    )
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
    args = parser.parse_args(argv)  # a missing command: usage and error on stderr, exit 2
    try:
        code: int = args.handler(args)
    except UsageError as exc:
        print(f"shared-svc: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
