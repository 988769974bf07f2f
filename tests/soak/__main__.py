"""``python -m tests.soak [--steps N] [--seed S] [--budget SECONDS] [--plant BUG] [--workdir D]
[--history FILE] [--shrink]``: one soak (``make soak``); prints its report as JSON; exit 1
on a violation (its dump named). ``--history`` replays the steps a dump wrote (its
``steps``: a ``violation.json`` or a ``shrunk.json``) instead of a seed's; ``--shrink``
makes a violation's history shorter (tests/soak/runner.py ``shrink``) and writes it to
``shrunk.json`` beside the dump. SIGINT (Ctrl-C) or SIGTERM ends a run after the step in
progress, with the report so far."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from tests.soak import model as m
from tests.soak.replica import PLANTS
from tests.soak.runner import shrink, soak


def read_history(path: Path) -> list[tuple[m.Step, m.Model]]:
    """The steps a dump wrote, rebuilt; SystemExit with the reason if they cannot be."""
    try:
        data = json.loads(path.read_text())
        steps = [m.step_from_json(s) for s in data["steps"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"--history {path}: not a soak dump with its steps ({exc})") from None
    history = m.rebuild(steps)
    if history is None:
        raise SystemExit(f"--history {path}: its steps cannot be made in this order")
    return history


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__)
    parser.add_argument("--steps", type=int, default=10_000, help="steps of the history")
    parser.add_argument("--seed", type=int, default=1, help="the seed (the same one replays)")
    parser.add_argument("--budget", type=float, default=86400.0, help="seconds at most")
    parser.add_argument("--plant", choices=PLANTS, default="", help="a known bug to plant")
    parser.add_argument("--workdir", type=Path, default=None, help="kept after the run")
    parser.add_argument("--history", type=Path, default=None, help="replay a dump's steps")
    parser.add_argument("--shrink", action="store_true", help="shorten a violation's history")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.budget <= 0:
        parser.error("--steps and --budget must be positive")
    history = read_history(args.history) if args.history else None
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="shared-svc-soak-"))
    report = asyncio.run(
        soak(
            workdir,
            seed=args.seed,
            steps=len(history) if history else args.steps,
            budget=args.budget,
            plant=args.plant,
            progress=True,
            history=history,
        )
    )
    print(json.dumps(report.as_dict(), indent=1, default=str))
    if report.violation is None:
        return 0
    print(f"violation: {report.out}/violation.json; logs in {workdir}", file=sys.stderr)
    if args.shrink and report.out is not None:
        dump = json.loads((report.out / "violation.json").read_text())
        steps = [m.step_from_json(s) for s in dump["steps"]]
        what = report.violation["what"]
        shorter, runs = asyncio.run(shrink(workdir / "shrink", steps, what, plant=args.plant))
        out = report.out / "shrunk.json"
        out.write_text(
            json.dumps(
                {
                    "what": what,
                    "from": len(steps),
                    "runs": runs,
                    "history": [s.describe() for s in shorter],
                    "steps": [m.step_json(s) for s in shorter],
                    "replay": f"python -m tests.soak --history {out}"
                    + (f" --plant {args.plant}" if args.plant else ""),
                },
                indent=1,
            )
        )
        print(
            f"shrunk from {len(steps)} to {len(shorter)} steps in {runs} runs: {out}",
            file=sys.stderr,
        )
    return 1


if __name__ == "__main__":
    sys.exit(main())
