"""Session fixture: a real etcd + kube-apiserver on 127.0.0.1 (see shared_svc.testenv)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from shared_svc import testenv

UPSTREAM_CRDS = Path(__file__).resolve().parents[2] / "shared" / "crds"


@pytest.fixture(scope="session")
def control_plane() -> Iterator[testenv.ControlPlane]:
    """Started once per session; stopped at the end even when tests fail."""
    try:
        cp = testenv.start()
    except testenv.ControlPlaneError as exc:
        pytest.fail(f"test control plane did not start: {exc}", pytrace=False)
    try:
        yield cp
    finally:
        cp.stop()
