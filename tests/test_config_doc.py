"""docs/configuration.md is generated from the settings model, and the Helm chart
offers (or deliberately fixes) every setting."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from shared_svc.config import Config, flag
from tests.test_deploy_chart import UPGRADE_ON, VALUE_CASES, container_env, render_docs

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gen_config_doc.py"


def load_script(script: Path = SCRIPT) -> ModuleType:
    """A generator of scripts/ as a module (its directory on the path while it imports
    ``_generated``, as when it runs)."""
    spec = importlib.util.spec_from_file_location(script.stem, script)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(script.parent))
        spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    return load_script()


def test_configuration_doc_is_generated_from_the_model(gen: ModuleType) -> None:
    assert (REPO / "docs" / "configuration.md").read_text() == gen.render(), (
        "docs/configuration.md is stale: run .venv/bin/python scripts/gen_config_doc.py --write"
    )


def test_doc_has_one_row_per_setting_with_env_and_flag(gen: ModuleType) -> None:
    rows = [line for line in gen.render().splitlines() if line.startswith("| `")]
    assert [row.split("|")[1].strip(" `") for row in rows] == list(Config.model_fields)
    for row, (name, info) in zip(rows, Config.model_fields.items(), strict=True):
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
        assert gen.env_names(name, info)[0] in cells[1]
        assert cells[2] == f"`{flag(name)}`"
        assert "**missing**" not in cells[5], f"{name}: the chart neither offers nor fixes it"
        assert info.description and info.description.replace("|", "\\|") == cells[6]


def test_check_mode_fails_on_a_stale_doc(
    tmp_path: Path, gen: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text(gen.render().replace("`gpu-operator`", "`elsewhere`"))
    monkeypatch.setattr(gen, "DOC", stale)
    assert gen.main(["--check"]) == 1
    assert gen.main(["--write"]) == 0 and gen.main(["--check"]) == 0
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr


def test_every_setting_is_a_chart_value_or_deliberately_fixed(gen: ModuleType) -> None:
    fields = set(Config.model_fields)
    assert set(gen.CHART_VALUES).isdisjoint(gen.NOT_IN_CHART)
    assert set(gen.CHART_VALUES) | set(gen.NOT_IN_CHART) == fields, (
        f"not covered by the chart: {sorted(fields - set(gen.CHART_VALUES) - set(gen.NOT_IN_CHART))}"
    )
    # The values the doc names are the ones proven to reach the service (test_deploy_chart).
    proven = {
        field: expression.split("=", 1)[0] for expression, (_, field, _) in VALUE_CASES.items()
    }
    assert {**proven, "leader_election": "leaderElection.enabled"} == gen.CHART_VALUES


@pytest.mark.helm
def test_settings_the_chart_fixes_are_fixed_in_the_deployment(gen: ModuleType) -> None:
    env = container_env(render_docs(*UPGRADE_ON))
    assert env["OPERATOR_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    for field in ("kubeconfig", "bind_address"):
        assert not set(gen.env_names(field, Config.model_fields[field])) & set(env)
    assert set(gen.NOT_IN_CHART) == {
        "namespace",
        "pod_name",
        "kubeconfig",
        "bind_address",
        # the webhook's certificate: the mounted Secret of admission.certificate
        "webhook_cert_file",
        "webhook_key_file",
    }
