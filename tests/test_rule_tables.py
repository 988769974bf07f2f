"""The rule tables stay true: every ``module:function`` and test they name exists (issue 11).

docs/reconcile.md and docs/upgrade.md map each rule of the behaviour contracts to the pure
function that implements it (``planner.py:plan_node``, relative to the core's package, or
``shared_svc/k8s/selectors.py:parse_selector`` from the repository root); docs/upgrade.md
also names the tests that prove it (``test_x.py::test_y`` in tests/, or a path from the root).
A rename that forgets the table fails here.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Contract rule -> module:function\n"
FUNCTION = re.compile(r"`([\w/]+\.py):([A-Za-z_][\w.]*)`")
TEST = re.compile(r"`([\w/]+\.py)::(\w+)`")
TABLES = {"reconcile.md": "shared_svc/reconcile", "upgrade.md": "shared_svc/upgrade"}


def rows(doc: str) -> list[str]:
    """The body rows of the table under the rule-table heading."""
    text = (ROOT / "docs" / doc).read_text()
    assert text.count(HEADING) == 1, f"docs/{doc} has no single {HEADING.strip()!r} section"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    return lines[2:]  # header and separator


def resolve(path: str, dotted: str, package: str) -> Any:
    file = ROOT / (path if "/" in path else f"{package}/{path}")
    assert file.is_file(), f"{file.relative_to(ROOT)} does not exist"
    module = importlib.import_module(".".join(file.relative_to(ROOT).with_suffix("").parts))
    obj: Any = module
    for part in dotted.split("."):
        assert hasattr(obj, part), f"{path}:{dotted}: no {part!r} in {obj!r}"
        obj = getattr(obj, part)
    return obj


def defined_tests(path: str) -> set[str]:
    file = ROOT / (path if "/" in path else f"tests/{path}")
    assert file.is_file(), f"{file.relative_to(ROOT)} does not exist"
    tree = ast.parse(file.read_text())
    return {
        n.name
        for n in tree.body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name.startswith("test")
    }


@pytest.mark.parametrize("doc", sorted(TABLES))
def test_every_function_a_rule_table_names_exists(doc: str) -> None:
    found = rows(doc)
    assert len(found) >= 20, f"docs/{doc}: the rule table is gone or was not found"
    for row in found:
        where = row.rsplit("|", 3)[-3] if doc == "upgrade.md" else row.rsplit("|", 2)[-2]
        named = FUNCTION.findall(where)
        assert named, f"docs/{doc}: a rule without a function: {row[:100]}"
        for path, dotted in named:
            assert callable(resolve(path, dotted, TABLES[doc])), f"{path}:{dotted}"


def test_every_upgrade_rule_names_tests_that_exist() -> None:
    for row in rows("upgrade.md"):
        proved_by = row.rsplit("|", 2)[-2]
        named = TEST.findall(proved_by)
        assert named, f"docs/upgrade.md: a rule without a test: {row[:100]}"
        for path, name in named:
            assert name in defined_tests(path), f"{path}::{name} does not exist"


def test_the_fight_and_dedup_rules_are_in_the_reconcile_table() -> None:
    text = "\n".join(rows("reconcile.md"))
    for name in ("fight_verdict", "fight_report", "warnings_to_emit", "next_active"):
        assert f"`fight.py:{name}`" in text


def test_every_test_the_reconcile_table_names_exists() -> None:
    named = [found for row in rows("reconcile.md") for found in TEST.findall(row)]
    # The amended section 7 (issue 28) names its tests; a row may name none.
    assert any("test_monitor_selection_props.py" in path for path, _ in named), named
    for path, name in named:
        assert name in defined_tests(path), f"{path}::{name} does not exist"
