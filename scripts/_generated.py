"""The command line of the project's generators of checked files (scripts/gen_*.py): print
the generated text, ``--write`` it, or ``--check`` that the file holds it (exit 1 when
stale; a test runs each check)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def main(
    argv: list[str] | None, *, script: str, doc: str, target: Path, render: Callable[[], str]
) -> int:
    """``script``: the generator's file; ``doc``: its docstring (the help's first line);
    ``target``: the generated file; ``render``: its text."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"rewrite {target.name}")
    mode.add_argument("--check", action="store_true", help=f"exit 1 if {target.name} is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        target.write_text(text)
        print(f"wrote {target}", file=sys.stderr)
    elif args.check:
        if not target.exists() or target.read_text() != text:
            print(
                f"{target} is stale: run python scripts/{Path(script).name} --write",
                file=sys.stderr,
            )
            return 1
    else:
        sys.stdout.write(text)
    return 0
