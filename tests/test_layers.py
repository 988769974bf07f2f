"""The house (issue 11): which part of ``shared_svc`` may import which, read with ``ast``.

- ``shared_svc/k8s/`` (pure Kubernetes object helpers) imports nothing of ``shared_svc``
  but itself;
- the pure cores, ``reconcile/`` and every module of ``upgrade/`` but its shell
  (:data:`UPGRADE_SHELL`), import no I/O: neither ``kube``, ``runtime``, ``service``,
  ``controller``, the upgrade shell, nor aiohttp, kubernetes_asyncio or prometheus_client;
- ``wait/`` (the loop helper and the rate limiters: apimachinery's ``util/wait``) imports
  nothing of ``shared_svc`` but itself;
- ``kube/`` (generic API I/O) imports neither core nor ``runtime/`` (it sits below the
  runtime, on ``wait/`` and ``k8s/``, as client-go's ``tools/cache`` on apimachinery);
- both controllers run on the one runtime (``shared_svc.runtime``);
- no class of ``shared_svc`` is over 300 lines, no function over 80 (issue 21: split by
  concern);
- each package of the table in docs/architecture.md ("Layers") imports of ``shared_svc``
  only what its row allows: the doc and this test say one house.

Every import counts: inside functions and ``TYPE_CHECKING`` blocks too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "shared_svc"

# The modules of upgrade/ that do I/O or hold the controller: the rest of upgrade/ is pure.
UPGRADE_SHELL: set[str] = set()

IO_MODULES = (
    "shared_svc.kube",
    "shared_svc.runtime",
    "shared_svc.wait",
    "shared_svc.service",
    "shared_svc.controllers",
    *(f"shared_svc.upgrade.{m}" for m in sorted(UPGRADE_SHELL)),
    "aiohttp",
    "kubernetes_asyncio",
    "prometheus_client",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports (relative imports resolved; ``from a import b`` counts
    as ``a`` and ``a.b``, as ``b`` may be a module)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


MODULES = sorted(PACKAGE.rglob("*.py"))


def modules_under(*parts: str) -> list[Path]:
    return [p for p in MODULES if p.relative_to(PACKAGE).parts[: len(parts)] == parts]


def pure_core_modules() -> list[Path]:
    upgrade = [p for p in modules_under("upgrade") if p.stem not in UPGRADE_SHELL]
    return modules_under("reconcile") + upgrade


def test_the_layers_are_found() -> None:
    """The test reads real modules (a moved package would otherwise pass unnoticed)."""
    assert {p.stem for p in modules_under("k8s")} >= {"objects", "selectors", "events"}
    assert {p.stem for p in pure_core_modules()} >= {"planner", "selection", "gate", "consumers"}
    assert {p.stem for p in modules_under("wait")} >= {"loop", "ratelimit", "runnable"}
    assert {p.stem for p in modules_under("kube")} >= {
        "reflector",
        "store",
        "registry",
        "untrusted",
        "writer",
        "recorder",
        "resources",
    }
    assert (PACKAGE / "controllers" / "upgrade" / "io.py").is_file()


@pytest.mark.parametrize("path", modules_under("k8s"), ids=module_name)
def test_k8s_helpers_import_nothing_of_shared_svc_but_themselves(path: Path) -> None:
    outside = sorted(
        m for m in imports_of(path) if within(m, "shared_svc") and not within(m, "shared_svc.k8s")
    )
    assert not outside, f"{module_name(path)} imports {outside}"


@pytest.mark.parametrize("path", pure_core_modules(), ids=module_name)
def test_pure_cores_import_no_io(path: Path) -> None:
    io = sorted(m for m in imports_of(path) if any(within(m, p) for p in IO_MODULES))
    assert not io, f"{module_name(path)} (a pure core) imports {io}"


@pytest.mark.parametrize("path", modules_under("wait"), ids=module_name)
def test_wait_helpers_import_nothing_of_shared_svc_but_themselves(path: Path) -> None:
    outside = sorted(
        m for m in imports_of(path) if within(m, "shared_svc") and not within(m, "shared_svc.wait")
    )
    assert not outside, f"{module_name(path)} imports {outside}"


@pytest.mark.parametrize("path", modules_under("kube"), ids=module_name)
def test_kube_imports_no_runtime(path: Path) -> None:
    above = sorted(m for m in imports_of(path) if within(m, "shared_svc.runtime"))
    assert not above, f"{module_name(path)} (below the runtime) imports {above}"


@pytest.mark.parametrize("path", modules_under("kube"), ids=module_name)
def test_kube_imports_neither_core(path: Path) -> None:
    cores = sorted(
        m
        for m in imports_of(path)
        if within(m, "shared_svc.reconcile") or within(m, "shared_svc.upgrade")
    )
    assert not cores, f"{module_name(path)} (generic I/O) imports {cores}"


@pytest.mark.parametrize(
    "path", [PACKAGE / "controllers" / c / "reconciler.py" for c in ("services", "upgrade")]
)
def test_both_controllers_run_on_the_one_runtime(path: Path) -> None:
    assert any(within(m, "shared_svc.runtime") for m in imports_of(path)), (
        f"{module_name(path)} does not import shared_svc.runtime"
    )


MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 80


def test_no_class_of_shared_svc_is_over_300_lines_nor_a_function_over_80() -> None:
    """Issue 21: each part split by concern (the Services and upgrade shells, the reflector)."""
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > limit:
                    relative = path.relative_to(PACKAGE.parent)
                    too_long.append(f"{relative}:{node.lineno} {node.name} ({length} lines)")
    assert too_long == []


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
# The rows of the table, by their first cell: the modules each row speaks of.
LAYER_ROWS = {
    "k8s/": lambda: modules_under("k8s"),
    "wait/": lambda: modules_under("wait"),
    "reconcile/": lambda: modules_under("reconcile"),
    "upgrade/ cores": lambda: [p for p in modules_under("upgrade") if p.stem not in UPGRADE_SHELL],
    "kube/": lambda: modules_under("kube"),
    "runtime/": lambda: modules_under("runtime"),
}


def layer_table() -> dict[str, set[str]]:
    """docs/architecture.md's "Layers" table: package -> the shared_svc modules it may
    import (``k8s/`` -> ``shared_svc.k8s``)."""
    text = ARCHITECTURE.read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        allowed = re.findall(r"`([^`]+)`", cells[2])
        rows[cells[0].strip("`")] = {"shared_svc." + a.rstrip("/") for a in allowed}
    return rows


def test_the_architecture_table_names_every_guarded_layer() -> None:
    assert set(layer_table()) == set(LAYER_ROWS)


@pytest.mark.parametrize("row", sorted(LAYER_ROWS))
def test_each_layer_imports_only_what_the_architecture_table_allows(row: str) -> None:
    allowed = layer_table()[row]
    for path in LAYER_ROWS[row]():
        own = module_name(path).split(".")[:2]
        outside = sorted(
            m
            for m in imports_of(path)
            if within(m, "shared_svc")
            and not within(m, ".".join(own))
            and not any(within(m, a) for a in allowed)
            and m != "shared_svc"
        )
        assert not outside, f"{module_name(path)} ({row}) imports {outside}"
