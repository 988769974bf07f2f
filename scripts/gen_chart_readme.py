"""Generates the chart's README (deploy/chart/shared-svc/README.md) from its values.yaml.

    python scripts/gen_chart_readme.py            # print the README
    python scripts/gen_chart_readme.py --write    # rewrite the README
    python scripts/gen_chart_readme.py --check    # exit 1 if the README is stale

Every value is a row of the README's table: its key, type, default and description. The
description is the comment block right above the key in values.yaml (helm-docs' ``# --``
marker is dropped; a block parted from the key by an empty line describes nothing). A key
is a row when it is a leaf (a scalar, a list, an empty map) or a documented map none of
whose keys is documented (its whole default is the cell); a documented map with documented
keys is a row of its own (type object, no default) above the rows of its keys.
tests/test_chart_readme.py keeps the README and values.yaml in step. Plain Python and
PyYAML (a dependency of the project already): nothing to download.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, NamedTuple

import _generated as generated  # scripts/_generated.py (this directory)
import yaml

CHART = Path(__file__).resolve().parent.parent / "deploy" / "chart" / "shared-svc"
README = CHART / "README.md"
KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.\"/-]+):(?: |$)")


class Row(NamedTuple):
    key: str
    type: str
    default: str  # Markdown
    description: str


def comments(values_text: str) -> dict[str, str]:
    """key path -> the comment block right above the key (a mapping key of values.yaml)."""
    out: dict[str, str] = {}
    stack: list[tuple[int, str]] = []  # (indent, key) of the enclosing keys
    block: list[str] = []
    for line in values_text.splitlines():
        stripped = line.strip()
        if not stripped:
            block = []
            continue
        if stripped.startswith("#"):
            text = stripped[1:].strip()
            block.append(text[2:].strip() if text.startswith("--") else text)
            continue
        match = KEY.match(line)
        if match is None:  # a list item or a continued value: not a key
            block = []
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, match["key"].strip('"')))
        if block:
            out[".".join(k for _, k in stack)] = " ".join(block)
        block = []
    return out


def type_of(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    if value is None:
        return "null"
    return "object"


def cell(text: str) -> str:
    """Text in a table cell: no column break, no HTML tag."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def default_of(value: Any) -> str:
    return "`{}`".format(json.dumps(value, separators=(", ", ": ")).replace("|", "\\|"))


def rows(values: dict[str, Any], documented: dict[str, str], prefix: str = "") -> list[Row]:
    out: list[Row] = []
    for key, value in values.items():
        path = prefix + key
        text = cell(documented.get(path, ""))
        inner = [k for k in documented if k.startswith(path + ".")]
        if isinstance(value, dict) and value and (inner or path not in documented):
            if path in documented:
                out.append(Row(path, "object", "", text))
            out += rows(value, documented, path + ".")
        else:
            out.append(Row(path, type_of(value), default_of(value), text))
    return out


def render() -> str:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values_text = (CHART / "values.yaml").read_text()
    table = rows(yaml.safe_load(values_text), comments(values_text))
    lines = [
        f"# {chart['name']}",
        "",
        "<!-- Generated from values.yaml by scripts/gen_chart_readme.py; DO NOT EDIT.",
        "     Regenerate: .venv/bin/python scripts/gen_chart_readme.py --write -->",
        "",
        f"Version {chart['version']}, app version {chart['appVersion']}, "
        f"Kubernetes `{chart['kubeVersion']}`.",
        "",
        " ".join(chart["description"].split()),
        "",
        "```sh",
        "helm install shared-svc deploy/chart/shared-svc -n gpu-operator",
        "```",
        "",
        "Install, upgrade (`--reset-then-reuse-values` or a values file), uninstall, Argo CD and",
        "OpenShift: docs/install.md. Every setting of the service: docs/configuration.md.",
        "",
        "## Values",
        "",
        "| Key | Type | Default | Description |",
        "|-----|------|---------|-------------|",
    ]
    lines += [f"| `{r.key}` | {r.type} | {r.default} | {r.description} |" for r in table]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return generated.main(argv, script=__file__, doc=__doc__ or "", target=README, render=render)


if __name__ == "__main__":
    sys.exit(main())
