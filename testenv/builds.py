"""The one way a cached Go build of the checkout (gpu-operator's, Prometheus') is run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def cached_build(
    script: Path,
    *args: str,
    override_env: str | None,
    what: str,
    error: type[Exception],
) -> Path:
    """Runs ``script`` with ``args`` (cached by content; ``nice -n 10``: it is heavy) and
    returns the directory its last line of output names. ``$override_env`` names such a
    directory instead. A missing script or a failed build raises ``error`` (the caller's
    own: ``testenv.ControlPlaneError`` and its kin), saying which (the build's own output
    has gone to stderr)."""
    override = os.environ.get(override_env) if override_env else None
    if override:
        return Path(override)
    if not script.exists():
        raise error(f"{script} not found: {what} needs a source checkout")
    proc = subprocess.run(
        ["nice", "-n", "10", "bash", str(script), *args],
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise error(f"{what} build failed (exit {proc.returncode}); see the output above")
    return Path(proc.stdout.strip().splitlines()[-1])
