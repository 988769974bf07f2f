"""docs/plan.md stays true: each example's output in the doc is exactly what plan prints."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shared_svc.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "plan.md").read_text()
EXAMPLE = re.compile(
    r"<!-- example: (?P<file>[\w.-]+) -->\n```console\n\$ shared-svc plan -f docs/examples/(?P=file)\n```\n\n```yaml\n(?P<out>.*?)```\n",
    re.DOTALL,
)
FOUND = {m["file"]: m["out"] for m in EXAMPLE.finditer(DOC)}


def test_the_doc_has_the_three_worked_examples() -> None:
    assert sorted(FOUND) == [
        "exporter-type-conflict.yaml",
        "fresh-clusterpolicy.yaml",
        "migration-gate-closed.yaml",
    ]


@pytest.mark.parametrize("name", sorted(FOUND))
def test_example_output_matches_the_doc(
    name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    assert main(["plan", "-f", f"docs/examples/{name}"]) == 0
    assert capsys.readouterr().out == FOUND[name]
