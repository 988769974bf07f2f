"""``shared-svc --help`` and ``plan`` load no Kubernetes client: commands are imported lazily."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from shared_svc import cli
from tests.worlds import cluster_policy

PROBE = """
import json, sys
from shared_svc.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:  # --help
    code = exc.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"kubernetes_asyncio", "aiohttp", "prometheus_client"})
commands = sorted(m for m in sys.modules if m.startswith("shared_svc.commands."))
print(json.dumps({"code": code, "heavy": heavy, "commands": commands}), file=sys.stderr)
"""


def loaded(*args: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, check=False
    )
    result: dict[str, object] = json.loads(proc.stderr.strip().splitlines()[-1])
    return result


def test_help_imports_no_command_module() -> None:
    assert loaded("--help") == {"code": 0, "heavy": [], "commands": []}


def test_plan_imports_only_its_module_and_no_kubernetes_client(tmp_path: Path) -> None:
    manifest = tmp_path / "cp.json"
    manifest.write_text(json.dumps(cluster_policy()))
    assert loaded("plan", "-f", str(manifest)) == {
        "code": 0,
        "heavy": [],
        "commands": [
            "shared_svc.commands.plan",
            "shared_svc.commands.plan.json_stream",
            "shared_svc.commands.plan.manifests",
            "shared_svc.commands.plan.yaml_stream",
            "shared_svc.commands.plan.yaml_text",
        ],
    }


@pytest.mark.parametrize("name", list(cli._COMMANDS))
def test_the_listed_help_is_the_command_modules_own(name: str) -> None:
    full = cli.build_parser()  # every module loaded
    lazy = cli.build_parser(["--help"])  # none loaded
    [full_action] = [a for a in full._actions if isinstance(a, argparse._SubParsersAction)]
    [lazy_action] = [a for a in lazy._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {
        which: {c.dest: c.help for c in action._choices_actions}
        for which, action in (("full", full_action), ("lazy", lazy_action))
    }
    assert helps["lazy"][name] == helps["full"][name]
    assert list(helps["lazy"]) == list(helps["full"])
