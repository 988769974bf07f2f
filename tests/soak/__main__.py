"""``python -m tests.soak [--steps N] [--seed S] [--budget SECONDS] [--plant BUG] [--workdir D]``:
one soak (``make soak``); prints its report as JSON; exit 1 on a violation (its dump named).
SIGINT (Ctrl-C) or SIGTERM ends it after the step in progress, with the report so far."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from tests.soak.replica import PLANTS
from tests.soak.runner import soak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__)
    parser.add_argument("--steps", type=int, default=10_000, help="steps of the history")
    parser.add_argument("--seed", type=int, default=1, help="the seed (the same one replays)")
    parser.add_argument("--budget", type=float, default=86400.0, help="seconds at most")
    parser.add_argument("--plant", choices=PLANTS, default="", help="a known bug to plant")
    parser.add_argument("--workdir", type=Path, default=None, help="kept after the run")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.budget <= 0:
        parser.error("--steps and --budget must be positive")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="shared-svc-soak-"))
    report = asyncio.run(
        soak(
            workdir,
            seed=args.seed,
            steps=args.steps,
            budget=args.budget,
            plant=args.plant,
            progress=True,
        )
    )
    print(json.dumps(report.as_dict(), indent=1, default=str))
    if report.violation is not None:
        print(f"violation: {report.out}/violation.json; logs in {workdir}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
