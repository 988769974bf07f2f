"""The chart's README is generated from values.yaml (scripts/gen_chart_readme.py): every
value a row with its type, default and the comment above it; a README that disagrees with
values.yaml fails here."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from tests.test_config_doc import load_script

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gen_chart_readme.py"
CHART = REPO / "deploy" / "chart" / "shared-svc"


@pytest.fixture
def gen() -> ModuleType:
    return load_script(SCRIPT)


def table(text: str) -> dict[str, list[str]]:
    """The README's rows: key -> [type, default, description]."""
    out = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            out[cells[0].strip("`")] = cells[1:]
    return out


def leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out |= leaves(value, f"{prefix}{key}.")
        else:
            out[prefix + key] = value
    return out


def test_the_readme_is_generated_from_values_yaml(gen: ModuleType) -> None:
    assert (CHART / "README.md").read_text() == gen.render(), (
        "deploy/chart/shared-svc/README.md is stale: "
        "run .venv/bin/python scripts/gen_chart_readme.py --write"
    )


def test_every_value_is_a_documented_row_with_its_default(gen: ModuleType) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    rows = table(gen.render())
    for path in leaves(values):
        # the leaf's own row, or the row of the documented map that holds it whole
        row = next(
            (k for k in rows if path == k or (path.startswith(k + ".") and rows[k][1])), None
        )
        assert row is not None, f"{path}: no row"
        whole = values
        for part in row.split("."):
            whole = whole[part]
        assert rows[row][1] == "`{}`".format(
            json.dumps(whole, separators=(", ", ": ")).replace("|", "\\|")
        ), row
    undocumented = [k for k, (_, _, text) in rows.items() if not text]
    assert not undocumented, f"values.yaml: no `# --` comment above {undocumented}"
    # the comment above a key is its description, the helm-docs marker dropped
    assert rows["priorityClassName"][2].startswith("PriorityClass of the Deployment's")
    assert rows["nodeSelector"][1] == '`{"kubernetes.io/os": "linux"}`'
    assert rows["admission.certificate.source"][0] == "string"
    assert "serviceCA" in rows["admission.certificate.source"][2]


def test_a_readme_that_disagrees_with_values_yaml_fails_the_check(
    tmp_path: Path, gen: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    chart = tmp_path / "shared-svc"
    shutil.copytree(CHART, chart)
    monkeypatch.setattr(gen, "CHART", chart)
    monkeypatch.setattr(gen, "README", chart / "README.md")
    assert gen.main(["--check"]) == 0
    values = chart / "values.yaml"
    original = values.read_text()
    for changed in (
        original.replace("replicas: 2", "replicas: 3"),  # a default
        original.replace("one writes, the other", "one writes, another"),  # a description
        original + "# -- A new value.\nnewValue: 1\n",  # a value
    ):
        values.write_text(changed)
        assert gen.main(["--check"]) == 1, changed[-80:]
    assert gen.main(["--write"]) == 0 and gen.main(["--check"]) == 0
    assert "| `newValue` | int | `1` | A new value. |" in (chart / "README.md").read_text()
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"],
        capture_output=True, text=True, check=False, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
