"""testenv/prometheus-operator/build.sh: the cache and lock of testenv/lib.sh, its own kind and
key, the version it stamps and the CRDs it takes from the module (with a stand-in for go, as
tests/test_testenv.py does)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.test_prometheus_build import build_twice_at_once
from tests.test_testenv import builds, fake_go_env

BUILD = Path(__file__).resolve().parents[1] / "testenv" / "prometheus-operator" / "build.sh"


def test_operator_builds_started_at_once_build_once_with_the_module_crds(tmp_path: Path) -> None:
    module = tmp_path / "module"
    (module / "example" / "prometheus-operator-crd").mkdir(parents=True)
    for kind in ("prometheuses", "servicemonitors"):
        crd = module / "example" / "prometheus-operator-crd" / f"monitoring.coreos.com_{kind}.yaml"
        crd.write_text(f"kind: CustomResourceDefinition # {kind}\n")
        crd.chmod(0o444)  # as the module cache keeps it
    env = {**fake_go_env(tmp_path), "FAKE_GO_MODULE": str(module)}
    dirs, outputs = build_twice_at_once(BUILD, env)
    (log,) = builds(tmp_path)
    assert "-mod=readonly" in log
    assert "github.com/prometheus-operator/prometheus-operator/cmd/operator" in log
    assert "common/version.Version=0.85.0" in log
    assert any("waiting for it" in err for _, err in outputs), "the second run waited"
    (directory,) = map(Path, dirs)
    assert directory.parent == tmp_path / "cache" / "prometheus-operator"
    assert os.access(directory / "operator", os.X_OK)
    assert sorted(p.name for p in (directory / "crds").iterdir()) == [
        "monitoring.coreos.com_prometheuses.yaml",
        "monitoring.coreos.com_servicemonitors.yaml",
    ]

    again = subprocess.run(
        ["bash", str(BUILD)], env=env, capture_output=True, text=True, check=True
    )
    assert again.stdout.strip() == str(directory) and "cached build" in again.stderr
    assert len(builds(tmp_path)) == 1
