"""testenv/prometheus/build.sh: the cache and lock of testenv/lib.sh, its own kind and key, the
two commands it builds (prometheus and promtool) and the version it stamps (with a stand-in
for go, as tests/test_testenv.py does)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.test_testenv import builds, fake_go_env

BUILD = Path(__file__).resolve().parents[1] / "testenv" / "prometheus" / "build.sh"


def build_twice_at_once(build: Path, env: dict[str, str]) -> tuple[set[str], list[tuple[str, str]]]:
    """Two runs of ``build`` started at once: both succeed and print one directory; returns
    it (a set of one) and each run's (stdout, stderr)."""
    runs = [
        subprocess.Popen(
            ["bash", str(build)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [run.communicate(timeout=60) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err for _, err in outputs]
    dirs = {out.strip() for out, _ in outputs}
    assert len(dirs) == 1, dirs
    return dirs, outputs


def test_prometheus_builds_started_at_once_build_once_into_their_own_cache_kind(
    tmp_path: Path,
) -> None:
    env = fake_go_env(tmp_path)
    dirs, outputs = build_twice_at_once(BUILD, env)
    logs = builds(tmp_path)
    assert len(logs) == 2, "prometheus and promtool, each built once"
    for log, cmd in zip(logs, ("prometheus", "promtool"), strict=True):
        assert "-mod=readonly" in log and f"github.com/prometheus/prometheus/cmd/{cmd}" in log
        assert "common/version.Version=3.5.0" in log, "v0.305.0 is Prometheus 3.5.0"
    assert any("waiting for it" in err for _, err in outputs), "the second run waited"
    (directory,) = map(Path, dirs)
    assert directory.parent == tmp_path / "cache" / "prometheus"
    assert all(os.access(directory / cmd, os.X_OK) for cmd in ("prometheus", "promtool"))

    again = subprocess.run(
        ["bash", str(BUILD)], env=env, capture_output=True, text=True, check=True
    )
    assert again.stdout.strip() == str(directory) and "cached build" in again.stderr
    assert len(builds(tmp_path)) == 2
