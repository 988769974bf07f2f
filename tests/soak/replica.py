"""``shared-svc`` for the soak: ``python -m tests.soak.replica PLANT ARGS...`` runs the CLI
with ``ARGS``, after planting the known bug ``PLANT`` (``-``: none). The product has no
such switch: the bug is planted here, in the test's own process wrapper.

Plants:
- ``owner-refs``: a Service that two CRs need gets the reference of only the first (the
  contract: one reference per CR that needs it).
- ``no-hold``: ``nvidia-dcgm`` moves to the selector the rules choose at once, even to
  one that covers fewer nodes (the Services contract's section 4: the hold).
- ``restart-frees``: the restart-only rule never holds, so shared-svc frees the consumers
  of a node whose driver only restarts in place (the upgrade contract's section 3).
"""

from __future__ import annotations

import sys
from typing import Any


def _owner_refs() -> None:
    from shared_svc.reconcile import planner

    real = getattr(planner, "owner_refs_for")  # noqa: B009 (not exported: planted over)

    def first_only(crs: Any) -> Any:
        return real(crs)[:1]

    setattr(planner, "owner_refs_for", first_only)  # noqa: B010


def _no_hold() -> None:
    from shared_svc.reconcile import selection

    setattr(selection, "hold", lambda *args, **kwargs: None)  # noqa: B010


def _restart_frees() -> None:
    from shared_svc.upgrade import paths

    setattr(paths, "restart_only", lambda *args, **kwargs: False)  # noqa: B010


PLANTS = {"owner-refs": _owner_refs, "no-hold": _no_hold, "restart-frees": _restart_frees}


def plant(name: str) -> None:
    if name == "-":
        return
    if name not in PLANTS:
        raise SystemExit(f"unknown plant {name!r}; known: {', '.join(PLANTS)}")
    PLANTS[name]()


def main() -> int:
    plant(sys.argv[1])
    from shared_svc.cli import main as cli

    return cli(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
