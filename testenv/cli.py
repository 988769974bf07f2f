"""``python -m testenv``: the checkout's development commands (not in the wheel).

``demo [--with-gpu-operator] [--keep]`` walks through shared-svc on the embedded test
control plane (``make demo``); ``start``, ``stop`` and ``status`` run that control plane
by hand. The installed ``shared-svc`` command has neither: both need this checkout
(``testenv/build.sh`` and its Go modules, the chart).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from shared_svc.errors import UsageError
from testenv import controlplane_cli, demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m testenv",
        description="Development commands of the shared-svc checkout: the demo and the "
        "embedded test control plane (etcd + kube-apiserver).",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo.register(subparsers)
    controlplane_cli.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.handler(args)
    except UsageError as exc:
        print(f"testenv: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code
