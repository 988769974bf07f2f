"""``shared-svc`` for the soak: ``python -m tests.soak.replica PLANT ARGS...`` runs the CLI
with ``ARGS``, after planting the known bug ``PLANT`` (``-``: none). The product has no
such switch: the bug is planted here, in the test's own process wrapper.

Plants:
- ``owner-refs``: a Service that two CRs need gets the reference of only the first (the
  contract: one reference per CR that needs it).
"""

from __future__ import annotations

import sys
from typing import Any

PLANTS = ("owner-refs",)


def plant(name: str) -> None:
    if name == "-":
        return
    if name not in PLANTS:
        raise SystemExit(f"unknown plant {name!r}; known: {', '.join(PLANTS)}")
    from shared_svc.reconcile import planner

    real = getattr(planner, "owner_refs_for")  # noqa: B009 (not exported: planted over)

    def first_only(crs: Any) -> Any:
        return real(crs)[:1]

    setattr(planner, "owner_refs_for", first_only)  # noqa: B010


def main() -> int:
    plant(sys.argv[1])
    from shared_svc.cli import main as cli

    return cli(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
